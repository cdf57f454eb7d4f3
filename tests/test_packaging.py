"""The wheel ships the CUDA sources and the workload table, and the installed layout finds them.

The wheel is built from a copy of the source tree without build outputs (build/, *.egg-info, ...):
setuptools puts whatever is left in an old build/lib into a new wheel, so building in place
could hide a file that packaging no longer picks up; it also keeps the checkout free of artifacts.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXCLUDED = {".git", "build", "dist", ".venv", ".whl", "__pycache__", ".pytest_cache", ".mypy_cache", ".tox"}


def _ignore(folder, names):
    return [n for n in names if n in EXCLUDED or n.endswith(".egg-info") or n.endswith(".pyc")]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    setuptools = pytest.importorskip("setuptools")  # the [test] extra installs both
    pytest.importorskip("wheel")
    if int(setuptools.__version__.split(".")[0]) < 64:
        pytest.skip(f"setuptools {setuptools.__version__} < 64 (pyproject.toml's build requirement)")
    work = tmp_path_factory.mktemp("packaging")
    source = work / "src"
    shutil.copytree(REPO, source, ignore=_ignore)
    dist = work / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    wheels = list(dist.glob("cupyffn-*.whl"))
    assert len(wheels) == 1, (wheels, proc.stdout)
    return wheels[0]


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {"cupyffn/kernels_cu/common.cuh", "cupyffn/workloads.json"}
    cu_files = sorted(p.name for p in (REPO / "kernels_cu").glob("*.cu"))
    assert cu_files, "no kernels_cu/*.cu in the repository"
    expected |= {f"cupyffn/kernels_cu/{n}" for n in cu_files}
    py_files = sorted(p.name for p in (REPO / "cupyffn").glob("*.py"))
    assert "__init__.py" in py_files and "_kernels.py" in py_files
    expected |= {f"cupyffn/{n}" for n in py_files}
    missing = expected - names
    assert not missing, f"missing from {wheel.name}: {sorted(missing)}"
    # nothing of the tests or build scripts lands in the package
    assert not any(n.startswith(("tests/", "kernels_cu/", ".ci/")) for n in names), sorted(names)


def test_wheel_metadata(wheel):
    sys.path.insert(0, str(REPO))
    try:
        import cupyffn
    finally:
        sys.path.pop(0)
    assert wheel.name.startswith(f"cupyffn-{cupyffn.__version__}-")
    z = zipfile.ZipFile(wheel)
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
    assert f"Version: {cupyffn.__version__}" in text
    requires = [line for line in text.splitlines() if line.startswith("Requires-Dist:")]
    assert any(line.startswith("Requires-Dist: cupy-cuda12x") for line in requires), requires
    assert any(line.startswith("Requires-Dist: numpy") for line in requires), requires


def test_installed_layout_finds_its_files(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("PYTHONHOME", None)
    script = (
        "import json, cupyffn, cupyffn._kernels as k, cupyffn.workloads as w\n"
        "print(json.dumps({'kernel_dir': str(k.kernel_dir()), 'package': cupyffn.__file__,\n"
        "                  'sources': {m: len(k.module_source(m)) for m in k.MODULES},\n"
        "                  'workloads': len(w.WORKLOADS)}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    site_resolved = site.resolve()
    kernel_dir = Path(info["kernel_dir"]).resolve()
    assert kernel_dir == site_resolved / "cupyffn" / "kernels_cu", info
    assert Path(info["package"]).resolve().is_relative_to(site_resolved), info
    assert all(n > 1000 for n in info["sources"].values()), info
    assert info["workloads"] == 16
