"""The house rules of the source tree, checked so that they stay true: no Python module of the package over 500
lines, no class over 300, no CUDA file over 600; no environment variable chooses anything; no import cycle among the
package's modules (imports inside functions included) and internals only in subpackages; one route table (the engine
modules are imported by cupyffn/api/routes.py alone, and every entry point reaches them through the front door); no
source, test, tool, example, config or top-level document names a repository path that does not exist, a removed
module or the former tools/ folder."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = sorted((ROOT / "cupyffn").rglob("*.py"))
CUDA = sorted((ROOT / "kernels_cu").rglob("*.cu")) + sorted((ROOT / "kernels_cu").rglob("*.cuh"))


def _lines(path):
    return path.read_text().count("\n")


def _rel(path):
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", PACKAGE, ids=_rel)
def test_python_module_and_class_sizes(path):
    assert _lines(path) <= 500, f"{_rel(path)} has {_lines(path)} lines (at most 500)"
    big = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(path.read_text()))
           if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > 300]
    assert not big, f"{_rel(path)}: classes over 300 lines: {big}"


@pytest.mark.parametrize("path", CUDA, ids=_rel)
def test_cuda_file_sizes(path):
    assert _lines(path) <= 600, f"{_rel(path)} has {_lines(path)} lines (at most 600)"


def test_the_environment_chooses_nothing():
    """The environment is read for where things are (CUDA_PATH, CUDA_HOME, CUDA_VISIBLE_DEVICES), never to choose an
    algorithm: choices are typed options (EngineOptions) and data (cupyffn/api/routes.py)."""
    reads = {}
    for path in PACKAGE:
        for name in re.findall(r"os\.environ(?:\.get)?\(\s*[\"']?(\w+)|os\.getenv\(\s*[\"']?(\w+)|"
                               r"os\.environ\[\s*[\"'](\w+)", path.read_text()):
            reads.setdefault(next(n for n in name if n), set()).add(_rel(path))
    assert set(reads) <= {"CUDA_PATH", "CUDA_HOME", "CUDA_VISIBLE_DEVICES"}, reads


def _module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path):
    """Every cupyffn module `path` imports, at the top or inside a function (resolved to module names)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    modules = {_module_name(p) for p in PACKAGE}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith("cupyffn") and target != name:
                found.add(target)
    return found


def _graph():
    """{module: modules it imports}, the package's own modules only; a package's __init__ is its own module."""
    return {_module_name(p): _imports(p) for p in PACKAGE}


def test_no_import_cycles():
    graph = _graph()
    packages = {m for m in graph if (ROOT / m.replace(".", "/") / "__init__.py").exists()}

    def edges(module):  # importing a submodule runs its package's __init__ first: not a cycle by itself
        return {t for t in graph[module] if not (t in packages and module.startswith(t + "."))}

    done, stack = set(), []

    def visit(module):
        if module in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(module):] + [module]))
        if module in done:
            return
        stack.append(module)
        for target in sorted(edges(module)):
            visit(target)
        stack.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_internals_live_in_subpackages():
    """The package's top level holds its public modules only; the rest is in subpackages by role."""
    top = sorted(p.name for p in (ROOT / "cupyffn").glob("*.py"))
    assert top == ["__init__.py", "jax.py", "torch.py", "workloads.py"], top


ENGINES = ("cupyffn.f32.engine", "cupyffn.f32.forward", "cupyffn.lt.engine", "cupyffn.cpu.numpy_route",
           "cupyffn.cpu.torch_route")
#: every engine class, each built (called) in cupyffn/api/routes.py alone
ENGINE_CLASSES = ("GpuEngine", "GpuForward", "LtForward", "LtBackward", "NumpyEngine", "TorchCpu", "NoTokens")


