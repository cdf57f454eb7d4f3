"""The dev/ tools without a GPU (sm90_precompile, sm90_trace, sm90_sass, sm90_ptx_diff, ...): they
load without cupy, answer --help, sm90_ptx_diff tells a changed kernel from an unchanged one and the tf32 probe's
kernel compiles without spills (NVRTC on the CPU);
the one timing helper (benchmarks/timing.py, re-exported by dev/_event_timing.py) with stand-ins for cupy."""

import types

import numpy
import pytest
from tool_loader import load_tool  # tests/ is on sys.path

from benchmarks import timing


@pytest.mark.parametrize("name,option", [("sm90_precompile", "--match"), ("sm90_trace", "--rasters"),
                                         ("sm90_sass", "--dump"), ("sm90_ptx_diff", "--against"),
                                         ("bias_cost", "--tokens"), ("io_graph_ab", "--rounds"),
                                         ("tf32_rs_probe", "--tokens"), ("ptx_hashes", "--against"),
                                         ("rescue_cost", "--rounds"), ("gpu_suite", "--workers"),
                                         ("step_breakdown", "--modes"), ("lt_gemm_choices", "--shapes"),
                                         ("op_host_cost", "--calls"), ("wave_table", "--tiles"),
                                         ("pair_plan_ab", "--reps"), ("gemm_forms_bench", "--pair-rasters"),
                                         ("streams_ab", "--precisions"), ("call_timeline", "--tokens"),
                                         ("f16_wgrad_probe", "--tokens"), ("evaluator_run", "--budget"),
                                         ("forward_bias_probe", "--precisions")])
def test_loads_without_cupy_and_answers_help(name, option, capsys):
    tool = load_tool(name)
    with pytest.raises(SystemExit) as info:
        tool.main(["--help"])
    assert info.value.code == 0 and option in capsys.readouterr().out


def fake_cupy(log, elapsed):
    """(cupy, stream) stand-ins that log what is enqueued: events record and wait, the stream is entered, left
    and waited for; get_elapsed_time returns the next of `elapsed`."""
    elapsed = iter(elapsed)

    class Event:
        def record(self, stream=None):
            log.append(("record", stream))

        def synchronize(self):
            log.append(("wait",))

    class Stream:
        def __enter__(self):
            log.append(("enter",))

        def __exit__(self, *exc):
            log.append(("exit",))

        def synchronize(self):
            log.append(("stream wait",))

    stream = Stream()
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event, get_elapsed_time=lambda a, b: next(elapsed),
                                                            get_current_stream=lambda: stream,
                                                            Device=lambda: types.SimpleNamespace(
                                                                synchronize=lambda: log.append(("device wait",)))))
    return cupy, stream


def test_flushed_median_ms_orders_flush_events_and_call():
    """Warm-ups unflushed and untimed, then per sample flush, start event, the call, stop event, a wait on it; the
    median of the elapsed times. dev/_event_timing.py re-exports it for the dev/ tools."""
    log = []
    cupy, stream = fake_cupy(log, [3.0, 1.0, 2.0])
    ms = timing.flushed_median_ms(cupy, stream, lambda: log.append(("run",)), lambda: log.append(("flush",)), reps=3,
                                  warmup=2)
    assert ms == 2.0
    sample = [("flush",), ("record", stream), ("run",), ("record", stream), ("wait",)]
    assert log == [("enter",), ("run",), ("run",)] + 3 * sample + [("exit",)]
    load_tool("sm90_trace")  # puts dev/ on sys.path
    from _event_timing import flushed_median_ms

    assert flushed_median_ms is timing.flushed_median_ms


def test_flushed_median_ms_without_a_flush():
    log = []
    cupy, stream = fake_cupy(log, [5.0, 4.0])
    assert timing.flushed_median_ms(cupy, stream, lambda: log.append(("run",)), None, reps=2, warmup=0) == 4.5
    sample = [("record", stream), ("run",), ("record", stream), ("wait",)]
    assert log == [("enter",)] + 2 * sample + [("exit",)]


def test_flushed_median_ms_batched_waits_once():
    """Warm-ups, then every sample (flush, start, call, stop) enqueued, one wait on the stream; the median."""
    log = []
    cupy, stream = fake_cupy(log, [3.0, 9.0, 1.0])
    ms = timing.flushed_median_ms_batched(cupy, stream, lambda: log.append(("run",)), lambda: log.append(("flush",)),
                                          reps=3, warmup=1)
    assert ms == 3.0
    sample = [("flush",), ("record", stream), ("run",), ("record", stream)]
    assert log == [("run",)] + 3 * sample + [("stream wait",)]


