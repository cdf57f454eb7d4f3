"""The full GPU run: per workload, N check rounds of fresh inputs for every implementation, then the
benchmark's timing protocol over a pool of input sets, then cupyffn's per-stage profile."""

import datetime
import fnmatch
import os
import platform
import statistics
import subprocess
import sys
import time
import zlib

import numpy

import cupyffn
from cupyffn import workloads as W

from . import floor as F
from . import impls as I
from . import protocol as P
from . import report as R
from . import stages as S

QUICK = ("B2xS128", "B1xS1024", "B8xS613", "B4xS2048")
INPUT_SETS = 3


def gpu_or_reason():
    """(cupy, None) when CuPy runs a kernel on a GPU, else (None, the one-line reason cupyffn gives everywhere:
    cupyffn/cuda/device.py, e.g. "no NVIDIA GPU visible (no NVIDIA driver: ...)")."""
    from cupyffn.cuda import device as _device

    reason = _device.gpu_unavailable_reason(run_kernel=True)
    if reason is not None:
        return None, reason
    import cupy

    return cupy, None


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
    from cupyffn.gemm import cublas as _cublas

    handle = _cublas.acquire(0)
    env["cublas"] = handle.version()
    _cublas.release(handle)
    env["torch"] = torch.__version__ if torch else None
    env["torch_cuda"] = torch.version.cuda if torch else None
    try:
        from importlib.metadata import version

        env["cupti_python"] = version("cupti-python")
    except Exception:
        env["cupti_python"] = None
    return env


def timing_summary(measured):
    """The figures of one Timer.measure: median (the workload's figure), mean, min, 20th/80th percentiles."""
    times = measured["times"]
    out = {"median_ms": statistics.median(times), "mean_ms": statistics.mean(times), "min_ms": min(times),
           "p20_ms": float(numpy.percentile(times, 20)), "p80_ms": float(numpy.percentile(times, 80)),
           "iters": len(times), "timing": measured["timing"]}
    if "timing_note" in measured:
        out["timing_note"] = measured["timing_note"]
    return out


def copy_rate(cupy, flush, nbytes=151 * 10 ** 6, reps=20):
    """The device's copy rate in this run: a device-to-device copy of `nbytes` (the fp32 weights read plus their
    gradients written at T = 256, issue 58), L2 flushed before each, CUDA events, median; GB/s counts bytes read
    plus bytes written."""
    src = cupy.random.default_rng(0).random(nbytes // 4, dtype=cupy.float32)  # never zeros
    dst = cupy.empty_like(src)
    stream = cupy.cuda.get_current_stream()
    times = []
    for _ in range(reps):
        flush()
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(stream)
        dst.data.copy_from_device_async(src.data, src.nbytes, stream)
        b.record(stream)
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b))
    if not bool(cupy.array_equal(dst, src)):
        raise RuntimeError("the copy-rate measurement's copy is not equal to its source")
    ms = statistics.median(times)
    return {"bytes": src.nbytes, "ms": ms, "gbps": 2 * src.nbytes / (ms * 1e-3) / 1e9}


def git_commit():
    commit = os.environ.get("CUPYFFN_GIT_COMMIT")
    if commit:
        return commit
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=R.ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "cupyffn", "kernels_cu", "bench.py", "benchmarks"],
                               cwd=R.ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else None
    except Exception:
        return None


def select(available, patterns):
    """The names of `available` matching the comma-separated fnmatch `patterns` (all when None)."""
    if not patterns:
        return list(available)
    chosen = []
    for pat in (p.strip() for p in patterns.split(",") if p.strip()):
        hits = [n for n in available if fnmatch.fnmatchcase(n, pat)]
        if not hits:
            raise SystemExit(f"--impls: {pat!r} matches none of {', '.join(available)} "
                             "(torch-compile-* needs --compile and torch)")
        chosen += [n for n in hits if n not in chosen]
    return [n for n in available if n in chosen]


def _seed(label, what, k):
    return zlib.crc32(f"{label}/{what}/{k}".encode())


def _args2d(inputs):
    return [inputs[n].reshape(-1, inputs[n].shape[-1]) for n in W.INPUT_NAMES]


