"""bench's summary and report functions on a hand-made results dict (CPU, no GPU)."""

import math

import pytest

from benchmarks import protocol as P
from benchmarks import report as R
from cupyffn import workloads as W


def _check(passed, rounds=2, matched=1.0, err=0.5):
    outputs = {o: {"least_matched": matched, "worst_err_over_atol": err, "max_rel_l2": 1e-4, "all_finite": True,
                   "never_all_zero": True} for o in W.OUTPUT_NAMES}
    return {"rounds": rounds, "rounds_passed": rounds if passed else rounds - 1, "passed": passed, "outputs": outputs}


def _row(sol, times, checks):
    return {"label": f"T{sol}", "tokens": 256, "sol_ms": sol, "max_atol": 0.025,
            "results": {n: {"median_ms": t, "max_rel_l2": 1e-4, "check": checks[n], "timing": "cupti"}
                        for n, t in times.items()}}


def _rows():
    ok = {n: _check(True) for n in ("cupyffn-a", "cupyffn-b", "torch-compile-tf32", "torch-fp32")}
    bad_b = dict(ok, **{"cupyffn-b": _check(False, matched=0.9, err=3.0)})
    # cupyffn-b is the fastest but fails on the second workload; cupyffn-a is the fastest that passes
    return [_row(1.0, {"cupyffn-a": 2.0, "cupyffn-b": 1.5, "torch-compile-tf32": 4.0, "torch-fp32": 8.0}, ok),
            _row(4.0, {"cupyffn-a": 8.0, "cupyffn-b": 6.0, "torch-compile-tf32": 8.0, "torch-fp32": 32.0}, bad_b)]


def test_mean_geomean_and_percent_of_sol():
    s = R.summarize(_rows())
    a = s["implementations"]["cupyffn-a"]
    assert a["mean_ms"] == 5.0
    assert a["geomean_ms"] == pytest.approx(4.0)
    assert a["pct_sol"] == pytest.approx(100 * 2.5 / 5.0)  # mean SOL / mean latency, not a mean of ratios
    assert s["sol_mean_ms"] == 2.5 and s["sol_geomean_ms"] == pytest.approx(2.0)


def test_verdicts_over_workloads_and_rounds():
    per = R.summarize(_rows())["implementations"]
    assert per["cupyffn-a"]["passes"] and per["cupyffn-a"]["rounds_passed"] == per["cupyffn-a"]["rounds_total"] == 4
    b = per["cupyffn-b"]
    assert b["passes"] is False and b["rounds_passed"] == 3 and b["rounds_total"] == 4
    assert b["least_matched"] == 0.9 and b["worst_err_over_atol"] == 3.0


def test_sol_scores_against_both_baselines():
    per = R.summarize(_rows())["implementations"]
    a = per["cupyffn-a"]
    # workload 1: 1 / (1 + (2 - 1) / (4 - 1)) = 0.75; workload 2: baseline == kernel -> 0.5
    assert a["sol_score_vs:torch-compile-tf32"] == pytest.approx((0.75 + 0.5) / 2)
    assert a["sol_score_vs:torch-fp32"] == pytest.approx((1 / (1 + 1 / 7) + 1 / (1 + 4 / 28)) / 2)
    assert per["torch-compile-tf32"]["sol_score_vs:torch-compile-tf32"] == pytest.approx(0.5)


def test_headline_is_the_fastest_passing_cupyffn_mode_against_the_fastest_passing_peer():
    h = R.summarize(_rows())["headline"]
    assert h["implementation"] == "cupyffn-a"  # cupyffn-b is faster but fails
    assert h["peer"] == "torch-compile-tf32"
    assert h["speedup_mean"] == pytest.approx(6.0 / 5.0)
    assert h["speedup_geomean"] == pytest.approx(math.sqrt(32) / 4.0)
    assert "cupyffn-a" in R.headline_text(h)


