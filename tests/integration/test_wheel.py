"""The built wheel, installed in a fresh venv outside the checkout: one ``raydp`` namespace."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out, source = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("source")
    _copy_checkout(source)  # setuptools writes build/ beside the sources: not into the user's checkout
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        check=True,
        cwd=out,
        timeout=240,
    )
    (found,) = out.glob("*.whl")
    return found


def _copy_checkout(dest: Path) -> None:
    """The checkout's files as git sees them (tracked, and new ones it does not ignore), links kept."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    )
    for name in filter(None, listed.stdout.decode().split("\0")):
        src, dst = ROOT / name, dest / name
        if not src.exists() and not src.is_symlink():  # deleted in the working tree, not yet in git
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst, follow_symlinks=False)


@pytest.mark.timeout(300)
def test_the_wheel_holds_only_raydp_under_its_own_distribution_name(wheel: Path) -> None:
    assert wheel.name.startswith("raydp_engines-")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"raydp"}
    for module in (
        "raydp/placement/planner.py",
        "raydp/actors/manager.py",
        "raydp/wire/protocol.py",
        "raydp/models/tiny_lm.py",
        "raydp/cli/__init__.py",
    ):
        assert module in names
    # Every package of the checkout ships (setuptools' list is explicit: a new one must be added there).
    checkout = ROOT / "raydp"
    packages = {p.parent.relative_to(ROOT) for p in checkout.glob("**/__init__.py")}
    packages |= {Path("raydp") / link.name for link in checkout.iterdir() if link.is_symlink()}
    missing = sorted(str(p) for p in packages if f"{p.as_posix()}/__init__.py" not in names)
    assert not missing, f"packages left out of the wheel: {missing}"


@pytest.mark.timeout(300)
def test_installed_wheel_imports_as_raydp_and_nothing_else(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        timeout=240,
    )
    # Dependencies come from this venv's site-packages, added after the fresh one's
    # own; a .pth there is not a site dir, so this checkout's editable hook stays out.
    site = Path(sysconfig.get_paths()["purelib"])
    fresh_site = next((env_dir / "lib").glob("python*/site-packages"))
    (fresh_site / "zz_deps.pth").write_text(f"{site}\n")
    probe = (
        "import raydp, raydp.placement, raydp.actors, raydp.placement.planner, raydp.wire.protocol\n"
        "print(raydp.__file__)\n"
        "for name in ('placement', 'actors'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ModuleNotFoundError:\n"
        "        print('no', name)\n"
        "    else:\n"
        "        print('found', name)\n"
    )
    result = subprocess.run(
        [str(python), "-I", "-c", probe], check=False, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(str(fresh_site)), lines[0]
    assert lines[1:] == ["no placement", "no actors"]
