"""The benchmark's measurement protocol: L2 flush, input rotation, CUPTI / CUDA-event timing, check rounds.

Timing follows SOL-ExecBench (core/bench/timing.py), re-implemented here: 10 warm-up and 50 timed
iterations; before each one the L2 is flushed by zero-filling a buffer of twice its size and the call
gets another input set than the previous one (a pool of >= 3 sets at different addresses, each with
its own fresh random contents; choosing one is free, so nothing of it is timed), so nothing keyed by
an input address carries over. One iteration's time is, with CUPTI, the span from the start of the
first GPU activity (kernel, memcpy, memset) launched between two host timestamps around the call to
the end of the last one, gaps included, the device synchronized after each iteration; without CUPTI,
CUDA events recorded after the flush and after the call. The median is the workload's figure.
With `idle=True` (bench.py --timer events-idle) the events are recorded the way an evaluator without CUPTI times a
call from an idle GPU: the stream is synchronized after the flush, so the start event is recorded with nothing
queued and the host's work before the first kernel (validation, launches) counts, as it does for a caller whose
GPU waits on it (small T); the CUPTI span and the plain events timer hide it behind the flush.
"""

import bisect
import math
from collections import defaultdict

from cupyffn import workloads as W


def cupti_or_reason():
    """(the cupti module, None) when `cupti-python` imports, else (None, why not)."""
    try:
        from cupti import cupti

        return cupti, None
    except Exception as e:  # not installed, or its libcupti does not load
        return None, f"{type(e).__name__}: {e}"


def l2_bytes(cupy):
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return int(props.get("l2CacheSize") or 0) or (60 << 20)  # H200: 60 MiB (fallback if not reported)


class L2Flush:
    """Zero-fills a buffer of twice the L2 size on the current stream (the benchmark's flush)."""

    def __init__(self, cupy):
        self.nbytes = 2 * l2_bytes(cupy)
        self.buffer = cupy.empty(self.nbytes, dtype=cupy.uint8)

    def __call__(self):
        self.buffer.fill(0)


def kernel_spans(windows, launches, activities):
    """Per-iteration spans in ms from CUPTI records (pure Python, so it is tested on the CPU).

    windows: [(host_start_ns, host_end_ns)] around each iteration's call; launches: [(api_start_ns,
    correlation_id)] of runtime/driver API calls; activities: [(correlation_id, start_ns, end_ns, name)]
    of GPU work. An iteration owns the GPU work whose launching API call started inside its window.
    Returns (spans_ms, same_set): same_set tells whether every iteration ran the same set of kernels
    (the benchmark rejects a solution whose iterations differ).
    """
    launches = sorted(launches)
    starts = [s for s, _ in launches]
    by_corr = defaultdict(list)
    for corr, start, end, name in activities:
        by_corr[corr].append((start, end, name))
    spans, sets = [], []
    for i, (t0, t1) in enumerate(windows):
        lo, hi = bisect.bisect_left(starts, t0), bisect.bisect_right(starts, t1)
        work = [a for _, corr in launches[lo:hi] for a in by_corr.get(corr, ())]
        if not work:
            raise RuntimeError(f"CUPTI recorded no GPU activity for timed iteration {i}")
        spans.append((max(e for _, e, _ in work) - min(s for s, _, _ in work)) / 1e6)
        sets.append(frozenset(n for _, _, n in work))
    return spans, all(s == sets[0] for s in sets)