def test_one_route_table():
    """The engines are built in one place, without exception: only cupyffn/api/routes.py imports the engines' modules
    (the float32 backward and forward, the cuBLASLt engine, the NumPy and torch CPU engines) and calls an engine class (the functions'
    and the layers' engines, and GeluFFNBackward's own); nothing outside the api/ subpackage (frameworks, the public
    modules) imports the door's executor or route table."""
    graph = _graph()
    importers = {engine: sorted(m for m, targets in graph.items() if engine in targets) for engine in ENGINES}
    assert all(found == ["cupyffn.api.routes"] for found in importers.values()), importers
    built = {}
    for path in PACKAGE:
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Call):
                name = n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", None)
                if name in ENGINE_CLASSES:
                    built.setdefault(name, set()).add(_rel(path))
    assert all(where == {"cupyffn/api/routes.py"} for where in built.values()), built
    assert set(built) == set(ENGINE_CLASSES), built
    for m in graph:
        if m.startswith(("cupyffn.frameworks", "cupyffn.torch", "cupyffn.jax")):
            assert not graph[m] & {"cupyffn.api.execute", "cupyffn.api.routes", *ENGINES}, (m, graph[m])


def test_the_numpy_routes_import_nothing_gpu():
    """What a CPU call imports (the front door, the NumPy backend) never imports CuPy at module level, nor a GPU
    engine: cupyffn/api, core and cpu modules import cupy only inside functions that run for GPU arrays
    (tests/test_cpu_without_cupy.py runs the calls with CuPy blocked)."""
    for path in PACKAGE:
        if not _module_name(path).startswith(("cupyffn.api", "cupyffn.core", "cupyffn.cpu")):
            continue
        top = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top for a in n.names} | {n.module or "" for n in top if isinstance(n, ast.ImportFrom)}
        assert not any(n == "cupy" or n.startswith(("cupy.", "cupy_backends", "cupyx")) for n in names), _rel(path)


#: a path in the repository named in prose: it must exist (the moved modules' old names, a test file renamed ...)
_PATH = re.compile(r"(?<![\w/.-])((?:cupyffn|kernels_cu|dev|benchmarks|tests|docs|examples|leaderboard)/[\w/.-]*\w\.(?:py|cu|cuh|md))\b")
#: where the wheel installs the CUDA sources (cupyffn/cuda/kernels.py looks there first): not a repository path
_INSTALLED = re.compile(r"^cupyffn/kernels_cu/")
#: modules all live in subpackages; the float32 engine's package is cupyffn/f32/ (it was cupyffn/engine/)
REMOVED = re.compile(r"\bcupyffn\._[a-z]\w*\b|\btools/\w+\.py\b|\bcupyffn[./]engine\b")
ENGINE_VARIABLE = re.compile(r"\bCUPYFFN_ENGINE\b")  # removed; tests/ may set it to show that it chooses nothing
#: the modules that moved into subpackages or went away (`git log --diff-filter=DR --name-status`)
OLD_MODULES = ("_arrays _backward _backward_cpu _backward_gpu _backward_plan _call_graph _checks _cublas _cublaslt "
               "_device _forward _gemm _gpu_engine _graph_replay _kernels _ksplit _libcuda _lt_api _lt_cpu _lt_ffn "
               "_numpy_backend _options _plan_cache _precision _sm90_gemm _torch_lt _torch_parallel _validate "
               "_views").split()
OLD_PATHS = ("api/forward.py", "api/lt_api.py", "api/backward_cpu.py", "api/backward_gpu.py", "cpu/lt.py",
             "engine/call_graph.py")
_OLD = "|".join(OLD_MODULES)
_OLD_USE = re.compile(rf"(?<![\w.])({_OLD})(\.py\b|\.(?=\w))")  # `_cublas.py`, `_numpy_backend.backward_2d`
_OLD_ALIAS = re.compile(rf"\b(\w+) as ({_OLD})\b")
_OLD_BOUND = re.compile(rf"^({_OLD})\s*[:=]", re.M)  # a module's own variable (core/views.py's `_views` cache)
_OLD_PATH = re.compile(r"\b(?:%s)\b" % "|".join(
    [re.escape(p) for p in OLD_PATHS] + [re.escape("cupyffn." + p[:-3].replace("/", ".")) for p in OLD_PATHS]))


def old_module_names(text):
    """The removed modules that `text` names: as a file, as a module it uses, or as the alias of a current module.
    A private alias of a module's own name (`kernels as _kernels`) or a variable of the file is not one of them."""
    aliases = _OLD_ALIAS.findall(text)
    own = {a for m, a in aliases if m == a[1:]} | set(_OLD_BOUND.findall(text))
    return ([f"{m} as {a}" for m, a in aliases if m != a[1:]] + _OLD_PATH.findall(text)
            + [s + d for s, d in _OLD_USE.findall(text) if d == ".py" or s not in own])


