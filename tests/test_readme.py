"""README.md must match what results/ generates, and CI must run exactly the README's commands."""

import re
from pathlib import Path

import bench

ROOT = Path(__file__).resolve().parent.parent


def test_generated_sections_are_up_to_date():
    text = (ROOT / "README.md").read_text()
    sections = bench.readme_sections()
    assert sections, "results/ holds no full benchmark run"
    for (begin, end), body in sections.items():
        assert begin in text and end in text, begin
    assert bench.render_readme(text) == text, "README.md is stale: run `python bench.py --readme`"


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Install and test\n\n```\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    assert block == ['python -m pip install ".[test,test-frameworks]"', "python -m pytest"]
    ci = (ROOT / ".ci" / "run").read_text()
    for command in block:
        assert command in ci, command


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
