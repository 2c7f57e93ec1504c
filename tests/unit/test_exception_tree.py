"""Every exception a user can meet derives from raydp.RaydpError: a walk of the whole package."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import raydp
from raydp.errors import RaydpError

pytestmark = pytest.mark.timeout(120)

# Outside the tree on purpose, each with the reason.
OUTSIDE = {
    # A stop signal must unwind through code that catches Exception, as Ctrl-C does (raydp/errors.py).
    "raydp.cli.signals.Stop": KeyboardInterrupt,
}


def _modules() -> list[str]:
    """Every module of the package but the entry points (``python -m`` runs them on import)."""
    return [info.name for info in pkgutil.walk_packages(raydp.__path__, "raydp.") if not info.name.endswith("__main__")]


def _exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for module_name in _modules():
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = obj
    return found


def test_every_public_exception_class_is_a_raydp_error() -> None:
    classes = _exception_classes()
    assert len(classes) > 20, "the walk found raydp's exception classes"
    outside = {
        path: [base.__name__ for base in cls.__mro__[1:3]]
        for path, cls in classes.items()
        if not issubclass(cls, RaydpError) and not cls.__name__.startswith("_") and path not in OUTSIDE
    }
    assert outside == {}, f"exception classes a user can meet outside raydp.RaydpError: {outside}"
    for path, base in OUTSIDE.items():
        assert issubclass(classes[path], base), f"{path} is outside the tree as a {base.__name__}"


def test_a_private_exception_class_never_escapes_its_module() -> None:
    """A private one may stay outside the tree only if no other module names it."""
    private = [path for path, cls in _exception_classes().items() if cls.__name__.startswith("_")]
    for path in private:
        module_name, _, name = path.rpartition(".")
        for other in _modules():
            if other != module_name:
                source = inspect.getsource(importlib.import_module(other))
                assert name not in source, f"{path} is named in {other}: it escapes its module"
