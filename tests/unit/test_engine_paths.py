"""Engine and worker classes load by path; the reference engines' old ``raydp.engine`` paths too, with a warning."""

from __future__ import annotations

import warnings

import pytest

from raydp.engine.core import load_engine_class
from raydp.errors import ConfigError
from raydp.models.echo import EchoEngine
from raydp.models.echo_workers import EchoWorker, WorkerEchoEngine
from raydp.models.tiny_lm import TinyLMEngine
from raydp.models.tp_lm import TPLMEngine, TPLMWorker
from raydp.workers.runtime import load_worker_class

pytestmark = pytest.mark.timeout(60)

MOVED = [
    ("raydp.engine:EchoEngine", "raydp.models.echo:EchoEngine", EchoEngine),
    ("raydp.engine.core:EchoEngine", "raydp.models.echo:EchoEngine", EchoEngine),
    ("raydp.engine.tiny_lm:TinyLMEngine", "raydp.models.tiny_lm:TinyLMEngine", TinyLMEngine),
    ("raydp.engine.tp_lm:TPLMEngine", "raydp.models.tp_lm:TPLMEngine", TPLMEngine),
    ("raydp.engine.echo_workers:WorkerEchoEngine", "raydp.models.echo_workers:WorkerEchoEngine", WorkerEchoEngine),
]


@pytest.mark.parametrize(("old", "new", "cls"), MOVED)
def test_an_old_engine_path_loads_the_moved_class_with_a_deprecation_warning(old: str, new: str, cls: type) -> None:
    with pytest.warns(DeprecationWarning, match=f"use '{new}'"):
        assert load_engine_class(old) is cls


@pytest.mark.parametrize("path", sorted({new for _, new, _ in MOVED}))
def test_a_current_engine_path_loads_without_a_warning(path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_engine_class(path)


def test_old_worker_class_paths_load_too() -> None:
    with pytest.warns(DeprecationWarning, match="raydp.models.tp_lm:TPLMWorker"):
        assert load_worker_class("raydp.engine.tp_lm:TPLMWorker") is TPLMWorker
    with pytest.warns(DeprecationWarning, match="raydp.models.echo_workers:EchoWorker"):
        assert load_worker_class("raydp.engine.echo_workers:EchoWorker") is EchoWorker


def test_importing_echo_engine_from_its_old_package_still_works() -> None:
    import raydp.engine

    with pytest.warns(DeprecationWarning, match="raydp.models.echo:EchoEngine"):
        assert raydp.engine.EchoEngine is EchoEngine
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        raydp.engine.Nope  # noqa: B018


def test_an_unknown_class_in_an_old_package_is_not_rewritten() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConfigError, match="cannot import it"):
            load_engine_class("raydp.engine:NoSuchEngine")