def test_accuracy_times_calls_after_one_drained_warm_up(monkeypatch):
    """benchmarks/accuracy.py: one warm-up, the device drained, then `calls` samples on the current stream, no
    flush, each waited for."""
    from benchmarks import accuracy

    log = []
    cupy, stream = fake_cupy(log, [2.0, 1.0, 3.0])
    monkeypatch.setitem(__import__("sys").modules, "cupy", cupy)

    def plan(*args, out):
        log.append(("run", args, out))

    assert accuracy._time_calls(plan, (1, 2), "out", calls=3) == 2.0
    call = ("run", (1, 2), "out")
    sample = [("record", stream), call, ("record", stream), ("wait",)]
    assert log == [call, ("device wait",), ("enter",)] + 3 * sample + [("exit",)]


def test_sm90_trace_summary_of_a_known_timeline():
    """dev/sm90_trace.py's summary on made-up stamps: one CTA whose two consumers alternate (mainloops 10 us,
    epilogues 4 us, consumer 1 waits for consumer 0's first mainloop), a CTA that recorded nothing."""
    import numpy

    tool = load_tool("sm90_trace")
    stamps = numpy.zeros((2, 2, tool.TRACE_TILES, 4), dtype=numpy.uint64)
    us = 1000
    # consumer 0: tiles 0 and 2; consumer 1: tile 1, its turn after consumer 0's mainloop (t = 10 us)
    base = 10 ** 12  # a global timer reading (0 means "not recorded")
    stamps[0, 0, 0] = [base + v * us for v in (0, 0, 10, 14)]
    stamps[0, 1, 1] = [base + v * us for v in (0, 10, 20, 24)]
    stamps[0, 0, 2] = [base + v * us for v in (14, 20, 30, 34)]
    got = tool.summarize(stamps, 2)
    assert got["tiles"] == 3
    assert got["mainloop_us"] == 10 and got["epilogue_us"] == 4
    assert got["turn_wait_us"] == 6  # waits 0, 10, 6: the median
    assert got["span_us"] == 34
    assert abs(got["tensor_busy"] - 30 / 34) < 1e-12  # mainloops cover 0-30 of 0-34; the empty CTA is left out


def test_sm90_sass_counts_opcodes_of_a_listing():
    """dev/sm90_sass.py's counter on a made-up nvdisasm listing: predicated or not, with modifiers, each opcode
    counted once per instruction; labels and directives are not instructions."""
    tool = load_tool("sm90_sass")
    listing = """
        .text.kernel:
.L_x_42:
        /*0000*/                   LDS.64 R10, [R5] ;
        /*0010*/               @P0 LDS.64 R8, [R5+0x800] ;
        /*0020*/                   BSSY B1, `(.L_x_43) ;
        /*0030*/              @!P3 BRA `(.L_x_43) ;
        /*0040*/               @P5 STG.E.U16 desc[UR16][R8.64], R2 ;
        /*0050*/                   FMUL.FTZ R6, R7, 0.5 ;
        /*0060*/                   HGMMA.64x256x16.F32 R24, gdesc[UR4], R24 ;
        /*0070*/                   BSYNC B1 ;
"""
    got = tool.count_sass(listing)
    assert got == {"instructions": 8, "BSSY": 1, "BRA": 1, "LDS": 2, "STG": 1, "LDGSTS": 0, "HGMMA": 1}


def test_sm90_ptx_diff_tells_changed_code_from_unchanged(tmp_path, capsys):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cupyffn.cuda import kernels as _kernels

    tool = load_tool("sm90_ptx_diff")
    variant = ["--match", r"gemm_sm90_kernel<0, 128, 2, 0, 0>"]
    (tmp_path / "sm90").mkdir()
    for path in [_kernels.kernel_dir() / n for n in ("gemm_sm90.cu", "common.cuh", "activation.cuh")] + sorted(
            (_kernels.kernel_dir() / "sm90").glob("*.cuh")):
        (tmp_path / path.relative_to(_kernels.kernel_dir())).write_text(path.read_text())
    assert tool.main(["--against", str(tmp_path)] + variant) == 0
    assert "0 differ" in capsys.readouterr().out
    source = (tmp_path / "sm90" / "ptx.cuh").read_text()
    assert "kHangNs = 2000000000ull" in source
    (tmp_path / "sm90" / "ptx.cuh").write_text(source.replace("kHangNs = 2000000000ull", "kHangNs = 1000000000ull"))
    assert tool.main(["--against", str(tmp_path)] + variant) == 1
    out = capsys.readouterr().out
    assert "1 of 1 variants changed" in out and "1000000001" in out  # the compare against kHangNs


