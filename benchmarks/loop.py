"""Loop mode: steady state without L2 flush: host time per call, wall time per call in a loop of
back-to-back calls, GPU span of one call; CUDA-graph plans; a host-time breakdown of one call; and the host-time
table (`host_table`: the functional API on CuPy arrays and on torch tensors, the torch layer's backward and torch
eager's, at T = 256 and 8192; alone with bench.py --host-only)."""

import contextlib
import datetime
import statistics
import sys
import time

import cupyffn
from cupyffn import workloads as W

from .gpu import QUICK, git_commit
from .impls import torch_backward, torch_or_none


def _jax_or_none():
    try:
        from . import layers  # sets XLA's memory fraction before JAX starts

        import jax

        return layers if any(d.platform == "gpu" for d in jax.devices()) else None
    except Exception:
        return None

def run_loop(args, cupy):
    """Steady state, no L2 flush: host time per call, wall time per call, GPU span of one call; then the host-time
    table. With args.host_only (bench.py --host-only) the host-time table only."""
    torch = torch_or_none(in_process_compile=True)
    stream = cupy.cuda.Stream(non_blocking=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "command": " ".join(["python", "bench.py"] + sys.argv[1:])}
    if getattr(args, "host_only", False):
        return dict(meta, host_only=True, host_per_call=host_table(args, cupy, stream))
    chosen = [w for w in W.WORKLOADS if not args.quick or w.label in QUICK]
    n = args.loop_calls
    rows = []
    compiled = None
    layers = _jax_or_none()
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
            from .layers import layer_impls  # cupyffn through the torch layer (torch.ops.cupyffn.backward)

            impls.update(layer_impls(args2d, compile=args.compile))
        syncs = {}  # implementations that are not ordered on our stream: name -> wait for a result
        if layers is not None:  # cupyffn through jax.jit (buffer callback on XLA's own stream)
            run, syncs["cupyffn-jax-jit"] = layers.jax_impl(args2d)
            impls["cupyffn-jax-jit"] = (run, None)
        row = {"label": w.label, "tokens": w.tokens, "results": {}}
        for name, (run, plan) in impls.items():
            if name in syncs:
                row["results"][name] = res = _loop_other_stream(run, syncs[name], n)
                print(f"{w.label:12s} {name:26s} {res['host_us']:12.1f} {res['wall_us']:12.1f} {'n/a':>12s}")
                continue
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
    return dict(meta, host_breakdown_us=breakdown, host_per_call=host_table(args, cupy, stream),
                calls_per_measurement=n, workloads=rows)


HOST_TOKENS = (256, 8192)  # the official workloads the host-time table runs
HOST_CALLS = 200  # calls per row (median), unless --loop-calls is given
HOST_PRECISION = "tf32"


def host_calls(args):
    given = getattr(args, "given", None)
    return args.loop_calls if given is not None and "loop_calls" in given else HOST_CALLS


def host_table(args, cupy, stream):
    """Host microseconds per call (median, the queue drained before each call) of benchmarks.layers.HOST_ROWS on
    every official workload with T in HOST_TOKENS, and the ratios of HOST_RATIOS; printed and returned."""
    from .layers import HOST_RATIOS, HOST_ROWS, _host_us, host_impls

    torch = torch_or_none(in_process_compile=True)
    calls = host_calls(args)
    chosen = [w for w in W.WORKLOADS if w.tokens in HOST_TOKENS]

    def sync(result):
        cupy.cuda.Device().synchronize()  # every stream: a row may run on torch's other stream

    table = []
    for w in chosen:
        inputs = W.make_inputs((w.batch_size, w.seq_len), xp=cupy, seed=w.tokens)
        args2d = [inputs[k].reshape(-1, inputs[k].shape[-1]) for k in W.INPUT_NAMES]
        cupy.cuda.Device().synchronize()
        tctx = torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)) if torch is not None else None
        results = {}
        with stream, (tctx or contextlib.nullcontext()):
            impls = host_impls(args2d, stream, HOST_PRECISION)
            for name, (run, other) in impls.items():
                with (torch.cuda.stream(other) if other is not None else contextlib.nullcontext()):
                    results[name] = _host_us(run, sync, calls)
        ratios = {f"{a} / {b}": results[a] / results[b] for a, b, _ in HOST_RATIOS if a in results and b in results}
        table.append({"label": w.label, "tokens": w.tokens, "host_us": results, "ratios": ratios})
        del impls, inputs, args2d
        cupy.cuda.Device().synchronize()
        cupy.get_default_memory_pool().free_all_blocks()
    result = {"precision": HOST_PRECISION, "calls": calls,
              "method": "median host time to issue one call, the device synchronized before each",
              "rows": dict(HOST_ROWS), "targets": {f"{a} / {b}": t for a, b, t in HOST_RATIOS}, "workloads": table}
    print_host_table(result)
    return result


