"""dev/sm90_gemm_bench.py without a GPU: arguments, the budget, the incremental JSON, the tables."""

import json

import pytest
from tool_loader import load_tool  # tests/ is on sys.path


@pytest.fixture(scope="module")
def bench():
    return load_tool("sm90_gemm_bench")


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_arguments(bench, monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    args = bench.parse_args([])
    assert (args.budget_s, args.reps, args.warmup) == (55.0, 10, 2)
    assert args.out == str(tmp_path / "sm90_gemm_bench.json")
    args = bench.parse_args(["--budget-s", "12.5", "--reps", "3", "--warmup", "0", "--out", "x.json"])
    assert (args.budget_s, args.reps, args.warmup, args.out) == (12.5, 3, 0, "x.json")
    for bad in (["--budget-s", "0"], ["--reps", "0"], ["--warmup", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def record(t, impl, ms, **extra):
    return dict(section="fused", gemm="gemm1", T=t, M=t, N=6144, K=1536, impl=impl, ms=ms, tflops=1.0, **extra)


def test_budget_stops_between_items_and_saves_each(bench, tmp_path):
    clock = FakeClock()
    path = str(tmp_path / "out" / "b.json")
    lines = []
    runner = bench.Runner(10.0, path, clock=clock, emit=lambda text, flush=False: lines.append(text))
    seen = []

    def item(i):
        def fn():
            if i > 0:  # the file already holds every earlier record
                assert len(json.load(open(path))["records"]) == i
            seen.append(i)
            clock.now += 4.0
            return record(1024, f"impl{i}", 0.5 + i)
        return fn

    result = runner.run([(f"item{i}", item(i)) for i in range(6)])
    assert seen == [0, 1, 2]  # started at 0, 4 and 8 s; at 12 s the 10 s budget is spent
    assert result["skipped"] == ["item3", "item4", "item5"]
    assert not result["complete"] and "budget" in result["stopped"]
    saved = json.load(open(path))
    assert [r["name"] for r in saved["records"]] == ["item0", "item1", "item2"]
    assert saved["elapsed_s"] == 12.0
    assert any("budget spent" in line for line in lines)


def test_errors_are_recorded_and_a_dead_context_stops(bench, tmp_path):
    clock = FakeClock()
    path = str(tmp_path / "b.json")
    runner = bench.Runner(100.0, path, clock=clock, emit=lambda *a, **k: None,
                          fatal=lambda exc: isinstance(exc, RuntimeError))

    def fail(exc):
        def fn():
            raise exc
        return fn

    items = [("ok", lambda: record(256, "a", 1.0)), ("soft", fail(ValueError("bad shape"))),
             ("ok2", lambda: [record(256, "b", 2.0), record(256, "c", 3.0)]), ("trap", fail(RuntimeError("illegal"))),
             ("never", lambda: record(256, "d", 4.0))]
    result = runner.run(items)
    assert [r["name"] for r in result["records"]] == ["ok", "ok2", "ok2"]
    assert result["errors"] == ["soft: ValueError: bad shape", "trap: RuntimeError: illegal"]
    assert result["skipped"] == ["never"] and "unusable" in result["stopped"]
    assert json.load(open(path))["errors"] == result["errors"]


def test_all_items_run_when_the_budget_lasts(bench, tmp_path):
    runner = bench.Runner(100.0, str(tmp_path / "b.json"), clock=FakeClock(), emit=lambda *a, **k: None)
    result = runner.run([("a", lambda: record(256, "a", 1.0))])
    assert result["complete"] and result["skipped"] == [] and result["stopped"] is None


def test_work_items_order(bench):
    """Importance order: the fused T >= 2048 checks first (every schedule of the staged epilogue, the
    direct one beside it, cuBLAS and cuBLAS + the engine's pass; cooperative before ping-pong), then the epilogue
    warps and the small T, the host cost last."""
    class Recorder:
        def __getattr__(self, name):
            return lambda *args: (name, args)

    items = bench.work_items(Recorder())
    names = [n for n, _ in items]
    assert len(names) == len(set(names))
    assert names[:5] == ["fused T=2048 cublas gemm1", "fused T=2048 ours f16 staged bn256",
                         "fused T=2048 cublas+engine pass f16", "fused T=2048 ours f16 staged bn128",
                         "fused T=2048 ours f16 direct bn256"]
    assert items[1][1]() == ("fused_ours", (2048, "f16", 256, False, "staged"))
    section1 = names[:19]
    for t in bench.FUSED_TS:
        for what in ("cublas gemm1", "cublas+engine pass f16", "ours f16 staged bn256", "ours f16 staged bn128",
                     "ours f16 staged bn128pp", "ours f16 direct bn256"):
            assert f"fused T={t} {what}" in section1
    first_fused_pp = min(i for i, n in enumerate(names) if "pp" in n)
    assert all(not n.startswith("fused") or "pp" in n for n in names[first_fused_pp:19])  # pp after cooperative
    assert names[19:22] == [f"fused T={t} ours f16 warps bn128" for t in bench.FUSED_TS]
    assert items[19][1]() == ("fused_ours", (2048, "f16", 128, False, "warps"))
    assert names[-1] == "host cost" and "fused T=8192 ours bf16x3 staged bn256" in names


def test_tables_from_records(bench, capsys):
    recs = [dict(section="fused", gemm="gemm1", T=2048, impl="cublas_gemm1_f16_f32out", ms=0.2, tflops=1.0),
            dict(section="fused", gemm="gemm1", T=2048, impl="cublas_f16+engine_pass", ms=0.3, tflops=1.0),
            dict(section="fused", gemm="gemm1", T=2048, impl="ours_dgelu_f16_staged_bn256", ms=0.21, tflops=1.0,
                 cfg="bn256", fmt="f16", epi="staged", err=1e-4, finite=True, ok=True),
            dict(section="fused", gemm="gemm1", T=2048, impl="ours_dgelu_f16_staged_bn128pp", ms=0.19, tflops=1.0,
                 cfg="bn128pp", fmt="f16", epi="staged", err=2e-4, finite=True, ok=True),
            dict(section="fused", gemm="gemm1", T=2048, impl="ours_dgelu_f16_direct_bn256", ms=0.6, tflops=1.0,
                 cfg="bn256", fmt="f16", epi="direct", err=2e-4, finite=True, ok=True),
            record(8192, "cublas_gemm1_f16_f32out", 0.25),
            record(8192, "ours_dgelu_f16_warps_bn128", 0.30, cfg="bn128", fmt="f16", epi="warps", err=3e-4,
                   finite=True, ok=True),
            record(8192, "ours_dgelu_bf16x3_staged_bn256", 0.35, cfg="bn256", fmt="bf16x3", epi="staged", err=1.0,
                   finite=False, ok=False),
            dict(section="host", T=4096, impl="host", encode_tensor_map_us=5.0, gemm_tn_dgelu_call_cached_maps_us=20.0)]
    result = dict(records=recs, errors=[], skipped=["x"], complete=False, stopped="budget", elapsed_s=3.0,
                  compile_s=1.0, device="H200")
    bench.print_tables(result, "p.json")
    out = capsys.readouterr().out
    assert "INCOMPLETE" in out and "skipped (1): x" in out
    fused_row = next(line for line in out.splitlines() if line.startswith(" 2048 |"))
    assert " 0.95 " in fused_row  # best fused (0.19, ping-pong) / cuBLAS 0.2
    row_8192 = next(line for line in out.splitlines() if line.startswith(" 8192 |"))
    assert " 1.20 " in row_8192 and "BAD" in row_8192  # the warps 0.30 / 0.25; the bf16x3 check failed
    warps_row = [line for line in out.splitlines() if line.startswith(" 8192 |")][1]
    assert "0.300 (1.20x)" in warps_row
    assert "(0.90)" in out  # ping-pong 0.19 vs its bn256 twin 0.21 (the staged one, not the direct 0.6)
    schedule_row = [line for line in out.splitlines() if line.startswith(" 2048 |")][1]
    assert "0.190 (0.95x)" in schedule_row and "0.600 (3.00x)" in schedule_row and "0.300 (1.50x)" in schedule_row
    assert "MET (0.95x, staged bn128pp)" in schedule_row
    assert "encode_tensor_map 5.0 us" in out
