#!/usr/bin/env python
"""cupyffn benchmark: every precision side by side with PyTorch and plain CuPy, on the 16 official workloads.

    python bench.py              # all workloads; writes results/<gpu>.json and results/<gpu>.md
    python bench.py --quick      # a subset
    python bench.py --compile    # also torch.compile(mode="max-autotune-no-cudagraphs") (slow to compile)
    python bench.py --loop       # steady-state loop: host time per call, graph replay (results/<gpu>-loop.json)
    python bench.py --readme     # regenerate README.md's tables from results/*.json (no GPU needed)

Timing protocol (../shared/PROBLEM.md): before every timed iteration a 256 MiB buffer is written (L2
flush); one whole backward call is timed with CUDA events; median of the iterations per workload;
workloads summarized by geometric mean. Each implementation's outputs are NaN-poisoned and checked
with the benchmark's check against the plain-fp32 reference, plus relative L2 error vs float64.
Without a GPU the NumPy backend runs on reduced sizes (a banner says so) and nothing is written.
"""

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy

import cupyffn
from cupyffn import workloads as W

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
README = ROOT / "README.md"
QUICK = ("B2xS128", "B1xS1024", "B8xS613", "B4xS2048")

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def geomean(values):
    values = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


# ---------------------------------------------------------------------------------------- GPU side
def gpu_or_reason():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "no CUDA device"
        cupy.zeros(1).sum()
        return cupy, None
    except Exception as e:  # no driver, no device, no cupy
        return None, f"{type(e).__name__}: {e}"


