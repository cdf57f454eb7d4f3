"""README.md: its generated sections match results/, CI runs exactly its install and test commands, it stays a
front door (at most 200 lines, no relative links that break on PyPI), and every code block runs as written: the
blocks marked ``# GPU`` on a GPU, the others on the CPU (torch / JAX blocks where those are installed)."""

import re
from pathlib import Path

import pytest

import bench

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_generated_sections_are_up_to_date():
    sections = bench.readme_sections()
    assert sections, "results/ holds no full benchmark run"
    for (begin, end), body in sections.items():
        assert begin in README and end in README, begin
    assert bench.render_readme(README) == README, "README.md is stale: run `python bench.py --readme`"


def test_ci_runs_the_readme_commands():
    section = README.split("## Install and test\n", 1)[1].split("\n## ", 1)[0]
    blocks = [b.strip().splitlines() for b in re.findall(r"^```\n(.*?)^```", section, re.S | re.M)]
    assert len(blocks) == 2, blocks
    block, no_gpu = blocks
    assert block == ['python -m pip install ".[cuda12,test]"', "python -m pytest"]
    # without a GPU: a CPU torch before the frameworks' extra (PyPI's Linux torch is a CUDA build of GBs)
    assert no_gpu == ['python -m pip install ".[test]"',
                      "python -m pip install torch --index-url https://download.pytorch.org/whl/cpu",
                      'python -m pip install ".[test-frameworks]"', "python -m pytest"]
    ci = (ROOT / ".ci" / "run").read_text()
    for command in block:
        assert command in ci, command
    # step 5 runs the no-GPU block's commands in order, verbatim
    step5 = ci[ci.index("no_cupy() {"):]
    at = [step5.find(command) for command in no_gpu]
    assert -1 not in at and at == sorted(at), dict(zip(no_gpu, at))


def test_a_front_door():
    assert len(README.splitlines()) <= 200
    # PyPI renders the long description without the repository: no relative links or images
    for target in re.findall(r"\]\(([^)]+)\)", README):
        assert re.match(r"https?://", target), f"relative link {target!r} breaks on PyPI"
    for path in re.findall(r"`((?:docs|results|cupyffn|benchmarks|examples)/[^`* <>]+?\.(?:md|py|json|png))`", README):
        assert (ROOT / path).exists(), path


def test_results_record_their_provenance():
    full, loop = bench.newest_results()
    for key in ("device", "driver", "cuda_runtime", "cupy", "cublas", "nvrtc"):
        assert full["env"].get(key), key
    assert full["date"] and full["git_commit"] and full["command"]
    assert len(full["workloads"]) == 16
    names = set(full["workloads"][0]["results"])
    assert {"cupyffn-bf16x3", "cupyffn-ieee", "cupyffn-tf32", "cupyffn-bf16", "torch-fp32", "torch-tf32",
            "cupy-naive-fp32"} <= names
    assert loop is not None and len(loop["workloads"]) == 16


def _needs(block):
    for module in ("torch", "jax"):
        if re.search(rf"^\s*(import|from) {module}\b|import .*\b{module}\b", block, re.M):
            pytest.importorskip(module, reason=f"{module} not installed: framework tests are opt-in, "
                                               f"pip install '.[test-frameworks]'")


def _run(block):
    _needs(block)
    exec(compile(block, "README.md", "exec"), {"__name__": "readme_block"})


@pytest.mark.parametrize("index", [i for i, b in enumerate(BLOCKS) if not b.startswith("# GPU")])
def test_cpu_blocks_run(index):
    _run(BLOCKS[index])


@pytest.mark.gpu
@pytest.mark.parametrize("index", [i for i, b in enumerate(BLOCKS) if b.startswith("# GPU")])
def test_gpu_blocks_run(index):
    _run(BLOCKS[index])


def test_there_are_blocks_of_both_kinds():
    assert sum(b.startswith("# GPU") for b in BLOCKS) >= 1 and sum(not b.startswith("# GPU") for b in BLOCKS) >= 3


def test_the_skip_reasons_it_names_are_the_ones_given():
    """The README's GPU-skip reasons are those the suite gives: the device check's (tests/conftest.py through
    cupyffn.cuda.device) and pytest.importorskip's for the files that need CuPy itself."""
    from cupyffn.cuda import device

    section = " ".join(README.split("## Install and test\n", 1)[1].split("\n## ", 1)[0].split())
    assert f'"{device.NO_GPU} (...)"' in section
    with pytest.raises(pytest.skip.Exception) as skipped:
        pytest.importorskip("cupy_not_installed_here")
    prefix = str(skipped.value).split("'", 1)[0]  # pytest's wording: "could not import '<name>': ..."
    assert f"\"{prefix}'cupy' (...)\"" in section
    uses = [p for p in (ROOT / "tests").glob("test_*.py") if 'importorskip("cupy")' in p.read_text()]
    assert uses, "no test file imports CuPy through importorskip: the README need not name that reason"
    assert '"torch.cuda is not available"' in section