def print_host_table(result):
    table = result["workloads"]
    names = [n for n in result["rows"] if any(n in r["host_us"] for r in table)]
    print(f"\n# Host us per call ({result['precision']}; {result['method']}; median of {result['calls']})")
    print(f"{'':34s}" + "".join(f"{r['label'] + ' T=' + str(r['tokens']):>18s}" for r in table))
    for n in names:
        print(f"{n:34s}" + "".join(f"{r['host_us'][n]:18.1f}" if n in r["host_us"] else f"{'':18s}" for r in table))
    for key, target in result["targets"].items():
        values = [r["ratios"][key] for r in table if key in r["ratios"]]
        if values:
            print(f"{key}: worst {max(values):.2f} (target <= {target}) {'MET' if max(values) <= target else 'missed'}")


def _loop_other_stream(run, sync, n):
    """Host and wall time per call of an implementation that runs on its own stream (JAX: XLA's); its
    GPU span cannot be read with events on ours, so it is not reported."""
    for _ in range(5):
        sync(run())
    issue = []
    for _ in range(50):  # host time to issue one call, with its queue drained first
        a = time.perf_counter()
        result = run()
        issue.append(time.perf_counter() - a)
        sync(result)
    t0 = time.perf_counter()
    for _ in range(n):
        result = run()
    sync(result)
    wall = (time.perf_counter() - t0) / n
    return {"host_us": statistics.median(issue) * 1e6, "wall_us": wall * 1e6, "gpu_us": None, "wall_over_gpu": None}


def host_breakdown(cupy, stream, tokens=256):
    """Host microseconds of the pieces of one bf16x3 call at T=256 (median of many, queue drained)."""
    from cupy_backends.cuda.api import runtime

    from cupyffn.api import validate as _validate

    inputs = W.make_inputs((tokens,), xp=cupy, seed=1)
    args = [inputs[k] for k in W.INPUT_NAMES]
    out = (cupy.empty((tokens, W.DIM), cupy.float32), cupy.empty((W.HIDDEN_DIM, W.DIM), cupy.float32),
           cupy.empty((W.DIM, W.HIDDEN_DIM), cupy.float32))
    plan = cupyffn.GeluFFNBackward(tokens, W.DIM, W.HIDDEN_DIM)
    plan(*args, out=out, stream=stream)
    engine = plan.engine  # a diagnostic of the host cost of the engine's pieces: it needs them by name
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
        "signature": timed(lambda: _validate.signature(args, out)),
        "validate (full validation)": timed(lambda: _validate.validate(_validate.Request("backward", "bf16x3"), args,
                                                                       out, stream)),
        "enqueue (all launches)": timed(lambda: engine.enqueue(stream.ptr)),
        "one cublasGemmEx": timed(lambda: engine.gemms.gemm1(engine.resources.main)),
        "one kernel launch": timed(lambda: engine.kernels.dgelu(stream.ptr)),
        "one event record": timed(lambda: runtime.eventRecord(event.ptr, stream.ptr)),
        "whole plan call": timed(lambda: plan(*args, out=out, stream=stream)),
    }
    plan.close()
    print("\n# Host time breakdown, bf16x3, T=256 (us, median)")
    for k, v in result.items():
        print(f"{k:28s} {v:8.1f}")
    return result


def print_loop_summary(rows):
    """Where we stand against the host-overhead targets."""
    def worst(name, key):
        values = [r["results"][name][key] for r in rows if name in r["results"]]
        return max(values) if values else float("nan")

    print("\n# Loop targets: worst over workloads")
    for p in cupyffn.PRECISIONS:
        g, e = worst(f"cupyffn-{p}-graph", "host_us"), worst(f"cupyffn-{p}", "host_us")
        print(f"cupyffn-{p}: host us/call with graph {g:.1f} (target <= 15) {'MET' if g <= 15 else 'missed'}; "
              f"without {e:.1f} (target <= 60) {'MET' if e <= 60 else 'missed'}")
    # within 1.3x of the CuPy functional path (docs/decisions/022-torch-layer-eager-path.md)
    for name in ("cupyffn-torch-layer", "cupyffn-torch-op"):
        ratios = [r["results"][name]["host_us"] / r["results"]["cupyffn-bf16x3-functional"]["host_us"]
                  for r in rows if name in r["results"]]
        if ratios:
            print(f"{name}: host time / cupyffn-bf16x3-functional, worst {max(ratios):.2f}, median "
                  f"{statistics.median(ratios):.2f} (target <= 1.3) {'MET' if max(ratios) <= 1.3 else 'missed'}")
    small = [r for r in rows if r["tokens"] == 256]
    for r in small:
        for name in ("cupyffn-bf16x3", "cupyffn-bf16x3-graph"):
            ratio = r["results"][name]["wall_over_gpu"]
            print(f"{r['label']} {name}: wall / GPU span {ratio:.2f} (target <= 1.15) {'MET' if ratio <= 1.15 else 'missed'}")
