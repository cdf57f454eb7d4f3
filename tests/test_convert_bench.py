"""dev/convert_bench.py without a GPU: arguments, the summary and the lines."""

import pytest
from tool_loader import load_tool  # tests/ is on sys.path


@pytest.fixture(scope="module")
def bench():
    return load_tool("convert_bench")


def test_help_and_arguments(bench, monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(["--help"])
    assert info.value.code == 0 and "--against" in capsys.readouterr().out
    monkeypatch.setenv("OUT", str(tmp_path))
    args = bench.parse_args([])
    assert (args.reps, args.warmup, args.budget_s, args.against) == (20, 3, 120.0, None)
    assert (args.tokens, args.unroll, args.waves) == ((256, 512, 1024, 2048, 4096, 8192), (1, 2, 4, 8), (1, 2))
    assert args.out == str(tmp_path / "convert-bench.json")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "convert.cu").write_text("// an older checkout's source\n")
    args = bench.parse_args(["--against", str(tmp_path / "old"), "--unroll", "2", "--tokens", "256, 8192",
                             "--waves", "1", "--reps", "5", "--out", "x.json"])
    assert (args.against, args.unroll, args.tokens, args.waves, args.reps, args.out) == \
        (str(tmp_path / "old"), (2,), (256, 8192), (1,), 5, "x.json")


@pytest.mark.parametrize("bad", [["--reps", "0"], ["--warmup", "-1"], ["--budget-s", "0"], ["--unroll", "0"],
                                 ["--unroll", "two"], ["--tokens", ""], ["--waves", "x"], ["--against", "/nonexistent"]])
def test_bad_arguments_are_refused(bench, bad, capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(bad)
    assert info.value.code == 2
    assert bad[0] in capsys.readouterr().err


def rec(t, stage, build, waves, us, identical=True):
    return dict(T=t, stage=stage, build=build, waves=waves, us=us, identical=identical)


def test_summary_sums_over_the_items_every_candidate_measured(bench):
    records = [rec(256, "convert A", "baseline", 2, 40.0), rec(256, "convert A", "unroll 2", 2, 38.0),
               rec(256, "convert A", "unroll 4", 2, 10.0, identical=False),
               rec(8192, "convert B", "baseline", 2, 40.0), rec(8192, "convert B", "unroll 2", 2, 42.0),
               rec(8192, "convert B", "unroll 4", 2, 10.0),
               rec(8192, "convert B", "unroll 8", 1, 1.0)]  # measured on one item only: no total
    out = bench.summarize(records)
    assert list(out) == ["unroll 4 waves 2", "baseline waves 2", "unroll 2 waves 2"]  # fastest first
    assert out["baseline waves 2"] == dict(total_us=80.0, speedup=1.0, identical=True)
    assert out["unroll 2 waves 2"]["speedup"] == round(80 / 80, 3) and out["unroll 2 waves 2"]["identical"]
    assert out["unroll 4 waves 2"]["identical"] is False  # fast, but once not the baseline's bits
    assert bench.summarize([]) == {}


def test_format_line(bench):
    r = dict(T=256, stage="convert A", build="unroll 2", waves=2, grid=1583, blocks_per_sm=6, registers=40,
             us=40.29, gbps=3162.4, speedup=1.042, identical=True, mismatch=None)
    line = bench.format_line(r)
    for part in ("T=256", "convert A", "unroll 2", "waves 2", "grid  1583", "(6/SM, 40 regs)", "40.29 us",
                 "3162 GB/s", "x1.042", "identical yes"):
        assert part in line, (part, line)
    r.update(identical=False, mismatch="weight1: 3 codes differ")
    assert line != bench.format_line(r) and bench.format_line(r).endswith("identical no: weight1: 3 codes differ")
