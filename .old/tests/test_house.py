"""The house rules of the source tree (issue 29), checked so that they stay true: no Python module of the package
over 500 lines, no class over 300, no CUDA file over 600; one environment variable chooses anything in the engine
(CUPYFFN_ENGINE, parsed into EngineOptions); no source cites a removed module or the former tools/ folder."""

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


def test_only_the_debug_variable_reads_the_environment_for_choices():
    """The environment is read for where things are (CUDA_PATH, CUDA_HOME, CUDA_VISIBLE_DEVICES) and for the one
    documented debug variable; never to choose a kernel."""
    reads = {}
    for path in PACKAGE:
        for name in re.findall(r"os\.environ(?:\.get)?\(\s*[\"']?(\w+)|os\.getenv\(\s*[\"']?(\w+)", path.read_text()):
            reads.setdefault(next(n for n in name if n), set()).add(_rel(path))
    assert set(reads) <= {"CUDA_PATH", "CUDA_HOME", "CUDA_VISIBLE_DEVICES", "ENV"}, reads
    assert reads.get("ENV", {"cupyffn/engine/options.py"}) == {"cupyffn/engine/options.py"}
    from cupyffn.engine import options

    assert options.ENV == "CUPYFFN_ENGINE"


REMOVED = re.compile(r"\b_(?:sm90_gemm|gpu_engine|call_graph|cublas|cublaslt|ksplit|options|gemm)\.py\b|"
                     r"\bcupyffn\._(?:sm90_gemm|gpu_engine|call_graph|cublas|cublaslt|ksplit|options|gemm)\b|"
                     r"\btools/\w+\.py\b")


def test_no_source_names_a_removed_module():
    sources = PACKAGE + CUDA + sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "dev").glob("*.py"))
    sources += [ROOT / "bench.py"] + sorted((ROOT / "examples").glob("*.py"))
    stale = {_rel(p): REMOVED.findall(p.read_text()) for p in sources}
    assert not {k: v for k, v in stale.items() if v}