def environment(cupy, torch):
    props = cupy.cuda.runtime.getDeviceProperties(0)
    env = {
        "device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "sm_count": props["multiProcessorCount"],
        "l2_bytes": props.get("l2CacheSize"),
        "driver_api": cupy.cuda.runtime.driverGetVersion(),
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "cupy": cupy.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "cupyffn": cupyffn.__version__,
    }
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        env["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except Exception:
        env["driver"] = None
    from cupy_backends.cuda.libs import nvrtc

    env["nvrtc"] = ".".join(map(str, nvrtc.getVersion()))
    from cupyffn import _cublas

    handle = _cublas.acquire(0)
    env["cublas"] = handle.version()
    _cublas.release(handle)
    env["torch"] = torch.__version__ if torch else None
    env["torch_cuda"] = torch.version.cuda if torch else None
    return env


def git_commit():
    commit = os.environ.get("CUPYFFN_GIT_COMMIT")
    if commit:
        return commit
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "cupyffn", "kernels_cu", "bench.py"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else None
    except Exception:
        return None


def torch_or_none():
    # torch.compile's default pool of compile worker processes stays alive and competes for the host
    # CPU with the host-time measurements of loop mode: compile in-process instead.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


def torch_backward(dy, x, w1, w2, z, t, g):
    """The reference formula in PyTorch eager ops (2-D tensors)."""
    gg = dy @ w2
    gw2 = dy.t() @ g
    gelu_grad = 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * SQRT_2_OVER_PI * (1 + 0.134145 * z * z)
    dz = gg * gelu_grad
    return dz @ w1, dz.t() @ x, gw2


class Bench:
    """Implementations, timing and checks on one stream."""

    def __init__(self, cupy, torch, iters, warmup, compile_):
        self.cupy = cupy
        self.torch = torch
        self.iters, self.warmup = iters, warmup
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.flush = cupy.empty(64 << 20, dtype=cupy.float32)  # 256 MiB
        self.compile = compile_
        self._compiled = None
        self._naive_dgelu = cupy.ElementwiseKernel(
            "float32 gg, float32 x, float32 t", "float32 dz",
            "dz = gg * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608028654f"
            " * (1.0f + 0.134145f * x * x))", "bench_naive_dgelu")

    # -- implementations: name -> (run() -> outputs, plan or None, plan's out= buffers or None)
    def implementations(self, args2d, shapes):
        cupy, torch = self.cupy, self.torch
        impls = {}
        T, D = args2d[0].shape
        H = args2d[2].shape[0]
        for p in cupyffn.PRECISIONS:
            plan = cupyffn.GeluFFNBackward(T, D, H, precision=p)
            out = tuple(cupy.empty(s, dtype=cupy.float32) for s in shapes)
            impls[f"cupyffn-{p}"] = (lambda plan=plan, out=out: plan(*args2d, out=out, stream=self.stream), plan, out)

        def naive():
            dy, x, w1, w2, z, t, g = args2d
            gg = dy @ w2
            gw2 = dy.T @ g
            dz = self._naive_dgelu(gg, z, t)
            return dz @ w1, dz.T @ x, gw2

        impls["cupy-naive-fp32"] = (naive, None, None)
        if torch is not None:
            targs = [torch.from_dlpack(a) for a in args2d]

            def eager(tf32):
                def run():
                    torch.backends.cuda.matmul.allow_tf32 = tf32
                    torch.backends.cudnn.allow_tf32 = tf32
                    return torch_backward(*targs)
                return run

            impls["torch-fp32"] = (eager(False), None, None)
            impls["torch-tf32"] = (eager(True), None, None)
            if self.compile:
                if self._compiled is None:
                    self._compiled = torch.compile(torch_backward, mode="max-autotune-no-cudagraphs", dynamic=True)

                def compiled():
                    torch.backends.cuda.matmul.allow_tf32 = False
                    return self._compiled(*targs)

                impls["torch-compile-fp32"] = (compiled, None, None)
        return impls

    def _ctx(self):
        """Run on our stream, for CuPy and (if present) torch."""
        torch = self.torch

        class Both:
            def __enter__(s):
                s.c = self.stream.__enter__()
                if torch is not None:
                    s.t = torch.cuda.stream(torch.cuda.ExternalStream(self.stream.ptr))
                    s.t.__enter__()

            def __exit__(s, *exc):
                if torch is not None:
                    s.t.__exit__(*exc)
                self.stream.__exit__(*exc)

        return Both()

    def as_cupy(self, arrays):
        cupy = self.cupy
        return [a if isinstance(a, cupy.ndarray) else cupy.from_dlpack(a) for a in arrays]

    def run_checked(self, run, out, ref32, ref64):
        """Run once with poisoned outputs; return {output: Check}."""
        cupy = self.cupy
        with self._ctx():
            for o in out or ():  # poison the out= buffers the run writes into
                o.fill(numpy.nan)
            outputs = self.as_cupy(run())
        self.stream.synchronize()
        return {name: W.check(o, r32, r64, xp=cupy)._asdict()
                for name, o, r32, r64 in zip(W.OUTPUT_NAMES, outputs, ref32, ref64)}

    def time_ms(self, run, flush=True, iters=None):
        cupy = self.cupy
        iters = iters or self.iters
        with self._ctx():
            for _ in range(self.warmup):
                run()
            starts = [cupy.cuda.Event() for _ in range(iters)]
            ends = [cupy.cuda.Event() for _ in range(iters)]
            for i in range(iters):
                if flush:
                    self.flush.fill(float(i))
                starts[i].record(self.stream)
                run()
                ends[i].record(self.stream)
        self.stream.synchronize()
        return [cupy.cuda.get_elapsed_time(a, b) for a, b in zip(starts, ends)]

    def profile_stages(self, plan, args2d, out, reps=5):
        """Serial run of one plan with events between stages: {stage: median ms}."""
        cupy = self.cupy
        engine = plan._engine
        samples = {}
        with self._ctx():
            plan(*args2d, out=out, stream=self.stream)  # warm, and sets the plan's pointers
            for _ in range(reps):
                self.flush.fill(0.0)
                events = [(None, cupy.cuda.Event())]
                events[0][1].record(self.stream)

                def mark(stage):
                    e = cupy.cuda.Event()
                    e.record(self.stream)
                    events.append((stage, e))

                engine.enqueue(self.stream.ptr, serial=True, mark=mark)
                self.stream.synchronize()
                counts = {}
                for (_, a), (stage, b) in zip(events, events[1:]):
                    counts[stage] = counts.get(stage, 0) + 1
                    key = stage if counts[stage] == 1 else f"{stage} #{counts[stage]}"
                    samples.setdefault(key, []).append(cupy.cuda.get_elapsed_time(a, b))
        return {k: statistics.median(v) for k, v in samples.items()}


def stage_rates(stages, plan):
    """Attach GB/s (memory stages) and TFLOP/s (GEMMs) to a stage profile."""
    engine = plan._engine
    nbytes = engine.stage_bytes()
    T, D, H = engine.T, engine.D, engine.H
    planes = max(engine.planes, 1)
    flops = 2 * T * D * H * planes
    out = []
    for stage, ms in stages.items():
        row = {"stage": stage, "ms": ms}
        if stage in nbytes:
            row["bytes"] = nbytes[stage]
            row["gbps"] = row["bytes"] / (ms * 1e-3) / 1e9
        elif stage.startswith("GEMM"):
            row["tflops"] = flops / (ms * 1e-3) / 1e12
        out.append(row)
    return out


def run_gpu(args, cupy):
    torch = torch_or_none()
    if args.compile and torch is None:
        print("--compile: torch is not available; skipped")
    bench = Bench(cupy, torch, args.iters, args.warmup, args.compile and torch is not None)
    env = environment(cupy, torch)
    chosen = [w for w in W.WORKLOADS if not args.quick or w.label in QUICK]
    print(f"# cupyffn {cupyffn.__version__} on {env['device']} (driver {env['driver']}, CUDA runtime "
          f"{env['cuda_runtime']}, cuBLAS {env['cublas']}, CuPy {env['cupy']}, torch {env['torch']})")
    if torch is None:
        print("# torch not available: PyTorch baselines skipped")
    rows = []
    for w in chosen:
        inputs = W.make_inputs((w.batch_size, w.seq_len), xp=cupy, seed=w.tokens)
        args2d = [inputs[n].reshape(-1, inputs[n].shape[-1]) for n in W.INPUT_NAMES]
        ref64 = W.reference(inputs, xp=cupy)
        ref32 = W.reference(inputs, xp=cupy, dtype=numpy.float32)
        shapes = [a.shape for a in ref64]
        impls = bench.implementations(args2d, shapes)
        # Inputs, references and plans were made on the current (legacy) stream; the bench's
        # non-blocking stream is not ordered after it.
        cupy.cuda.Device().synchronize()
        ref_checks = {o: W.check(r32, r32, r64, xp=cupy) for o, r32, r64 in zip(W.OUTPUT_NAMES, ref32, ref64)}
        row = {"label": w.label, "batch_size": w.batch_size, "seq_len": w.seq_len, "tokens": w.tokens,
               "sol_ms": W.sol_ms(w.tokens), "results": {},
               "fp32_reference_rel_l2": {o: c.rel_l2 for o, c in ref_checks.items()}}
        for name, (run, plan, out) in impls.items():
            checks = bench.run_checked(run, out, ref32, ref64)
            times = bench.time_ms(run)
            res = {"median_ms": statistics.median(times), "min_ms": min(times),
                   "p20_ms": float(numpy.percentile(times, 20)), "p80_ms": float(numpy.percentile(times, 80)),
                   "iters": len(times), "checks": checks, "passed": all(c["passed"] for c in checks.values()),
                   "max_rel_l2": max(c["rel_l2"] for c in checks.values())}
            if plan is not None:
                res["scratch_bytes"] = plan.scratch_bytes
                res["workspace_bytes"] = plan.workspace_bytes
                res["peak_temp_ratio"] = (plan.scratch_bytes + plan.workspace_bytes) / (4 * w.tokens * W.HIDDEN_DIM)
                res["lean_layout"] = plan._engine.lean
                stages = bench.profile_stages(plan, args2d, out)
                res["stages"] = stage_rates(stages, plan)
                res["gemm_sum_ms"] = sum(s["ms"] for s in res["stages"] if s["stage"].startswith("GEMM"))
            row["results"][name] = res
        baseline = row["results"].get("torch-compile-fp32") or row["results"].get("torch-fp32")
        row["score_baseline"] = "torch-compile-fp32" if "torch-compile-fp32" in row["results"] else "torch-fp32"
        for res in row["results"].values():
            if baseline is not None:
                res["sol_score"] = W.sol_score(res["median_ms"], row["sol_ms"], baseline["median_ms"])
        rows.append(row)
        print_workload(row)
        for _, plan, _ in impls.values():
            if plan is not None:
                plan.close()
        del impls, inputs, args2d, ref64, ref32
        cupy.get_default_memory_pool().free_all_blocks()
    summary = summarize(rows)
    print_summary(summary, rows)
    return {"env": env, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "command": " ".join(["python", "bench.py"] + sys.argv[1:]),
            "protocol": {"l2_flush_bytes": 256 << 20, "iters": args.iters, "warmup": args.warmup,
                         "statistic": "median of CUDA-event times per workload; geomean over workloads",
                         "quick": args.quick},
            "workloads": rows, "summary": summary}


def summarize(rows):
    names = list(rows[0]["results"])
    summary = {"geomean_ms": {}, "all_passed": {}, "max_rel_l2": {}, "mean_sol_score": {}}
    for n in names:
        ms = [r["results"][n]["median_ms"] for r in rows if n in r["results"]]
        summary["geomean_ms"][n] = geomean(ms)
        summary["all_passed"][n] = all(r["results"][n]["passed"] for r in rows if n in r["results"])
        summary["max_rel_l2"][n] = max(r["results"][n]["max_rel_l2"] for r in rows if n in r["results"])
        scores = [r["results"][n].get("sol_score") for r in rows if n in r["results"]]
        if all(s is not None for s in scores):
            summary["mean_sol_score"][n] = sum(scores) / len(scores)
    summary["sol_geomean_ms"] = geomean([r["sol_ms"] for r in rows])
    summary["score_baseline"] = rows[0]["score_baseline"]
    return summary


def print_workload(row):
    print(f"\n## {row['label']}  T={row['tokens']}  SOL {row['sol_ms']:.3f} ms")
    print(f"{'implementation':22s} {'median ms':>10s} {'x SOL':>6s} {'check':>6s} {'max rel L2':>11s} {'score':>6s}")
    for name, res in row["results"].items():
        print(f"{name:22s} {res['median_ms']:10.3f} {res['median_ms'] / row['sol_ms']:6.2f} "
              f"{'pass' if res['passed'] else 'FAIL':>6s} {res['max_rel_l2']:11.2e} {res.get('sol_score', float('nan')):6.3f}")
    for name, res in row["results"].items():
        if not res["passed"]:
            print(f"  {name} check: " + ", ".join(
                f"{o} matched {c['matched']:.5f}{'' if c['finite'] else ' NON-FINITE'}" for o, c in res["checks"].items()))
    print("  fp32 reference vs float64: " + ", ".join(f"{o} {e:.1e}" for o, e in row["fp32_reference_rel_l2"].items()))
    for name, res in row["results"].items():
        if "stages" in res:
            parts = []
            for s in res["stages"]:
                rate = f"{s['gbps']:.0f} GB/s" if "gbps" in s else (f"{s['tflops']:.0f} TF/s" if "tflops" in s else "")
                parts.append(f"{s['stage']} {s['ms']:.3f}" + (f" ({rate})" if rate else ""))
            peak = res["scratch_bytes"] + res["workspace_bytes"]
            print(f"  {name}: " + ", ".join(parts) +
                  f"; scratch+workspace {peak / 2**20:.0f} MiB = {res['peak_temp_ratio']:.2f}x T*H*4")


TARGETS = [  # (implementation, geomean target ms, baseline for a speedup target, speedup)
    ("cupyffn-bf16x3", 0.65, "torch-fp32", 5.0),
    ("cupyffn-tf32", 0.40, "torch-tf32", 2.5),
    ("cupyffn-bf16", 0.30, None, None),
]


def print_summary(summary, rows):
    g = summary["geomean_ms"]
    print(f"\n# Geomean over {len(rows)} workloads (SOL {summary['sol_geomean_ms']:.4f} ms); "
          f"SOL score baseline: {summary['score_baseline']}")
    for n, v in g.items():
        score = summary["mean_sol_score"].get(n)
        print(f"{n:22s} {v:8.4f} ms  all checks {'pass' if summary['all_passed'][n] else 'FAIL'}  "
              f"max rel L2 {summary['max_rel_l2'][n]:.2e}" + (f"  mean SOL score {score:.3f}" if score else ""))
    print("\n# Where we stand against the targets (issue 3)")
    for impl, target, base, speedup in TARGETS:
        if impl not in g:
            continue
        line = f"{impl}: geomean {g[impl]:.4f} ms (target <= {target}) {'MET' if g[impl] <= target else 'missed'}"
        if base and base in g:
            ratio = g[base] / g[impl]
            line += f"; {ratio:.2f}x faster than {base} (target >= {speedup}x) {'MET' if ratio >= speedup else 'missed'}"
        print(line)
    t8k = [r["results"]["cupyffn-bf16x3"]["median_ms"] for r in rows if r["tokens"] == 8192]
    if t8k:
        print(f"cupyffn-bf16x3 at T=8192: {max(t8k):.3f} ms (target <= 2.4) {'MET' if max(t8k) <= 2.4 else 'missed'}")
    if "cupyffn-ieee" in g:
        worst = max(r["results"]["cupyffn-ieee"]["median_ms"] / r["results"]["cupyffn-ieee"]["gemm_sum_ms"]
                    for r in rows)
        print(f"cupyffn-ieee: worst ratio to the sum of its four SGEMMs {worst:.3f} (target <= 1.02)"
              + (f"; {g['torch-fp32'] / g['cupyffn-ieee']:.2f}x vs torch-fp32" if "torch-fp32" in g else ""))


# ---------------------------------------------------------------------------------------- loop mode
def run_loop(args, cupy):
    """Steady state, no L2 flush: host time per call, wall time per call, GPU span of one call."""
    torch = torch_or_none()
    stream = cupy.cuda.Stream(non_blocking=True)
    chosen = [w for w in W.WORKLOADS if not args.quick or w.label in QUICK]
    n = args.loop_calls
    rows = []
    compiled = None
    print(f"\n# Loop mode: {n} back-to-back calls per implementation, no L2 flush")
    print(f"{'workload':12s} {'implementation':26s} {'host us/call':>12s} {'wall us/call':>12s} {'GPU us/call':>12s} {'wall/GPU':>8s}")
    for w in chosen:
        inputs = W.make_inputs((w.batch_size, w.seq_len), xp=cupy, seed=w.tokens)
        args2d = [inputs[k].reshape(-1, inputs[k].shape[-1]) for k in W.INPUT_NAMES]
        T, D = args2d[0].shape
        H = args2d[2].shape[0]
        shapes = [(T, D), (H, D), (D, H)]
        impls = {}
        for p in cupyffn.PRECISIONS:
            for graph in (False, True):
                plan = cupyffn.GeluFFNBackward(T, D, H, precision=p, graph=graph)
                out = tuple(cupy.empty(s, dtype=cupy.float32) for s in shapes)
                impls[f"cupyffn-{p}" + ("-graph" if graph else "")] = (
                    lambda plan=plan, out=out, args=args2d: plan(*args, out=out, stream=stream), plan)
        impls["cupyffn-bf16x3-functional"] = (
            lambda args=args2d: cupyffn.gelu_ffn_backward(*args, stream=stream), None)
        if torch is not None:
            targs = [torch.from_dlpack(a) for a in args2d]
            impls["torch-fp32"] = (lambda a=targs: torch_backward(*a), None)
            if args.compile:
                if compiled is None:  # one compilation for all shapes; CUDA graphs recorded per shape
                    compiled = torch.compile(torch_backward, mode="reduce-overhead", dynamic=True)
                impls["torch-compile-reduce-overhead"] = (lambda fn=compiled, a=targs: fn(*a), None)
        row = {"label": w.label, "tokens": w.tokens, "results": {}}
        for name, (run, plan) in impls.items():
            tctx = torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)) if torch is not None else None
            with stream:
                if tctx:
                    tctx.__enter__()
                try:
                    for _ in range(5):
                        run()
                    stream.synchronize()
                    spans = []
                    for _ in range(10):
                        a, b = cupy.cuda.Event(), cupy.cuda.Event()
                        a.record(stream)
                        run()
                        b.record(stream)
                        stream.synchronize()
                        spans.append(cupy.cuda.get_elapsed_time(a, b) * 1e3)
                    issue = []  # host time to issue one call, with the launch queue drained first
                    for _ in range(50):
                        stream.synchronize()
                        a = time.perf_counter()
                        run()
                        issue.append(time.perf_counter() - a)
                    stream.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        run()
                    stream.synchronize()
                    t2 = time.perf_counter()
                finally:
                    if tctx:
                        tctx.__exit__(None, None, None)
            res = {"host_us": statistics.median(issue) * 1e6, "wall_us": (t2 - t0) / n * 1e6,
                   "gpu_us": statistics.median(spans)}
            res["wall_over_gpu"] = res["wall_us"] / res["gpu_us"]
            row["results"][name] = res
            print(f"{w.label:12s} {name:26s} {res['host_us']:12.1f} {res['wall_us']:12.1f} {res['gpu_us']:12.1f} "
                  f"{res['wall_over_gpu']:8.2f}")
        for run, plan in impls.values():
            if plan is not None:
                plan.close()
        rows.append(row)
        del impls, inputs, args2d
        cupy.get_default_memory_pool().free_all_blocks()
    print_loop_summary(rows)
    breakdown = host_breakdown(cupy, stream)
    return {"host_breakdown_us": breakdown,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "command": " ".join(["python", "bench.py"] + sys.argv[1:]),
            "calls_per_measurement": n, "workloads": rows}


