"""Engine and worker classes load by ``module:Class`` path; a bad path is a ConfigError naming it."""

from __future__ import annotations

import pytest

from raydp.engine.core import load_engine_class
from raydp.errors import ConfigError
from raydp.models.echo import EchoEngine
from raydp.models.echo_workers import EchoWorker, WorkerEchoEngine
from raydp.models.tiny_lm import TinyLMEngine
from raydp.workers.runtime import load_worker_class

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("path", "cls"),
    [
        ("raydp.models.echo:EchoEngine", EchoEngine),
        ("raydp.models.tiny_lm:TinyLMEngine", TinyLMEngine),
        ("raydp.models.echo_workers:WorkerEchoEngine", WorkerEchoEngine),
    ],
)
def test_an_engine_path_loads_its_class(path: str, cls: type) -> None:
    assert load_engine_class(path) is cls


def test_a_worker_class_path_loads_its_class() -> None:
    assert load_worker_class("raydp.models.echo_workers:EchoWorker") is EchoWorker


@pytest.mark.parametrize("path", ["raydp.engine:EchoEngine", "raydp.models.echo:Nope", "nosuch.module:Engine"])
def test_a_path_that_does_not_import_is_a_config_error_naming_it(path: str) -> None:
    with pytest.raises(ConfigError, match="cannot import it") as info:
        load_engine_class(path)
    assert repr(path) in str(info.value)


def test_a_class_that_is_not_an_engine_is_refused_naming_what_it_lacks() -> None:
    with pytest.raises(ConfigError, match="missing"):
        load_engine_class("raydp.models.echo_workers:EchoWorker")