def test_tf32_probe_kernel_compiles_without_spills():
    """dev/tf32_rs_gemm.cu, every variant dev/tf32_rs_probe.py launches, for sm_90a: no error, no spill, and no
    serialized wgmma (ptxas says so when the fragments or accumulators would be touched mid-pipeline)."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cupyffn.cuda import kernels as _kernels

    probe = load_tool("tf32_rs_probe")
    names = probe.kernel_names()
    prog = nvrtc.createProgram(probe.source(), "tf32_rs_gemm.cu", (), ())
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        nvrtc.compileProgram(prog, ["-arch=sm_90a", "--std=c++17", "-ftz=true", "-Xptxas=-v",
                                    "-I" + _kernels.cuda_include_dir()])
        log = nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
    assert log.count("0 bytes spill stores, 0 bytes spill loads") == len(names), log
    assert "serialized" not in log, log


def test_ptx_hashes_are_stable_and_tell_a_change(tmp_path, capsys, monkeypatch):
    """dev/ptx_hashes.py on one small module: two compilations hash alike (NVRTC's per-compile symbol names
    normalized), and a changed source is reported."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    tool = load_tool("ptx_hashes")
    out = tmp_path / "before.json"
    assert tool.main(["--match", "^call_table$", "--out", str(out), "--jobs", "1"]) == 0
    assert tool.main(["--match", "^call_table$", "--against", str(out), "--jobs", "1"]) == 0
    assert "0 differ" in capsys.readouterr().out
    real = tool.jobs

    def changed(match=""):
        return [(n, s.replace("*table = values;", "if (values.gemm[0].a) *table = values;"), e, o)
                for n, s, e, o in real(match)]

    monkeypatch.setattr(tool, "jobs", changed)
    assert tool.main(["--match", "^call_table$", "--against", str(out), "--jobs", "1"]) == 1
    assert "differs: call_table" in capsys.readouterr().out


def test_gpu_suite_reads_pytest_summaries():
    """dev/gpu_suite.py's summary file quotes pytest's last line (bare with -q, or between rules) and lists the
    tests the short summary (-rfE) names, once each; a run that printed no summary says so."""
    tool = load_tool("gpu_suite")
    quiet = ("FAILED t/test_a.py::test_x[1-2] - assert 1 == 0\nERROR t/test_b.py::test_y\n"
             "FAILED t/test_a.py::test_x[1-2] - again\n2 failed, 998 passed, 16 skipped, 1 error in 172.51s (0:02:52)\n")
    assert tool.summary_line(quiet) == "2 failed, 998 passed, 16 skipped, 1 error"
    assert tool.failed_tests(quiet) == ["t/test_a.py::test_x[1-2]", "t/test_b.py::test_y"]
    assert tool.summary_line("====== 5 passed in 0.31s ======") == "5 passed"
    assert tool.summary_line("Segmentation fault") == "(no pytest summary line: pytest did not finish)"


def test_step_breakdown_groups_kernels_by_name():
    """dev/step_breakdown.py's groups: cupyffn's own kernels by their names in kernels_cu/, cuBLAS's reductions apart
    from its GEMMs, torch's and inductor's copies and casts apart from other elementwise work."""
    tool = load_tool("step_breakdown")
    own = tool.own_kernels()
    assert {"to_half_kernel", "gelu_half_kernel", "gemm_sm90_kernel", "dgelu_kernel"} <= own
    cases = {
        "void to_half_kernel<0>(float const*, long long, __nv_bfloat16*, long long, long long, long long, int)":
            tool.OWN,
        "nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_TNT": "GEMMs (cuBLAS, cuBLASLt)",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas_aux_bf16_dgelu": "GEMMs (cuBLAS, cuBLASLt)",
        "void globalKernelBgradAB<float>()": "cuBLAS reductions (bias gradient, split-K)",
        "void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>": "copies and casts",
        "triton_poi_fused__to_copy_3": "copies and casts",
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer and gradient clipping",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel": "attention",
        "triton_red_fused_native_layer_norm_backward_2": tool.OTHER,
    }
    for name, group in cases.items():
        assert tool.group_of(name, own) == group, name
    assert tool._busy_ms([(0, 2_000_000), (1_000_000, 3_000_000), (5_000_000, 6_000_000)]) == 4.0


