"""Settings for the whole suite."""

from __future__ import annotations

import os
import tempfile

from hypothesis import settings

# OpenMP threads (torch's, in every engine, worker and vLLM process the suite starts) sleep as soon as
# a parallel region ends instead of spinning for it first: on 2 cores shared by several engines, the
# spinning only takes CPU from the others. Measured on one module of each kind, both passing alike:
# test_vllm_tp.py 171 -> 143 CPU-seconds (120 -> 96 s), test_tp_lm.py 139 -> 114 (88 -> 72 s).
# Every process the suite starts inherits it; a process reads it when OpenMP loads, after this file.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# vLLM's CPU engines compile a few kernels with torch's inductor (g++, ~10 CPU-seconds), cached under the
# temp directory, which each xdist worker has its own of: one cache for the whole machine compiles them once.
_CACHE = os.environ.get("RAYDP_TEST_CACHE") or os.path.join(tempfile.gettempdir(), "raydp-tests")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE, "torchinductor"))

# Properties check behaviour, not speed: hypothesis' default 200 ms deadline per example
# would fail a correct test on a slow or busy machine, so no test of the suite has one.
settings.register_profile("raydp", deadline=None)
settings.load_profile("raydp")