def host_breakdown(cupy, stream, tokens=256):
    """Host microseconds of the pieces of one bf16x3 call at T=256 (median of many, queue drained)."""
    from cupy_backends.cuda.api import runtime

    from cupyffn import _validate

    inputs = W.make_inputs((tokens,), xp=cupy, seed=1)
    args = [inputs[k] for k in W.INPUT_NAMES]
    out = (cupy.empty((tokens, W.DIM), cupy.float32), cupy.empty((W.HIDDEN_DIM, W.DIM), cupy.float32),
           cupy.empty((W.DIM, W.HIDDEN_DIM), cupy.float32))
    plan = cupyffn.GeluFFNBackward(tokens, W.DIM, W.HIDDEN_DIM)
    plan(*args, out=out, stream=stream)
    engine = plan._engine
    event = cupy.cuda.Event(disable_timing=True)

    def timed(fn, reps=200):
        samples = []
        for i in range(reps):
            if i % 10 == 0:
                stream.synchronize()
            a = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - a)
        stream.synchronize()
        return statistics.median(samples) * 1e6

    result = {
        "signature": timed(lambda: _validate.signature(args, out, False)),
        "prepare (full validation)": timed(lambda: _validate.prepare(args, out, stream)),
        "enqueue (all launches)": timed(lambda: engine.enqueue(stream.ptr)),
        "one cublasGemmEx": timed(lambda: engine.gemm1(engine._main)),
        "one kernel launch": timed(lambda: engine._dgelu(stream.ptr)),
        "one event record": timed(lambda: runtime.eventRecord(event.ptr, stream.ptr)),
        "whole plan call": timed(lambda: plan(*args, out=out, stream=stream)),
    }
    plan.close()
    print("\n# Host time breakdown, bf16x3, T=256 (us, median)")
    for k, v in result.items():
        print(f"{k:28s} {v:8.1f}")
    return result