def test_step_breakdown_finds_the_idle_stretches():
    """dev/step_breakdown.py --gaps: the stretches no kernel covers (overlapping kernels on two streams count once),
    longest first, with the kernel that ended last before each and the one that starts it."""
    tool = load_tool("step_breakdown")
    spans = [(10_000, 11_000, "d"), (0, 4_000, "a"), (1_000, 2_000, "b (side stream)"), (6_000, 7_000, "c")]
    assert tool.largest_gaps(spans, 5) == [(3.0, "c", "d"), (2.0, "a", "c")]
    assert tool.largest_gaps(spans, 1) == [(3.0, "c", "d")]
    assert tool.largest_gaps([(0, 5, "x"), (1, 3, "y")], 3) == []


def test_wave_table_counts_tiles_waves_and_fill():
    tool = load_tool("wave_table")
    # GEMM2's 1536 x 6144 output on 132 SMs: 576 tiles of 128 x 128 in 5 waves (the last 36% full), 384 of 128 x 192
    # in 3 (97%)
    assert tool.fill(1536, 6144, (128, 128), 132) == (576, 576 / 132, 576 / 660)
    assert tool.fill(1536, 6144, (128, 192), 132) == (384, 384 / 132, 384 / 396)
    assert tool.fill(100, 100, (128, 128), 132) == (1, 1 / 132, 1 / 132)  # a partial tile is a tile
    rows = tool.table([256, 8192], 1536, 6144, [(128, 128)], 132)
    assert rows["gemm3", 256][(128, 128)] == (24, 24 / 132, 24 / 132)  # M = T = 256, N = D
    assert rows["gemm4", 8192] == rows["gemm4", 256]  # the weight gradients' output does not depend on T


def test_host_median_us_drains_the_device_before_each_call_and_drops_the_warmups(monkeypatch):
    log = []
    times = iter([0.0, 0.5, 1.0, 1.000002, 2.0, 2.000004, 3.0, 3.000009])  # perf_counter: warm-up, then 3 calls
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(times))
    us = timing.host_median_us(lambda: log.append("run"), 3, lambda: log.append("sync"), warmup=1)
    assert log == ["sync", "run"] * 4
    assert abs(us - 4.0) < 1e-6  # the median of 2, 4 and 9 us; the warm-up's 500,000 us dropped


def test_pair_plan_ab_swaps_the_tables_and_puts_them_back():
    """dev/pair_plan_ab.py's "before" build: inside tables(), the fp16+fp8 form table starts the pair at T = 2048 and
    only GEMM1 has sm90 windows; after it (and after an exception inside it) the product's tables are back."""
    from cupyffn.core import precision as P
    from cupyffn.f32 import plan as engine_plan

    tool = load_tool("pair_plan_ab")
    precision, tokens = P.PRECISIONS["fp16+fp8"], engine_plan.SM90_PAIR_TOKENS
    with tool.tables(tool.BEFORE):
        inside = P.PRECISIONS["fp16+fp8"]
        assert inside.form("gemm2", 2047).name == "bf16x3" and inside.form("gemm2", 2048).name == "f16+e4m3"
        assert engine_plan.SM90_PAIR_TOKENS["gemm1"] == ((0, 2 ** 31 - 1),)
        assert engine_plan.SM90_PAIR_TOKENS["gemm2"] == ()
    assert P.PRECISIONS["fp16+fp8"] is precision and engine_plan.SM90_PAIR_TOKENS is tokens
    with pytest.raises(RuntimeError):
        with tool.tables(tool.BEFORE):
            raise RuntimeError
    assert P.PRECISIONS["fp16+fp8"] is precision and engine_plan.SM90_PAIR_TOKENS is tokens
    assert precision.form("gemm2", 1024).name == "f16+e4m3"