def test_no_headline_without_recorded_verdicts_and_targets_say_na():
    rows = _rows()
    for r in rows:
        for res in r["results"].values():
            res["check"] = None
    s = R.summarize(rows)
    assert s["headline"] is None and s["implementations"]["cupyffn-a"]["passes"] is None
    targets = [("x", "cupyffn-a", "passes", "==", True, ""), ("x", "cupyffn-a", "geomean_ms", "<=", 3.0, ""),
               ("x", "missing", "geomean_ms", "<=", 1.0, "")]
    got = R.evaluate_targets(s, targets)
    assert [(t[1], t[2], t[6]) for t in got] == [("cupyffn-a", "passes", None), ("cupyffn-a", "geomean_ms", False)]


def test_markdown_marks_only_benchmark_failures():
    rows = _rows()
    result = {"env": {k: "x" for k in ("device", "driver", "cuda_runtime", "cublas", "cupy", "torch")},
              "date": "d", "git_commit": "c", "command": "python bench.py", "format": R.FORMAT, "workloads": rows,
              "protocol": {"timing": "cupti", "warmup": 10, "iters": 50, "input_sets": 3, "l2_flush_bytes": 120 << 20,
                           "rounds": 2}, "summary": R.summarize(rows)}
    md = R.markdown(result)
    assert md.count("✗") == 2  # one failed cell, and the legend
    assert "6.000 ✗" in md and "Fastest cupyffn mode that passes the benchmark's check: cupyffn-a" in md


def test_kernel_spans_from_cupti_records():
    windows = [(100, 110), (200, 210)]
    launches = [(101, 1), (105, 2), (150, 9), (201, 3), (209, 4)]  # corr 9 launched between windows: not ours
    activities = [(1, 1000, 1500, "k1"), (2, 1400, 2600, "k2"), (9, 0, 99999, "flush"),
                  (3, 5000, 5100, "k1"), (4, 5200, 6200, "k2")]
    spans, same = P.kernel_spans(windows, launches, activities)
    assert spans == [pytest.approx(1600 / 1e6), pytest.approx(1200 / 1e6)] and same
    activities[-1] = (4, 5200, 6200, "k3")
    assert P.kernel_spans(windows, launches, activities)[1] is False
    with pytest.raises(RuntimeError, match="no GPU activity for timed iteration 1"):
        P.kernel_spans(windows, launches[:3], activities[:3])


def test_old_results_are_read_without_verdicts():
    full, _ = R.newest_results()
    assert full is not None and full["format"] == R.FORMAT
    if full.get("converted_from_earlier_format"):
        assert all(e["passes"] is None for e in full["summary"]["implementations"].values())
        assert "predates the benchmark's own check" in R.markdown(full)


class _FakeCupti:
    """Just enough of cupti-python's activity API for Timer: each launch() makes one API record and one kernel."""

    class ActivityKind:
        RUNTIME, DRIVER, CONCURRENT_KERNEL, MEMCPY, MEMSET = 5, 4, 10, 1, 2

    class _Record:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    def __init__(self, fail_enable=False):
        self.clock, self.corr, self.pending, self.enabled = 0, 0, [], set()
        self.fail_enable, self.finalized = fail_enable, 0

    def get_timestamp(self):
        self.clock += 10
        return self.clock

    def activity_enable(self, kind):
        if self.fail_enable:
            raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")
        self.enabled.add(kind)

    def activity_disable(self, kind):
        self.enabled.discard(kind)

    def activity_register_callbacks(self, requested, completed):
        assert requested()[0] > 0
        self.completed = completed

    def launch(self, gpu_ms):
        if not self.enabled:
            return
        self.clock += 1
        self.corr += 1
        K = self.ActivityKind
        self.pending.append(self._Record(kind=K.DRIVER, start=self.clock, end=self.clock + 1, correlation_id=self.corr))
        self.pending.append(self._Record(kind=K.CONCURRENT_KERNEL, start=1000 * self.corr,
                                         end=1000 * self.corr + int(gpu_ms * 1e6), correlation_id=self.corr, name="k"))

    def activity_flush_all(self, flag):
        self.completed(self.pending)
        self.pending = []

    def finalize(self):
        self.finalized += 1