def print_loop_summary(rows):
    """Where we stand against the host-overhead targets of issue 4."""
    def worst(name, key):
        values = [r["results"][name][key] for r in rows if name in r["results"]]
        return max(values) if values else float("nan")

    print("\n# Loop targets (issue 4): worst over workloads")
    for p in cupyffn.PRECISIONS:
        g, e = worst(f"cupyffn-{p}-graph", "host_us"), worst(f"cupyffn-{p}", "host_us")
        print(f"cupyffn-{p}: host us/call with graph {g:.1f} (target <= 15) {'MET' if g <= 15 else 'missed'}; "
              f"without {e:.1f} (target <= 60) {'MET' if e <= 60 else 'missed'}")
    small = [r for r in rows if r["tokens"] == 256]
    for r in small:
        for name in ("cupyffn-bf16x3", "cupyffn-bf16x3-graph"):
            ratio = r["results"][name]["wall_over_gpu"]
            print(f"{r['label']} {name}: wall / GPU span {ratio:.2f} (target <= 1.15) {'MET' if ratio <= 1.15 else 'missed'}")


# ---------------------------------------------------------------------------------------- CPU side
def run_cpu(args):
    print("=" * 78)
    print("NO GPU: running cupyffn's NumPy backend on REDUCED sizes (D=256, H=1024).")
    print("These are CPU numbers for smoke-testing the harness, not cupyffn's GPU performance.")
    print("=" * 78)
    dim, hidden = 256, 1024
    tokens = (64, 256) if args.quick else (64, 256, 1024)
    for T in tokens:
        inputs = W.make_inputs((T,), dim, hidden, seed=T)
        ref64 = W.reference(inputs)
        ref32 = W.reference(inputs, dtype=numpy.float32)
        print(f"\n## T={T} D={dim} H={hidden}")
        for p in cupyffn.PRECISIONS:
            args_ = [inputs[n] for n in W.INPUT_NAMES]
            out = (numpy.full((T, dim), numpy.nan, numpy.float32), numpy.full((hidden, dim), numpy.nan, numpy.float32),
                   numpy.full((dim, hidden), numpy.nan, numpy.float32))
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                cupyffn.gelu_ffn_backward(*args_, precision=p, out=out)
                times.append((time.perf_counter() - t0) * 1e3)
            checks = [W.check(o, r32, r64) for o, r32, r64 in zip(out, ref32, ref64)]
            print(f"cupyffn-{p:8s} {statistics.median(times):9.2f} ms  check "
                  f"{'pass' if all(c.passed for c in checks) else 'FAIL'}  max rel L2 {max(c.rel_l2 for c in checks):.2e}")
    return 0