def _named_paths_and_modules():
    """Every source, test, tool, example, config and top-level document (docs/decisions/ are a record of what was,
    and may name what is gone)."""
    files = PACKAGE + CUDA + sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "dev").glob("*.py"))
    files += [ROOT / "bench.py"] + sorted((ROOT / "examples").glob("*.py")) + sorted((ROOT / "tests").glob("*.py"))
    files += sorted((ROOT / "leaderboard").rglob("*.py"))
    files += [ROOT / n for n in ("setup.cfg", "pyproject.toml", "README.md", "dev/README.md")]
    return files + sorted((ROOT / "docs").glob("*.md"))


def test_no_source_names_a_removed_module():
    stale = {}
    for p in _named_paths_and_modules():
        text = p.read_text()
        gone = [m for m in _PATH.findall(text) if not _INSTALLED.match(m) and not (ROOT / m).exists()]
        if p != Path(__file__):  # this file lists them
            gone += REMOVED.findall(text) + old_module_names(text)
        gone += [] if p.parent.name == "tests" else ENGINE_VARIABLE.findall(text)
        if gone:
            stale[_rel(p)] = gone
    assert not stale


def test_the_old_module_check_finds_old_names():
    assert old_module_names("cuBLASLt (one wheel: _cublas.py, _cublaslt.py)") == ["_cublas.py", "_cublaslt.py"]
    assert old_module_names('"""_numpy_backend.backward_2d on 2-D inputs"""') == ["_numpy_backend."]
    assert old_module_names("from cupyffn.core import plans as _plan_cache\n_plan_cache.pin(p)") == [
        "plans as _plan_cache", "_plan_cache."]
    assert old_module_names("see engine/call_graph.py and cupyffn.api.lt_api") == [
        "engine/call_graph.py", "cupyffn.api.lt_api"]
    # what stays: a module's private alias of its own name, a variable of the file, another object's attribute
    assert old_module_names("from ..cuda import kernels as _kernels\n_kernels.BLOCK") == []
    assert old_module_names("_views = {}\n\ndef f(key):\n    return _views.get(key)") == []
    assert old_module_names("self._device.id, cupyffn/cuda/call_graph.py, cupyffn.api.forward_plan") == []
    assert REMOVED.findall("from cupyffn.engine.plan import Plan; cupyffn/engine/; cupyffn.f32.engine") == [
        "cupyffn.engine", "cupyffn/engine"]


#: underscore names that are public API of their objects: the NamedTuple methods, and torch's C module (a
#: third-party private the torch layer reads for the raw current stream and the dispatch-mode stack: documented where
#: used)
PUBLIC_UNDERSCORES = {"_replace", "_fields", "_asdict", "_make", "_C"}


def private_reads(source):
    """`name._attr` in `source` where `name` is not self or cls: a read (or write) of another object's private name."""
    found = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__") \
                and n.attr not in PUBLIC_UNDERSCORES:
            owner = n.value.id if isinstance(n.value, ast.Name) else None
            if owner not in ("self", "cls"):
                found.append(f"{owner or ast.unparse(n.value)}.{n.attr} (line {n.lineno})")
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "setattr",
                                                                                          "hasattr") \
                and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str) \
                and n.args[1].value.startswith("_") and not n.args[1].value.startswith("__") \
                and ast.unparse(n.args[0]) not in ("self", "cls", "torch._C"):
            found.append(f"{n.func.id}({ast.unparse(n.args[0])}, {n.args[1].value!r}) (line {n.lineno})")
    return found


def test_no_module_reads_another_objects_private_names():
    """Engines expose what others need (issue 49): no module of the package reaches into another object's private
    attributes (its own, through self or cls, are its business)."""
    reads = {_rel(p): r for p in PACKAGE if (r := private_reads(p.read_text()))}
    assert not reads


def test_the_private_read_check_finds_them():
    assert private_reads("e._main.bind(s)\nself._x = 1\nc._replace(a=1)\ntorch._C.f()") == ["e._main (line 1)"]
    assert private_reads("getattr(e, 'x')\nfoo().bar._baz") == ["foo().bar._baz (line 2)"]
    assert private_reads("getattr(e, '_sidecar', None)\ngetattr(self, '_y')") == ["getattr(e, '_sidecar') (line 1)"]