def run_gpu(args, cupy):
    started = time.perf_counter()
    torch = I.torch_or_none(in_process_compile=args.loop or args.loop_only)
    if args.compile and torch is None:
        print("--compile: torch is not available; compiled baselines skipped")
    factory = I.Implementations(cupy, torch, args.compile and torch is not None)
    names = select(factory.names(), args.impls)
    env = environment(cupy, torch)
    stream = cupy.cuda.Stream(non_blocking=True)
    ctx = I.stream_context(cupy, torch, stream)
    flush = P.L2Flush(cupy)
    timer = P.Timer(cupy, ctx, flush, warmup=args.warmup, iters=args.iters, use_cupti=args.timer == "auto",
                    idle=args.timer == "events-idle")
    chosen = [w for w in W.WORKLOADS if not args.quick or w.label in QUICK]
    env["copy_rate"] = copy_rate(cupy, flush)
    print(f"# cupyffn {cupyffn.__version__} on {env['device']} (driver {env['driver']}, CUDA runtime "
          f"{env['cuda_runtime']}, cuBLAS {env['cublas']}, CuPy {env['cupy']}, torch {env['torch']})")
    print(f"# timing: {timer.method}" + (f" (CUPTI unavailable: {timer.cupti_reason})" if timer.cupti is None else "")
          + f"; {args.warmup} warm-up + {args.iters} timed, {INPUT_SETS} input sets, L2 flush {flush.nbytes >> 20} MiB;"
          f" {args.rounds} check rounds; implementations: {', '.join(names)}")
    rows, compile_s, fallbacks = [], {}, set()
    for w in chosen:
        lead = (w.batch_size, w.seq_len)
        T = w.tokens
        shapes = [(T, W.DIM), (W.HIDDEN_DIM, W.DIM), (W.DIM, W.HIDDEN_DIM)]
        impls = factory.build(names, T, W.DIM, W.HIDDEN_DIM)
        rounds = {n: P.CheckRounds() for n in names}
        first_call = {}
        ref_rel = {}
        poisoned = {n: tuple(cupy.empty(s, dtype=cupy.float32) for s in shapes) for n in names if impls[n].takes_out}
        for r in range(args.rounds):
            inputs = W.make_inputs(lead, W.DIM, W.HIDDEN_DIM, xp=cupy, seed=_seed(w.label, "check", r))
            args2d = _args2d(inputs)
            ref64 = W.reference(inputs, xp=cupy)
            ref32 = W.reference(inputs, xp=cupy, dtype=numpy.float32)
            for o, r32, r64 in zip(W.OUTPUT_NAMES, ref32, ref64):
                ref_rel[o] = max(ref_rel.get(o, 0.0), W.relative_l2(r32, r64, xp=cupy))
            cupy.cuda.runtime.deviceSynchronize()  # made on the legacy stream; the bench stream is not ordered after it
            for n, impl in impls.items():
                out = poisoned.get(n)
                with ctx():
                    for o in out or ():
                        o.fill(numpy.nan)
                    outputs, seconds = I.timed_first_call(impl.bind(args2d, out), cupy)
                if r == 0:
                    first_call[n] = seconds
                rounds[n].add(P.check_outputs(cupy, outputs, ref32, ref64, T))
                del outputs
            del inputs, args2d, ref64, ref32
        pool = [_args2d(W.make_inputs(lead, W.DIM, W.HIDDEN_DIM, xp=cupy, seed=_seed(w.label, "time", k)))
                for k in range(INPUT_SETS)]
        outs = {n: [tuple(cupy.empty(s, dtype=cupy.float32) for s in shapes) for _ in pool]
                for n in names if impls[n].takes_out}
        cupy.cuda.runtime.deviceSynchronize()
        row = {"label": w.label, "batch_size": w.batch_size, "seq_len": w.seq_len, "tokens": T,
               "sol_ms": W.sol_ms(T), "b200_sol_ms": w.b200_sol_ms, "max_atol": w.max_atol, "results": {},
               "fp32_reference_rel_l2": ref_rel}
        for n, impl in impls.items():
            runs = [impl.bind(a, (outs[n][k] if n in outs else None)) for k, a in enumerate(pool)]
            measured = timer.measure(lambda i, runs=runs: runs[i % len(runs)]())
            check = rounds[n].as_dict()
            res = dict(timing_summary(measured), check=check,
                       rel_l2={o: v["max_rel_l2"] for o, v in check["outputs"].items()},
                       max_rel_l2=max(v["max_rel_l2"] for v in check["outputs"].values()),
                       first_call_s=first_call[n])
            if timer.cupti is not None and measured["timing"] != "cupti":
                fallbacks.add(n)
            if impl.plan is not None:
                plan = impl.plan
                res["scratch_bytes"] = plan.scratch_bytes
                res["workspace_bytes"] = plan.workspace_bytes
                res["peak_temp_ratio"] = (plan.scratch_bytes + plan.workspace_bytes) / (4 * T * W.HIDDEN_DIM)
                stages = S.profile(plan, *impl.call_args(pool[0]), out=outs[n][0], stream=stream, reps=5,
                                   before_each=flush)
                planes = plan.precision.planes
                res["stages"] = R.stage_rates(stages, T, W.DIM, W.HIDDEN_DIM, planes)
                res["gemm_sum_ms"] = sum(s["ms"] for s in res["stages"] if s["stage"].startswith("GEMM"))
            row["results"][n] = res
        floor = F.GemmFloor(cupy, T, W.DIM, W.HIDDEN_DIM)  # not a solution: timed, never checked (floor.py)
        runs = [floor.bind(a) for a in pool]
        cupy.cuda.runtime.deviceSynchronize()
        row["floor"] = dict(timing_summary(timer.measure(lambda i, runs=runs: runs[i % len(runs)]())), name=F.NAME)
        floor.close()
        del runs
        for n in factory.compiled:
            if n in first_call and n not in compile_s:
                compile_s[n] = first_call[n]
        rows.append(row)
        R.print_workload(row)
        for impl in impls.values():
            impl.close()
        del impls, pool, outs, poisoned
        cupy.get_default_memory_pool().free_all_blocks()
    summary = R.summarize(rows)
    R.print_summary(summary, compile_s)
    wall_s = time.perf_counter() - started
    print(f"\n# bench wall time {wall_s:.0f} s")
    protocol = {"timing": timer.method, "cupti_unavailable": timer.cupti_reason, "warmup": args.warmup,
                "iters": args.iters, "statistic": "median per workload; mean and geomean over workloads",
                "input_sets": INPUT_SETS, "l2_flush_bytes": flush.nbytes, "rounds": args.rounds,
                "check": {"rule": "benchmark (cupyffn.workloads.check)", "max_rtol": W.RTOL,
                          "required_matched_ratio": W.REQUIRED_MATCH},
                "timing_fallbacks": sorted(fallbacks), "quick": args.quick, "implementations": names}
    return {"format": R.FORMAT, "env": env,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "command": " ".join(["python", "bench.py"] + sys.argv[1:]),
            "protocol": protocol, "compile_s": compile_s, "wall_s": wall_s, "workloads": rows, "summary": summary}