# ---------------------------------------------------------------------------------------- output
def slug(name):
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def markdown(result):
    """Markdown tables of one bench run (also what README.md includes)."""
    rows = result["workloads"]
    env = result["env"]
    names = list(rows[0]["results"])
    lines = [f"Measured on {env['device']} (driver {env['driver']}, CUDA runtime {env['cuda_runtime']}, "
             f"cuBLAS {env['cublas']}, CuPy {env['cupy']}, torch {env['torch']}) on {result['date']}, "
             f"commit {str(result['git_commit'])[:12]}; `{result['command']}`. Median ms per workload "
             f"(L2 flushed, CUDA events); ✗ marks a failed benchmark check.", ""]
    summary = result["summary"]
    lines.append("| implementation | geomean ms | vs torch-fp32 | all checks | max rel. L2 vs fp64 | mean SOL score |")
    lines.append("|---|---|---|---|---|---|")
    g = summary["geomean_ms"]
    for n in names:
        speed = f"{g['torch-fp32'] / g[n]:.2f}x" if "torch-fp32" in g else "n/a"
        score = summary["mean_sol_score"].get(n)
        lines.append(f"| {n} | {g[n]:.4f} | {speed} | {'pass' if summary['all_passed'][n] else 'FAIL'} | "
                     f"{summary['max_rel_l2'][n]:.1e} | {score:.3f} |" if score is not None else
                     f"| {n} | {g[n]:.4f} | {speed} | {'pass' if summary['all_passed'][n] else 'FAIL'} | "
                     f"{summary['max_rel_l2'][n]:.1e} | n/a |")
    lines.append(f"| H200 SOL | {summary['sol_geomean_ms']:.4f} | | | | |")
    lines.append("")
    lines.append(f"SOL score: 1 at SOL, 0.5 at the baseline ({summary['score_baseline']}) measured in the same run.")
    lines.append("")
    lines.append("| workload | T | SOL | " + " | ".join(names) + " |")
    lines.append("|---|---|---|" + "---|" * len(names))
    for r in rows:
        cells = []
        for n in names:
            res = r["results"][n]
            cells.append(f"{res['median_ms']:.3f}" + ("" if res["passed"] else " ✗"))
        lines.append(f"| {r['label']} | {r['tokens']} | {r['sol_ms']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def precision_table(result):
    """Accuracy and speed per precision (README)."""
    rows = result["workloads"]
    g = result["summary"]["geomean_ms"]
    lines = ["| precision | GEMM operands | contract (rel. L2) | measured max rel. L2 (per output) | "
             "benchmark check | geomean ms |", "|---|---|---|---|---|---|"]
    for p, prec in cupyffn.PRECISIONS.items():
        name = f"cupyffn-{p}"
        if name not in g:
            continue
        worst = {o: max(r["results"][name]["checks"][o]["rel_l2"] for r in rows) for o in W.OUTPUT_NAMES}
        passed = sum(r["results"][name]["passed"] for r in rows)
        lines.append(f"| `{p}` | {prec.summary} | {prec.contract:g} | "
                     + ", ".join(f"{v:.1e}" for v in worst.values())
                     + f" | {passed}/{len(rows)} pass | {g[name]:.4f} |")
    return "\n".join(lines) + "\n"


def loop_markdown(loop):
    names = list(loop["workloads"][0]["results"])
    lines = [f"Steady-state loop ({loop['calls_per_measurement']} calls, no L2 flush), {loop['date']}, "
             f"commit {str(loop['git_commit'])[:12]}: host µs per call / wall µs per call / GPU µs per call.", "",
             "| workload | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in loop["workloads"]:
        cells = [f"{r['results'][n]['host_us']:.0f} / {r['results'][n]['wall_us']:.0f} / {r['results'][n]['gpu_us']:.0f}"
                 for n in names]
        lines.append(f"| {r['label']} (T={r['tokens']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(result, loop):
    RESULTS.mkdir(exist_ok=True)
    device = (result or {}).get("env", {}).get("device") or "gpu"
    if result is not None:
        base = RESULTS / slug(device)
        base.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        base.with_suffix(".md").write_text(markdown(result))
        plot(result, base.with_suffix(".png"))
        print(f"\nwrote {base.with_suffix('.json')}, .md and .png")
    if loop is not None:
        path = RESULTS / (slug(loop.get("device", device)) + "-loop.json")
        path.write_text(json.dumps(loop, indent=1) + "\n")
        print(f"wrote {path}")


def newest_results():
    """The newest full run and loop run in results/ (by their recorded date)."""
    full, loop = None, None
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        if "summary" in data and not data.get("protocol", {}).get("quick"):
            if full is None or data["date"] > full["date"]:
                full = data
        elif "calls_per_measurement" in data:
            if loop is None or data["date"] > loop["date"]:
                loop = data
    return full, loop


def plot(result, path):
    """Latency vs tokens per implementation (with the H200 SOL) and accuracy per precision, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    rows = sorted(result["workloads"], key=lambda r: r["tokens"])
    names = list(rows[0]["results"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1.5, 1]})
    tokens = sorted({r["tokens"] for r in rows})

    def best(name, t):  # workloads with the same T: the median of their medians
        return statistics.median(r["results"][name]["median_ms"] for r in rows if r["tokens"] == t)

    for name in names:
        style = "-o" if name.startswith("cupyffn") else "--s"
        ax1.plot(tokens, [best(name, t) for t in tokens], style, label=name, markersize=4)
    ax1.plot(tokens, [W.sol_ms(t) for t in tokens], "k:", linewidth=2, label="H200 SOL")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("tokens T (D=1536, H=6144)")
    ax1.set_ylabel("ms per backward (median, L2 flushed)")
    ax1.set_title(f"Latency on {result['env']['device']}")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7, ncol=2)
    precisions = [n for n in names if n.startswith("cupyffn")] + [n for n in names if not n.startswith("cupyffn")]
    worst = [max(r["results"][n]["max_rel_l2"] for r in rows) for n in precisions]
    colors = ["tab:blue" if all(r["results"][n]["passed"] for r in rows) else "tab:red" for n in precisions]
    ax2.barh(range(len(precisions)), worst, color=colors)
    for i, n in enumerate(precisions):
        p = n.replace("cupyffn-", "")
        if p in cupyffn.PRECISIONS:
            ax2.plot([cupyffn.PRECISIONS[p].contract] * 2, [i - 0.4, i + 0.4], "k-", linewidth=2)
    ax2.set_yticks(range(len(precisions)))
    ax2.set_yticklabels(precisions, fontsize=8)
    ax2.set_xscale("log")
    ax2.set_xlabel("worst relative L2 error vs float64 (black: contract)")
    ax2.set_title("Accuracy (blue: benchmark check passes on all 16)")
    ax2.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


BEGIN, END = "<!-- results:begin (generated by `python bench.py --readme`; do not edit) -->", "<!-- results:end -->"
PBEGIN, PEND = "<!-- precisions:begin (generated) -->", "<!-- precisions:end -->"
LBEGIN, LEND = "<!-- loop:begin (generated) -->", "<!-- loop:end -->"


def readme_sections():
    full, loop = newest_results()
    sections = {}
    if full is not None:
        sections[(BEGIN, END)] = markdown(full)
        sections[(PBEGIN, PEND)] = precision_table(full)
    if loop is not None:
        sections[(LBEGIN, LEND)] = loop_markdown(loop)
    return sections


def render_readme(text):
    for (begin, end), body in readme_sections().items():
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            _, tail = rest.split(end, 1)
            text = head + begin + "\n" + body + end + tail
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--compile", action="store_true", help="add torch.compile baselines")
    parser.add_argument("--loop", action="store_true", help="steady-state loop mode (host overhead, graphs)")
    parser.add_argument("--loop-only", action="store_true", help="only the loop mode")
    parser.add_argument("--loop-calls", type=int, default=50)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="do not write results/")
    parser.add_argument("--readme", action="store_true", help="regenerate README.md from results/ and exit")
    args = parser.parse_args(argv)
    if args.readme:
        full, _ = newest_results()
        if full is not None:
            plot(full, RESULTS / (slug(full["env"]["device"]) + ".png"))
        README.write_text(render_readme(README.read_text()))
        print(f"README.md regenerated from {RESULTS}")
        return 0
    if os.environ.get("CUPY_TF32", "0") not in ("", "0"):
        print("CUPY_TF32 is set: the plain-fp32 reference would use TF32. Unset it.", file=sys.stderr)
        return 2
    cupy, reason = gpu_or_reason()
    if cupy is None:
        print(f"(no GPU: {reason})")
        return run_cpu(args)
    result = None if args.loop_only else run_gpu(args, cupy)
    loop = run_loop(args, cupy) if (args.loop or args.loop_only) else None
    if loop is not None and result is not None:
        loop["device"] = result["env"]["device"]
    elif loop is not None:
        loop["device"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    if not args.no_write:
        write_results(result, loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
