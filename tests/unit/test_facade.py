"""`import raydp` stays light: Ray, torch and ZeroMQ load on first use only."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.timeout(60)
def test_importing_raydp_loads_no_heavy_module() -> None:
    code = "import sys, raydp; print(sorted(m for m in ('ray', 'torch', 'zmq') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=50)
    assert out.stdout.strip() == "[]"


@pytest.mark.timeout(60)
def test_the_facade_names_resolve() -> None:
    import raydp

    for name in raydp.__all__:
        assert getattr(raydp, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        raydp.nope  # noqa: B018
