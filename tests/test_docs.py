"""docs/: every relative link (and #anchor) and every backticked repository path in docs/*.md and
docs/decisions/*.md points at something that exists, and the code blocks of the API and framework pages run as
written: the ```python blocks not marked ``# GPU`` on their first line on the CPU (torch / JAX blocks where those
are installed), the ``# GPU`` ones on a GPU (a ``# GPU (torchrun)`` block needs a launcher: not run here)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md")) + sorted((DOCS / "decisions").glob("*.md"))
RUNNABLE = [DOCS / "api.md", DOCS / "frameworks.md"]  # their CPU blocks run here (and GPU blocks on a GPU)
GPU_RUNNABLE = RUNNABLE + [DOCS / "cuda-graphs.md"]

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# a repository path as a whole code span: a top-level folder of the repository, then a path without spaces
REPO_PATH = re.compile(r"(?:cupyffn|kernels_cu|docs|results|tests|dev|examples|benchmarks|leaderboard|\.ci)/[\w.\-/]*")


def _rel(path):
    return path.relative_to(ROOT).as_posix()


def _prose(text):
    """The page without its fenced code blocks (links, headings and paths are looked for in the prose only)."""
    return FENCE.sub("", text)


def slug(heading):
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped (but - and _), spaces to -."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page):
    seen, out = {}, set()
    for line in _prose(page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_there_are_pages():
    names = {p.name for p in PAGES}
    assert {"api.md", "cuda-graphs.md", "frameworks.md", "precisions.md", "architecture.md",
            "performance.md", "README.md", "001-k-chunks.md"} <= names, names


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_exist(page):
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no {dest})")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target} (no heading #{fragment} in {_rel(dest)})")
    assert not broken, f"{_rel(page)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_backticked_repository_paths_exist(page):
    missing = sorted({span for span in CODE_SPAN.findall(_prose(page.read_text()))
                      if REPO_PATH.fullmatch(span) and not (ROOT / span).exists()})
    assert not missing, f"{_rel(page)} names paths that do not exist: {missing}"


# ---------------------------------------------------------------------------------------------- code blocks
def _blocks(pages):
    """(id, source) of every ```python block of `pages`; id is page:line."""
    out = []
    for page in pages:
        text = page.read_text()
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{page.name}:{line}", m.group(1)))
    return out


def _gpu(source):
    return source.startswith("# GPU")


CPU_BLOCKS = [b for b in _blocks(RUNNABLE) if not _gpu(b[1])]
GPU_BLOCKS = [b for b in _blocks(GPU_RUNNABLE) if _gpu(b[1])]


def _needs(source):
    for module in ("torch", "jax"):
        if re.search(rf"^\s*(?:import|from)\b.*\b{module}\b", source, re.M):
            pytest.importorskip(module, reason=f"{module} not installed: framework tests are opt-in, "
                                               f"pip install '.[test-frameworks]'")
    if re.search(r"^\s*import .*\btorch\.distributed\b", source, re.M):
        dist = pytest.importorskip("torch.distributed")
        if not dist.is_available():
            pytest.skip("this torch build has no torch.distributed")


def _run(block_id, source):
    _needs(source)
    exec(compile(source, block_id, "exec"), {"__name__": "docs_block"})


def test_there_are_blocks_to_run():
    assert len(CPU_BLOCKS) >= 8 and len(GPU_BLOCKS) >= 4, (len(CPU_BLOCKS), len(GPU_BLOCKS))
    for page in RUNNABLE:
        assert any(b[0].startswith(page.name + ":") for b in CPU_BLOCKS), page.name


@pytest.mark.parametrize("block_id, source", CPU_BLOCKS, ids=[b[0] for b in CPU_BLOCKS])
def test_cpu_blocks_run(block_id, source):
    _run(block_id, source)


@pytest.mark.gpu
@pytest.mark.parametrize("block_id, source", GPU_BLOCKS, ids=[b[0] for b in GPU_BLOCKS])
def test_gpu_blocks_run(block_id, source):
    if "torchrun" in source.splitlines()[0]:
        pytest.skip("a torchrun block: examples/train_tp_torch.py and tests/test_torch_parallel.py run it")
    _run(block_id, source)


# Signatures docs/frameworks.md writes out in full, as the functions have them (the argument names, order, defaults
# and keyword-only marker; quotes and line breaks aside).
SIGNATURES = [("torch", "cupyffn.torch.gelu_ffn"), ("torch", "cupyffn.torch.gelu_ffn_backward"),
              ("jax", "cupyffn.jax.gelu_ffn")]


@pytest.mark.parametrize("framework,name", SIGNATURES, ids=[n for _, n in SIGNATURES])
def test_framework_signatures_match_the_functions(framework, name):
    import importlib
    import inspect

    pytest.importorskip(framework, reason=f"{framework} not installed: framework tests are opt-in")
    module, _, attr = name.rpartition(".")
    fn = getattr(importlib.import_module(module), attr)
    text = (DOCS / "frameworks.md").read_text()
    m = re.search(re.escape(name) + r"(\([^`]*\))`", text)
    assert m, f"docs/frameworks.md does not write out {name}(...)"
    documented = re.sub(r"\s+", " ", m.group(1)).replace('"', "'")
    assert documented == str(inspect.signature(fn)), name