class _FakeCupy:
    class cuda:
        class runtime:
            @staticmethod
            def deviceSynchronize():
                pass

        class Event:
            def record(self, stream=None):
                pass

        @staticmethod
        def get_current_stream():
            return None

        @staticmethod
        def get_elapsed_time(a, b):
            return 0.25


def _timer(cupti, flushes):
    import contextlib

    t = P.Timer(_FakeCupy, contextlib.nullcontext, lambda: flushes.append(1), warmup=2, iters=5)
    t.cupti, t.cupti_reason = cupti, None
    return t


def test_timer_cupti_path_gives_each_iteration_its_own_span():
    cupti, flushes = _FakeCupti(), []
    calls = []
    got = _timer(cupti, flushes).measure(lambda i: (calls.append(i), cupti.launch(0.1 * (i + 1))))
    assert got["timing"] == "cupti" and "timing_note" not in got
    assert calls == list(range(7)) and len(flushes) == 7  # 2 warm-up + 5 timed, each after a flush
    assert got["times"] == [pytest.approx(0.1 * (i + 1)) for i in range(2, 7)]
    assert cupti.finalized == 1 and not cupti.enabled


def test_timer_falls_back_to_events_and_says_why():
    cupti, flushes = _FakeCupti(fail_enable=True), []
    got = _timer(cupti, flushes).measure(lambda i: cupti.launch(1.0))
    assert got["timing"] == "cuda-events" and got["times"] == [0.25] * 5
    assert "CUPTI failed (RuntimeError: CUPTI_ERROR_NOT_INITIALIZED)" in got["timing_note"]
    assert cupti.finalized == 1


def test_idle_events_start_the_clock_on_an_empty_stream():
    """--timer events-idle: per timed iteration flush, synchronize, start event, call, end event, in that order (so
    the host's part of the call is inside the events); CUPTI is not used; warm-up iterations do not synchronize."""
    import contextlib

    order = []

    class Stream:
        def synchronize(self):
            order.append("sync")

    class RecordingEvent:
        def record(self, stream=None):
            order.append("event")

    class Cupy(_FakeCupy):
        class cuda(_FakeCupy.cuda):
            Event = RecordingEvent

            @staticmethod
            def get_current_stream():
                return Stream()

    t = P.Timer(Cupy, contextlib.nullcontext, lambda: order.append("flush"), warmup=1, iters=2, idle=True)
    assert t.cupti is None and t.method == "cuda-events-idle" and "events-idle" in t.cupti_reason
    got = t.measure(lambda i: order.append(f"call {i}"))
    assert got["timing"] == "cuda-events-idle" and got["times"] == [0.25, 0.25]
    assert order == ["flush", "call 0"] + ["flush", "sync", "event", "call 1", "event",
                                           "flush", "sync", "event", "call 2", "event"]


def test_profile_stages_needs_a_gpu_plan():
    import cupyffn

    plan = cupyffn.GeluFFNBackward(4, 8, 16, device="cpu")
    from benchmarks import stages

    with pytest.raises(RuntimeError, match="the stage profile needs a GPU plan"):
        stages.profile(plan, out=(None, None, None))


def test_an_a_b_twin_is_never_the_headline():
    """A twin of a precision run for one measurement (R.A_B_TWINS) stays out of the headline even when it
    passes and is the fastest: the headline names a precision a user selects."""
    twin = R.A_B_TWINS[0]
    rows = _rows()
    for row, t in zip(rows, (1.9, 7.9)):
        row["results"][twin] = dict(row["results"]["cupyffn-a"], median_ms=t)
    s = R.summarize(rows)
    assert s["implementations"][twin]["passes"] and s["implementations"][twin]["mean_ms"] < 5.0
    assert s["headline"]["implementation"] == "cupyffn-a"


