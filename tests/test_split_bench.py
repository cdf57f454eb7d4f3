"""dev/split_bench.py without a GPU: arguments, candidates, bytes, the recommendation and the lines."""


import pytest
from tool_loader import load_tool  # tests/ is on sys.path


@pytest.fixture(scope="module")
def bench():
    return load_tool("split_bench")


def test_help_and_arguments(bench, monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(["--help"])
    assert info.value.code == 0 and "--out" in capsys.readouterr().out
    monkeypatch.setenv("OUT", str(tmp_path))
    args = bench.parse_args([])
    assert (args.reps, args.warmup, args.budget_s, args.tokens, args.waves) == (20, 3, 55.0, (2048, 4096, 8192), (1, 2))
    assert args.out == str(tmp_path / "split-bench.json")
    args = bench.parse_args(["--out", "x.json", "--reps", "25", "--tokens", "4096, 8192", "--waves", "2",
                             "--warmup", "0", "--budget-s", "5"])
    assert (args.out, args.reps, args.tokens, args.waves, args.warmup, args.budget_s) == \
        ("x.json", 25, (4096, 8192), (2,), 0, 5.0)


@pytest.mark.parametrize("bad", [["--reps", "0"], ["--warmup", "-1"], ["--budget-s", "0"], ["--tokens", "a,b"],
                                 ["--tokens", ""], ["--tokens", "0"], ["--waves", "0"], ["--waves", "x"]])
def test_bad_arguments_are_refused(bench, bad, capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(bad)
    assert info.value.code == 2
    assert bad[0] in capsys.readouterr().err


def test_candidates_put_the_baseline_first(bench):
    assert bench.candidates({0: "a", 1: "b"}, (1, 2)) == [(0, 2), (0, 1), (1, 1), (1, 2)]
    assert bench.candidates({0: "a", 2: "c"}, (1,)) == [(0, 2), (0, 1), (2, 1)]  # baseline timed even so


def test_stage_bytes(bench):
    # convert A at T=8192: grad_output x3 + f16 + e4t (10 bytes written), weight2 x3 (6); one source each
    assert bench.stage_bytes([(8192, 1536, 10), (1536, 6144, 6)], 1) == 8192 * 1536 * 14 + 1536 * 6144 * 10
    assert bench.stage_bytes([(8192, 6144, 6)], 3) == 8192 * 6144 * 18


def rec(t, stage, kind, variant, waves, us, identical=True):
    return dict(T=t, stage=stage, kind=kind, variant=variant, waves=waves, us=us, identical=identical)


def test_recommend_takes_the_least_total_among_identical_candidates(bench):
    records = [rec(4096, "convert A", 0, 0, 2, 100.0), rec(4096, "convert A", 0, 1, 2, 80.0),
               rec(4096, "convert A", 0, 2, 2, 10.0, identical=False),
               rec(8192, "convert A", 0, 0, 2, 200.0), rec(8192, "convert A", 0, 1, 2, 190.0),
               rec(8192, "convert A", 0, 2, 2, 20.0),
               rec(8192, "convert B", 0, 0, 2, 300.0), rec(8192, "convert B", 0, 1, 2, 320.0),
               rec(8192, "convert B", 0, 2, 2, 30.0),
               rec(8192, "dgelu", 1, 0, 2, 250.0), rec(8192, "dgelu", 1, 1, 1, 200.0)]
    out = bench.recommend(records)
    assert out[0]["variant"] == 1 and out[0]["waves"] == 2  # variant 2 is faster but once not identical
    assert out[0]["total_us"] == 590.0 and out[0]["baseline_us"] == 600.0
    assert out[0]["speedup"] == round(600 / 590, 3)
    assert (out[1]["variant"], out[1]["waves"], out[1]["speedup"]) == (1, 1, 1.25)
    # a candidate missing from one item does not win on a partial sum
    out = bench.recommend(records + [rec(2048, "convert A", 0, 0, 2, 50.0)])
    assert out[0]["variant"] == 0 and out[0]["speedup"] == 1.0
    assert bench.recommend([]) == {}


def test_format_line(bench):
    r = dict(T=8192, stage="convert B", kind=0, variant=1, waves=2, grid=792, us=150.25, gbps=3712.4, speedup=1.377,
             identical=True, mismatch=None)
    line = bench.format_line(r)
    for part in ("T=8192", "convert B", "KIND 0", "variant 1", "waves 2", "grid   792", "150.2 us", "3712 GB/s",
                 "x1.377", "identical yes"):
        assert part in line, (part, line)
    r.update(identical=False, mismatch="gelu_out.f16: 3 bytes differ")
    assert bench.format_line(r).endswith("identical no (gelu_out.f16: 3 bytes differ)")