class Timer:
    """Times `run(i)` (which enqueues iteration i's call, on the bench stream) the benchmark's way."""

    def __init__(self, cupy, ctx, flush, warmup=10, iters=50, use_cupti=True, idle=False):
        self.cupy, self.ctx, self.flush = cupy, ctx, flush
        self.warmup, self.iters, self.idle = warmup, iters, idle
        self._events_method = "cuda-events-idle" if idle else "cuda-events"  # the timing name when CUPTI is not used
        why = f"not asked for (--timer {'events-idle' if idle else 'events'})"
        self.cupti, self.cupti_reason = cupti_or_reason() if use_cupti and not idle else (None, why)

    @property
    def method(self):
        return "cupti" if self.cupti is not None else self._events_method

    def measure(self, run):
        """{"times": [ms per timed iteration], "timing": method, "timing_note": why events, if they were}."""
        with self.ctx():
            for i in range(self.warmup):
                self.flush()
                run(i)
        self.cupy.cuda.runtime.deviceSynchronize()
        note = None
        if self.cupti is not None:
            try:
                times, same = self._cupti(run)
                out = {"times": times, "timing": "cupti"}
                if not same:
                    out["timing_note"] = "the timed iterations did not all run the same set of kernels"
                return out
            except Exception as e:  # fall back for this measurement and say so; CUPTI stays on for the next
                note = f"CUPTI failed ({type(e).__name__}: {e}); CUDA events used"
                print(f"  warning: {note}")
        return {"times": self._events(run), "timing": self._events_method, **({"timing_note": note} if note else {})}

    def _events(self, run):
        cupy = self.cupy
        starts = [cupy.cuda.Event() for _ in range(self.iters)]
        ends = [cupy.cuda.Event() for _ in range(self.iters)]
        with self.ctx():
            stream = cupy.cuda.get_current_stream()
            for k in range(self.iters):
                self.flush()
                if self.idle:  # nothing queued when the clock starts: the host's part of the call counts
                    stream.synchronize()
                starts[k].record(stream)
                run(self.warmup + k)
                ends[k].record(stream)
        cupy.cuda.runtime.deviceSynchronize()
        return [cupy.cuda.get_elapsed_time(a, b) for a, b in zip(starts, ends)]

    def _cupti(self, run):
        cupti, cupy = self.cupti, self.cupy
        K = cupti.ActivityKind
        api = {K.RUNTIME, K.DRIVER}
        gpu = {K.CONCURRENT_KERNEL: None, K.MEMCPY: "MEMCPY", K.MEMSET: "MEMSET"}
        launches, activities, windows = [], [], []

        def requested():
            return 8 << 20, 0  # bytes per buffer, no record limit

        def completed(records):  # copy the fields now: records belong to CUPTI's buffer
            for a in records:
                if a.kind in api:
                    launches.append((a.start, a.correlation_id))
                elif a.kind in gpu:
                    activities.append((a.correlation_id, a.start, a.end, gpu[a.kind] or str(a.name)))

        kinds = list(api) + list(gpu)
        enabled = []
        try:
            for k in kinds:
                cupti.activity_enable(k)
                enabled.append(k)
            cupti.activity_register_callbacks(requested, completed)
            with self.ctx():
                for k in range(self.iters):
                    self.flush()  # launched before the window opens: not part of the span
                    t0 = cupti.get_timestamp()
                    run(self.warmup + k)
                    t1 = cupti.get_timestamp()
                    cupy.cuda.runtime.deviceSynchronize()
                    windows.append((t0, t1))
            cupti.activity_flush_all(0)
        finally:
            for k in enabled:
                try:
                    cupti.activity_disable(k)
                except Exception:
                    pass
            try:
                cupti.finalize()
            except Exception:
                pass
        return kernel_spans(windows, launches, activities)


class CheckRounds:
    """The benchmark's verdict for one implementation on one workload, accumulated over rounds."""

    def __init__(self):
        self.rounds = 0
        self.rounds_passed = 0
        self.outputs = {}

    def add(self, checks):
        """checks: {output: cupyffn.workloads.Check} of one round."""
        self.rounds += 1
        self.rounds_passed += all(c.passed for c in checks.values())
        for name, c in checks.items():
            o = self.outputs.setdefault(name, {"least_matched": 1.0, "worst_err_over_atol": 0.0, "max_rel_l2": 0.0,
                                               "all_finite": True, "never_all_zero": True})
            o["least_matched"] = min(o["least_matched"], c.matched)
            o["worst_err_over_atol"] = max(o["worst_err_over_atol"], c.err_over_atol)
            o["max_rel_l2"] = max(o["max_rel_l2"], c.rel_l2) if not math.isnan(c.rel_l2) else math.inf
            o["all_finite"] &= c.finite
            o["never_all_zero"] &= c.nonzero

    def as_dict(self):
        return {"rounds": self.rounds, "rounds_passed": self.rounds_passed,
                "passed": self.rounds > 0 and self.rounds_passed == self.rounds, "outputs": self.outputs}


def check_outputs(cupy, outputs, ref32, ref64, tokens):
    """{output: Check} of one call's three outputs, with the workload's official max_atol."""
    outs = [o if isinstance(o, cupy.ndarray) else cupy.from_dlpack(o) for o in outputs]
    return {name: W.check(o, r32, r64, xp=cupy, tokens=tokens)
            for name, o, r32, r64 in zip(W.OUTPUT_NAMES, outs, ref32, ref64)}