@pytest.fixture
def stale_readme_copy(tmp_path, monkeypatch):
    """A copy of README.md whose generated results section is stale, in place of README.md, and a recorder in place of
    the plot (the real one writes results/<gpu>.png)."""
    import bench

    readme = tmp_path / "README.md"
    text = R.README.read_text()
    head, rest = text.split(R.BEGIN, 1)
    readme.write_text(head + R.BEGIN + "\nstale line\n" + R.END + rest.split(R.END, 1)[1])
    plots = []
    monkeypatch.setattr(R, "README", readme)
    monkeypatch.setattr(R, "plot", lambda result, path: plots.append(path))
    return bench, readme, plots


def test_readme_no_write_writes_nothing_and_shows_the_diff(stale_readme_copy, capsys):
    bench, readme, plots = stale_readme_copy
    before = readme.read_bytes()
    assert bench.main(["--readme", "--no-write"]) == 0
    assert readme.read_bytes() == before and plots == []
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["--- README.md", "+++ README.md regenerated"] and "-stale line" in out
    assert "+" + bench.readme_sections()[(R.BEGIN, R.END)].splitlines()[0] in out


def test_readme_writes_the_regenerated_sections(stale_readme_copy):
    bench, readme, plots = stale_readme_copy
    assert bench.main(["--readme"]) == 0
    assert readme.read_text() == (R.ROOT / "README.md").read_text()  # the checkout's README is up to date
    assert "stale line" not in readme.read_text() and len(plots) == 1
    assert bench.main(["--readme", "--no-write"]) == 0  # now up to date


def test_gemm_floor_ratio_counts_only_large_t_and_stays_out_of_the_implementations():
    rows = _rows()
    for r, tokens, floor in zip(rows, (2048, 8192), (1.0, 5.0)):
        r["tokens"], r["floor"] = tokens, {"name": "gemm-floor-fp16", "median_ms": floor}
    s = R.summarize(rows)
    # only T >= 4096 counts for the target: 8 / 5 for cupyffn-a (2.0 / 1.0 at T = 2048 is left out)
    assert s["implementations"]["cupyffn-a"]["floor_ratio_large_t"] == pytest.approx(1.6)
    assert s["floor"]["mean_ms"] == 3.0 and s["floor"]["geomean_ms"] == pytest.approx(math.sqrt(5.0))
    assert "gemm-floor-fp16" not in s["implementations"] and s["headline"]["implementation"] == "cupyffn-a"
    assert R.floor_ratios(rows, "cupyffn-b") == [(2048, 1.5), (8192, 1.2)]
    missed = [t for t in R.evaluate_targets(s, [("fastest", "cupyffn-a", "floor_ratio_large_t", "<=", 1.15, "")])]
    assert missed[0][5] == pytest.approx(1.6) and missed[0][6] is False


def test_gemm_stage_bytes_are_the_operands_read_once_and_the_output_written_once():
    T, D, H = 256, 1536, 6144
    assert R.gemm_bytes("GEMM2 grad_weight2", T, D, H) == 2 * (T * D + T * H) + 4 * D * H
    assert R.gemm_bytes("GEMM4 grad_weight1", T, D, H) == 2 * (T * H + T * D) + 4 * H * D
    # the fused GEMM1 reads linear1_out and tanh_inner (fp32) and writes fp16 codes; cuBLAS's writes fp32
    assert R.gemm_bytes("GEMM1 + dgelu (sm90 fused)", T, D, H) == 2 * (T * D + D * H) + 10 * T * H
    assert R.gemm_bytes("GEMM1 grad_gelu", T, D, H) == 2 * (T * D + D * H) + 4 * T * H
    assert R.gemm_bytes("dgelu", T, D, H) is None
    rows = R.stage_rates({"GEMM3 grad_hidden": {"ms": 0.02}}, T, D, H, planes=1)
    assert rows[0]["gbps"] == pytest.approx(R.gemm_bytes("GEMM3", T, D, H) / 2e-5 / 1e9)
    assert "gbps" not in R.stage_rates({"GEMM3 grad_hidden": {"ms": 0.02}}, T, D, H, planes=3)[0]