def test_alternated_medians_warms_each_call_then_alternates(monkeypatch):
    """dev/_alternate.py: `warmup` untimed calls of each, then round after round every call sampled once in order;
    the medians per name."""
    alternate = load_tool("_alternate")
    log = []

    class Cupy:  # only what alternated_medians touches outside `sample`
        float32 = "float32"

        @staticmethod
        def empty(n, dtype):
            return object()

        @staticmethod
        def RawKernel(src, name):
            return object()

    def sample(cupy, stream, call, flush, spin, queued):
        call()
        return {"a": 1.0, "b": 2.0}[log[-1][0]] + len(log) / 1000, 0.0

    monkeypatch.setattr(alternate, "sample", sample)
    calls = {name: (lambda i, name=name: log.append((name, i))) for name in ("a", "b")}
    got = alternate.alternated_medians(Cupy, None, calls, reps=3, warmup=2)
    assert log == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert got == {"a": 1.007, "b": 2.008}


def test_output_sets_have_the_backwards_output_shapes():
    """dev/_alternate.py output_sets: per set grad_hidden [T, D], grad_weight1 [H, D], grad_weight2 [D, H]."""
    alternate = load_tool("_alternate")

    class Cupy:
        float32 = numpy.float32
        empty = staticmethod(numpy.empty)

    sets = alternate.output_sets(Cupy, 5, count=2)
    assert len(sets) == 2 and sets[0][0] is not sets[1][0]
    assert [a.shape for a in sets[0]] == [(5, 1536), (6144, 1536), (1536, 6144)]
    assert all(a.dtype == numpy.float32 for s in sets for a in s)


def test_call_timeline_busy_time_and_kernel_names():
    """dev/call_timeline.py: the time at least one kernel runs (overlaps counted once, gaps not at all), and kernel
    names without template arguments or parameters."""
    tool = load_tool("call_timeline")
    kernels = [{"start_us": 0.0, "end_us": 10.0}, {"start_us": 5.0, "end_us": 12.0}, {"start_us": 20.0, "end_us": 25.0},
               {"start_us": 21.0, "end_us": 22.0}]
    assert tool.busy_us(kernels) == 17.0
    s = tool.summary([dict(k, us=k["end_us"] - k["start_us"]) for k in kernels])
    assert s == {"span_us": 25.0, "sum_us": 23.0, "busy_us": 17.0, "kernels": 4}
    assert tool._short("void gemm_sm90_kernel<0, 128, 2, 0, 2>(sm90::TmaDesc, sm90::TmaDesc)") == "gemm_sm90_kernel"
    assert tool._short("nvjet_sm90_hss_256x128_64x4_1x2_h_bx_coopA_NNT") == "nvjet_sm90_hss_256x128_64x4_1x2_h_bx_coopA_NNT"
def _trace(batch, seq, status, latency=None, err=0.01, atol=0.05, log=""):
    """One line of the harness's trace JSONL, as its CLI writes it (-o)."""
    ev = {"status": status, "environment": {"hardware": "NVIDIA H100 80GB HBM3", "libs": {"torch": "2.11.0"}},
          "timestamp": "2026-12-07T00:00:00", "log": log,
          "correctness": {"max_absolute_error": err, "max_relative_error": err, "has_nan": False, "has_inf": False}}
    if latency is not None:
        ev["performance"] = {"latency_ms": latency, "reference_latency_ms": 10 * latency, "speedup_factor": 10.0}
    return {"definition": "068_gelu_approximate_feedforward_backward", "solution": "cupyffn-tf32",
            "workload": {"uuid": "u", "axes": {"batch_size": batch, "seq_len": seq}, "inputs": {},
                         "tolerance": {"max_atol": atol, "max_rtol": 1e-5, "required_matched_ratio": 0.99}},
            "evaluation": ev}


