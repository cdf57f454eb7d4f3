"""bench.py --suite train-bf16's summary and table (benchmarks/training.py), from a real run of the example's tiny
config on the CPU (no torch.compile there: its column reads n/a)."""

import pytest

pytest.importorskip("torch", reason="torch not installed: framework tests are opt-in, pip install '.[test-frameworks]'")
pytest.importorskip("ml_dtypes")

from benchmarks import training  # noqa: E402


def test_summary_markdown_and_files_from_a_cpu_run(tmp_path):
    example = training._example()
    r = example.main("sd35", steps=30, device="cpu", dim=64, layers=2, heads=2, vocab=64, seq=32, batch=4,
                     compile=False, tolerance=0.05)
    entry = training.summarize(r)
    assert set(entry["runs"]) == {"torch eager", "cupyffn"}
    assert entry["runs"]["cupyffn"]["losses"] == r["cupyffn"]["losses"] and len(r["cupyffn"]["losses"]) == 30
    assert entry["step_speedup"]["torch eager"] == pytest.approx(
        r["torch eager"]["median_step_ms"] / r["cupyffn"]["median_step_ms"])
    result = {"env": {"device": "CPU", "cupy": "-", "torch": "-"}, "date": "2026-12-03T00:00:00+00:00",
              "git_commit": "abcdef0", "command": "python bench.py --suite train-bf16", "steps": 30,
              "tolerance": 0.05, "models": {"sd35": entry}}
    text = training.markdown(result)
    row = [line for line in text.splitlines() if line.startswith("| sd35 |")][0].split(" | ")
    assert row[2] == "n/a" and float(row[1]) == pytest.approx(entry["runs"]["torch eager"]["median_step_ms"], abs=0.01)
    assert row[6] == f"{r['final_loss_ratio']:.4f}" and row[7] == "n/a"
    assert entry["final_loss_vs_eager"]["cupyffn"] == pytest.approx(r["final_loss_ratio"])
    training.write(result, tmp_path, lambda device: device.lower())
    assert (tmp_path / "train-bf16-cpu.md").read_text() == text
    assert '"final_loss_vs_eager"' in (tmp_path / "train-bf16-cpu.json").read_text()
