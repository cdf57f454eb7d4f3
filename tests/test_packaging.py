"""The wheel ships the CUDA sources, the workload table and the license, and the installed layout finds
them; its dependencies are exactly what cupyffn loads; the public names are all in ``__all__``.

The wheel (and the sdist) are built from a copy of the source tree without build outputs (build/,
*.egg-info, ...): setuptools puts whatever is left in an old build/lib into a new wheel, so building in
place could hide a file that packaging no longer picks up; it also keeps the checkout free of artifacts.
"""

import ast
import json
import re
import tarfile
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


def _source_copy(tmp_path_factory):
    setuptools = pytest.importorskip("setuptools")  # the [test] extra installs both
    pytest.importorskip("wheel")
    if int(setuptools.__version__.split(".")[0]) < 64:
        pytest.skip(f"setuptools {setuptools.__version__} < 64 (pyproject.toml's build requirement)")
    work = tmp_path_factory.mktemp("packaging")
    source = work / "src"
    shutil.copytree(REPO, source, ignore=_ignore)
    return work, source


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    work, source = _source_copy(tmp_path_factory)
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
    kernels = REPO / "kernels_cu"  # every CUDA source and header, the sm90/ headers included
    cu_files = sorted(p.relative_to(kernels).as_posix() for p in kernels.rglob("*") if p.suffix in (".cu", ".cuh"))
    assert "gemm_sm90.cu" in cu_files and "sm90/mainloop.cuh" in cu_files, cu_files
    expected |= {f"cupyffn/kernels_cu/{n}" for n in cu_files}
    package = REPO / "cupyffn"  # every module, the subpackages (engine/, gemm/, gemm/sm90/) included
    py_files = sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py"))
    assert "__init__.py" in py_files and "f32/engine.py" in py_files and "gemm/sm90/launch.py" in py_files
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
    assert re.search(r"^Author: The cupyffn developers$", text, re.M), text[:2000]
    assert re.search(r"^License(-Expression)?: MIT$", text, re.M), text[:2000]
    assert re.search(r"^License-File: LICENSE$", text, re.M), text[:2000]
    assert re.search(r"^Description-Content-Type: text/markdown", text, re.M), text[:2000]


