"""The hang turns' injections (``benchmarks.vllm_dp``): on PYTHONPATH, with ``RAYDP_BENCH_HANG=N:MARKER``
(a worker hangs in its Nth ``execute_model``) or ``RAYDP_BENCH_WEDGE=MARKER`` (a worker's model load
wedges: the startup that vllm#53157 reports; ``benchmarks.vllm_dp.wedge``).

The first vLLM worker (of any system: vLLM's own, in the worker process
its DP engine cores' ``MultiprocExecutor`` starts, and raydp's, inside each
rank's ``UniProcExecutor``) whose ``execute_model`` reaches its Nth call
blocks there for good, as a worker stuck in a kernel or a collective does;
creating ``MARKER`` (exclusively) says when, and makes it the only one. The
patch is applied when vLLM's module is imported, so every other process this
path reaches pays nothing.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import time

_SPEC = os.environ.get("RAYDP_BENCH_HANG", "")
_WEDGE = os.environ.get("RAYDP_BENCH_WEDGE", "")
_TARGET = "vllm.v1.worker.gpu_worker"  # its Worker is CPUWorker's base too


def _block_forever() -> None:
    while True:
        time.sleep(3600)


def _claim(marker: str) -> bool:
    """Whether this process is the first to get here (it creates ``marker``, exclusively)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _patch_load(module) -> None:  # type: ignore[no-untyped-def]
    cls = module.Worker
    original = cls.load_model

    def load_model(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if _claim(_WEDGE):
            _block_forever()
        return original(self, *args, **kwargs)

    cls.load_model = load_model


def _patch(module) -> None:  # type: ignore[no-untyped-def]
    if _WEDGE:
        _patch_load(module)
    if not _SPEC:
        return
    cls = module.Worker
    original = cls.execute_model
    at, marker = _SPEC.split(":", 1)
    calls = [0]

    def execute_model(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == int(at) and _claim(marker):
            _block_forever()
        return original(self, *args, **kwargs)

    cls.execute_model = execute_model


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):  # type: ignore[no-untyped-def]
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if _SPEC or _WEDGE:
    sys.meta_path.insert(0, _PatchOnImport())