def test_evaluator_run_summarizes_the_harness_traces():
    """dev/evaluator_run.py: counts, mean, geomean, the H200 SOL's share of the mean and the worst error over atol
    from the traces; no averages where a workload failed, whose log the summary then shows."""
    from cupyffn import workloads

    tool = load_tool("evaluator_run")
    traces = [_trace(2, 128, "PASSED", 0.1, err=0.02, atol=0.025), _trace(4, 2048, "PASSED", 0.4, err=0.05, atol=0.13)]
    s = tool.summarize(traces, "tf32, consistent inputs")
    assert (s["passed"], s["workloads"]) == (2, 2)
    assert s["mean_ms"] == pytest.approx(0.25) and s["geomean_ms"] == pytest.approx(0.2)
    sol = (workloads.sol_ms(256) + workloads.sol_ms(8192)) / 2
    assert s["pct_of_h200_sol"] == pytest.approx(100 * sol / 0.25)
    assert s["worst_err_over_atol"] == pytest.approx(0.8) and s["reference_mean_ms"] == pytest.approx(2.5)
    failed = tool.summarize(traces[:1] + [_trace(4, 2048, "INCORRECT_NUMERICAL", err=0.5, atol=0.13,
                                                 log="matched 0.97")], "fp16+fp8, random inputs")
    assert (failed["passed"], failed["workloads"]) == (1, 2) and "mean_ms" not in failed
    text = tool.markdown([s, failed, {"run": "tf32, random inputs", "skipped": "skipped: 20 s left of --budget"}],
                         ["card: test"])
    assert "| tf32, consistent inputs | 2/2 | 0.2500 | 0.2000 |" in text
    assert "| B4xS2048 | 8192 | INCORRECT_NUMERICAL |  |  | 3.846 |" in text and "matched 0.97" in text
    assert "| tf32, random inputs | skipped: 20 s left of --budget |" in text
    skipped = {"run": "fp16+fp8, random inputs", "skipped": "skipped"}
    assert tool.exit_status([s, skipped]) == 0
    assert tool.exit_status([s, failed]) == 1 and tool.exit_status([skipped]) == 1 and tool.exit_status([]) == 1
    assert tool.exit_status([s, {"run": "tf32, random inputs", "error": "no traces"}]) == 1


def test_evaluator_run_picks_the_wheels_it_needs(tmp_path):
    tool = load_tool("evaluator_run")
    for name in ("sol_execbench-1.0.2-py3-none-any.whl", "pydantic-2.12.5-py3-none-any.whl",
                 "pydantic_core-2.41.5-cp312-cp312-manylinux_2_17_x86_64.whl", "diffusers-0.42.1-py3-none-any.whl"):
        (tmp_path / name).write_text("")
    got = tool.find_wheels(tmp_path, ("pydantic", "pydantic_core"))
    assert {k: v.name for k, v in got.items()} == {
        "pydantic": "pydantic-2.12.5-py3-none-any.whl",
        "pydantic_core": "pydantic_core-2.41.5-cp312-cp312-manylinux_2_17_x86_64.whl"}
    with pytest.raises(FileNotFoundError, match="lacks wheels for cupti_python, typing_extensions"):
        tool.find_wheels(tmp_path, ("sol_execbench", "cupti_python", "typing_extensions"))


def test_evaluator_run_python_shim_is_this_interpreter_with_its_packages(tmp_path):
    """The harness's `python` is this interpreter with this environment's packages (a symlink to a virtual
    environment's interpreter would start the base interpreter without them)."""
    import subprocess
    import sys

    tool = load_tool("evaluator_run")
    shim = tool.python_shim(tmp_path)
    probe = "import sys, pytest; print(sys.prefix); print(pytest.__file__)"
    got = subprocess.run([str(shim), "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert got == [sys.prefix, pytest.__file__]


def test_forward_bias_probe_sees_a_scaled_output_and_runs_on_the_numpy_route(tmp_path):
    """dev/forward_bias_probe.py: an output shrunk by 1e-5 reads as that scale bias (random rounding of the same
    size does not), and the CPU run writes every precision's figures, ieee's at fp32's level."""
    import json

    tool = load_tool("forward_bias_probe")
    rng = numpy.random.default_rng(0)
    y64, target = rng.standard_normal((64, 32)), rng.standard_normal((64, 32))
    shrunk = tool.statistics(y64 * (1 - 1e-5), y64, target)
    assert shrunk["scale_bias"] == pytest.approx(-1e-5, rel=1e-6)
    noisy = tool.statistics(y64 * (1 + 1e-5 * rng.standard_normal(y64.shape)), y64, target)
    assert noisy["rel_l2"] == pytest.approx(1e-5, rel=0.1) and abs(noisy["scale_bias"]) < 1e-6
    out = tmp_path / "bias.json"
    assert tool.main(["--device", "cpu", "--dim", "64", "--hidden", "256", "--tokens", "96", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == set(tool.PRECISIONS)
    assert rows["ieee"]["rel_l2"] < 5e-6 and abs(rows["ieee"]["scale_bias"]) < 1e-6
    assert 1e-5 < rows["tf32"]["rel_l2"] < 6e-4