def test_installed_layout_finds_its_files(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("PYTHONHOME", None)
    script = (
        "import json, cupyffn, cupyffn.cuda.kernels as k, cupyffn.workloads as w\n"
        "print(json.dumps({'kernel_dir': str(k.kernel_dir()), 'package': cupyffn.__file__,\n"
        "                  'sources': {m: len(k.source(k.MODULES[m][0])) for m in k.MODULES},\n"
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


# ---------------------------------------------------------------------------------------------
# dependencies: the base install is NumPy alone; each CUDA extra is CuPy plus exactly the CUDA
# libraries cupyffn loads (runtime with its headers, NVRTC, cuBLAS/cuBLASLt), each listed once
# ---------------------------------------------------------------------------------------------
CUDA_EXTRAS = {
    "cuda12": {"cupy-cuda12x", "cuda-pathfinder", "nvidia-cuda-runtime-cu12", "nvidia-cuda-nvrtc-cu12",
               "nvidia-cublas-cu12"},
    "cuda13": {"cupy-cuda13x", "cuda-pathfinder", "nvidia-cuda-runtime", "nvidia-cuda-nvrtc", "nvidia-cublas"},
}
NOT_LOADED = re.compile(r"cufft|curand|cusolver|cusparse|nvjitlink|cudnn|nccl|cuda-toolkit")  # toolkit: a bundle


def _requirements(wheel):
    """{extra or None: [(name, specifier, extras, marker text without the extra)]} from the wheel's METADATA."""
    z = zipfile.ZipFile(wheel)
    text = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    by_extra = {}
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        m = re.match(r"Requires-Dist: ([A-Za-z0-9._-]+)\s*(\[[^]]*\])?\s*([^;]*)(?:;\s*(.*))?$", line)
        assert m, line
        name, extras, spec, marker = m.group(1).lower().replace("_", "-"), m.group(2), m.group(3).strip(), m.group(4)
        extra = None
        if marker:
            e = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", marker)
            extra = e.group(1) if e else None
            marker = re.sub(r"""\s*(and\s*)?\(?\s*extra\s*==\s*['"][^'"]+['"]\s*\)?""", "", marker).strip() or None
        by_extra.setdefault(extra, []).append((name, spec, extras, marker))
    extras = {line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Provides-Extra:")}
    return by_extra, extras


def test_dependencies_are_what_cupyffn_loads(wheel):
    by_extra, extras = _requirements(wheel)
    assert extras == {"cuda12", "cuda13", "test", "test-frameworks", "plot", "bf16"}, extras
    assert [r[0] for r in by_extra[None]] == ["numpy"], by_extra[None]  # the CPU-only install: cupyffn + NumPy
    for extra, names in CUDA_EXTRAS.items():
        listed = [r[0] for r in by_extra[extra]]
        assert sorted(listed) == sorted(names), (extra, listed)  # each library once, nothing else
        for name, spec, sub_extras, marker in by_extra[extra]:
            assert not sub_extras, (extra, name, sub_extras)  # no cupy-cuda12x[ctk]: it brings cuFFT & co.
            if name.startswith("nvidia-"):
                major = extra[-2:]
                assert f"<{int(major) + 1}" in spec.replace(" ", "") and f">={major}" in spec, (extra, name, spec)
    for extra, reqs in by_extra.items():
        for name, *_ in reqs:
            assert not NOT_LOADED.search(name), (extra, name)


def test_framework_tests_are_opt_in(wheel):
    by_extra, _ = _requirements(wheel)
    assert not {"torch", "jax", "jaxlib"} & {r[0] for r in by_extra["test"]}, by_extra["test"]
    assert {"pytest", "setuptools", "wheel", "ml-dtypes"} <= {r[0] for r in by_extra["test"]}, by_extra["test"]
    assert [r[0] for r in by_extra["bf16"]] == ["ml-dtypes"], by_extra["bf16"]  # CuPy's and NumPy's bfloat16
    frameworks = {r[0]: r for r in by_extra["test-frameworks"]}
    assert set(frameworks) == {"torch", "jax", "transformers", "diffusers"}, frameworks  # the models' round trips
    # a range, so that an installed torch is kept (an exact pin pulled PyPI's multi-GB CUDA build over it); CI
    # holds its machine's on-disk CPU build with a pip constraint inside that range
    _, spec, _, marker = frameworks["torch"]
    assert spec.replace(" ", "") == ">=2.4" and marker is None, (spec, marker)
    from packaging.requirements import Requirement

    pins = [line for line in (REPO / ".ci" / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert pins == ["torch==2.13.0"], pins
    assert Requirement("torch" + spec).specifier.contains("2.13.0+cpu")  # the pin lies inside the range
    assert 'export PIP_CONSTRAINT="$PWD/.ci/constraints.txt"' in (REPO / ".ci" / "run").read_text()


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    work, source = _source_copy(tmp_path_factory)
    dist = work / "sdist"
    dist.mkdir()
    cmd = [sys.executable, "-c", "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))",
           str(dist)]
    proc = subprocess.run(cmd, cwd=source, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    archives = list(dist.glob("cupyffn-*.tar.gz"))
    assert len(archives) == 1, (archives, proc.stdout)
    return archives[0]


def test_license_ships_in_the_wheel_and_the_sdist(wheel, sdist):
    license_text = (REPO / "LICENSE").read_text()
    assert license_text.startswith("MIT License") and "2026 The cupyffn developers" in license_text
    z = zipfile.ZipFile(wheel)
    in_wheel = [n for n in z.namelist() if re.search(r"\.dist-info/(licenses/)?LICENSE$", n)]
    assert len(in_wheel) == 1 and z.read(in_wheel[0]).decode() == license_text, z.namelist()
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        top = [n for n in names if re.fullmatch(r"cupyffn-[^/]+/LICENSE", n)]
        assert top and tar.extractfile(top[0]).read().decode() == license_text, names
        assert any(n.endswith("/README.md") for n in names), names  # the long description's source


# ---------------------------------------------------------------------------------------------
# public names: every public class and function of a public module is in its __all__ (read from the
# source, so that this runs without torch or JAX), and cupyffn's docstring names each one
# ---------------------------------------------------------------------------------------------
def _module_ast(name):
    return ast.parse((REPO / "cupyffn" / name).read_text())


def _all_of(tree):
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("no __all__")


def _public_defs(tree):
    return {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and not n.name.startswith("_")}


def _public_imports(tree):
    names = set()
    for n in tree.body:
        if isinstance(n, ast.ImportFrom) and n.level == 1:  # from .x import y (as z)
            names |= {a.asname or a.name for a in n.names if not (a.asname or a.name).startswith("_")}
    return names


@pytest.mark.parametrize("module", ["torch.py", "jax.py", "frameworks/torch_parallel.py", "__init__.py"])
def test_all_lists_every_public_class_and_function(module):
    tree = _module_ast(module)
    listed = _all_of(tree)
    assert len(listed) == len(set(listed)), listed
    public = _public_defs(tree) | _public_imports(tree)
    if module == "__init__.py":
        public.add("__version__")
    missing = public - set(listed)
    assert not missing, f"cupyffn/{module}: public but not in __all__: {sorted(missing)}"
    if module != "__init__.py":
        assert set(listed) <= public | _public_defs(_module_ast("frameworks/torch_parallel.py")), listed


def test_torch_all_has_the_tensor_parallel_layer():
    listed = set(_all_of(_module_ast("torch.py")))
    assert set(_all_of(_module_ast("frameworks/torch_parallel.py"))) <= listed, listed
    assert {"GeluFFN", "GeluFFNFunction", "TensorParallelGeluFFN", "TensorParallelGeluFFNFunction"} <= listed


def test_package_docstring_is_one_screen_and_names_the_api():
    sys.path.insert(0, str(REPO))
    try:
        import cupyffn
    finally:
        sys.path.pop(0)
    doc = cupyffn.__doc__
    assert len(doc.strip().splitlines()) <= 25, doc
    for name in cupyffn.__all__:
        if name != "__version__":
            assert re.search(rf"\b{re.escape(name)}\b", doc), f"cupyffn's docstring does not name {name}"
    for module in ("cupyffn.torch", "cupyffn.jax", "cupyffn.workloads"):
        assert module in doc, module
