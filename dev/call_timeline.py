"""The timeline of one backward call: every kernel it launches, on which stream, when it starts and ends (CUPTI).

    PYTHONPATH=. python3 dev/call_timeline.py [--tokens 8192] [--precision tf32] [--out $OUT/call-timeline.json]

The call is the bench's (cupyffn.GeluFFNBackward, the benchmark's inputs, outputs given), run after warm-up calls,
with the L2 flushed before it, as the benchmark times it; beside it the same for the GEMM floor
(benchmarks/floor.py: the four fp16 GEMMs alone). Per kernel: stream, start and end in us from the call's first
kernel, duration; per call: the span (what the benchmark times), the sum of the kernels' durations and the time
at least one kernel runs (busy), so `span - busy` is the GPU idle inside the call and `sum - busy` what overlapped.
Writes the JSON (--out) and a Markdown table beside it (same name, .md), and prints the table. Needs cupti-python.
"""

import argparse
import os
import re
import sys


def _short(name):
    """A kernel's name without its template arguments and parameter list (cuBLAS's nvjet names stay whole)."""
    name = re.sub(r"\(.*$", "", name)
    depth, out = 0, []
    for ch in name:
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">"
    return "".join(out).replace("void ", "")


def busy_us(kernels):
    """Time (us) during which at least one of `kernels` ({"start_us", "end_us"}) runs."""
    total, end = 0.0, None
    for k in sorted(kernels, key=lambda k: k["start_us"]):
        if end is None or k["start_us"] > end:
            total += k["end_us"] - k["start_us"]
            end = k["end_us"]
        elif k["end_us"] > end:
            total += k["end_us"] - end
            end = k["end_us"]
    return total


def record_call(run, flush, cupy):
    """CUPTI's kernel records of one `run()` (launched between two timestamps), the L2 flushed before it."""
    from cupti import cupti

    K = cupti.ActivityKind
    launches, kernels = [], []

    def completed(records):
        for a in records:
            if a.kind in (K.RUNTIME, K.DRIVER):
                launches.append((a.start, a.correlation_id))
            elif a.kind == K.CONCURRENT_KERNEL:
                kernels.append((a.correlation_id, a.start, a.end, str(a.name), getattr(a, "stream_id", None)))

    kinds = [K.RUNTIME, K.DRIVER, K.CONCURRENT_KERNEL]
    for k in kinds:
        cupti.activity_enable(k)
    cupti.activity_register_callbacks(lambda: (8 << 20, 0), completed)
    try:
        flush()
        cupy.cuda.runtime.deviceSynchronize()
        t0 = cupti.get_timestamp()
        run()
        t1 = cupti.get_timestamp()
        cupy.cuda.runtime.deviceSynchronize()
        cupti.activity_flush_all(0)
    finally:
        for k in kinds:
            cupti.activity_disable(k)
        cupti.finalize()
    mine = {c for s, c in launches if t0 <= s <= t1}
    rows = sorted((r for r in kernels if r[0] in mine), key=lambda r: r[1])
    if not rows:
        raise RuntimeError("CUPTI recorded no kernel of the call")
    first = rows[0][1]
    out = [{"kernel": _short(n), "stream": s, "start_us": (a - first) / 1e3, "end_us": (b - first) / 1e3,
            "us": (b - a) / 1e3} for _, a, b, n, s in rows]
    streams = {}
    for k in out:  # streams numbered in order of first use: 0 is the caller's
        k["stream"] = streams.setdefault(k["stream"], len(streams))
    return out


def summary(kernels):
    span = max(k["end_us"] for k in kernels)
    return {"span_us": span, "sum_us": sum(k["us"] for k in kernels), "busy_us": busy_us(kernels),
            "kernels": len(kernels)}


def markdown(result):
    lines = [f"# One call's timeline: {result['precision']}, T = {result['tokens']}, {result['device']}", "",
             f"Commit {result['commit']}; `{result['command']}`. CUPTI kernel records of one call after "
             f"{result['warmup']} warm-up calls, the L2 flushed before it; us from the call's first kernel.", ""]
    for what in ("call", "floor"):
        s = result[what]["summary"]
        lines += [f"## {result[what]['what']}", "",
                  f"span {s['span_us']:.1f} us, kernels' sum {s['sum_us']:.1f}, busy {s['busy_us']:.1f} "
                  f"(idle inside the span {s['span_us'] - s['busy_us']:.1f}, overlapped {s['sum_us'] - s['busy_us']:.1f})",
                  "", "| # | stream | start | end | us | kernel |", "|---|---|---|---|---|---|"]
        for i, k in enumerate(result[what]["kernels"]):
            lines.append(f"| {i} | {k['stream']} | {k['start_us']:.1f} | {k['end_us']:.1f} | {k['us']:.1f} | "
                         f"`{k['kernel'][:90]}` |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--precision", default="tf32")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "call-timeline.json"))
    args = ap.parse_args(argv)

    import cupy

    import cupyffn
    from benchmarks import floor as F
    from benchmarks import gpu as G
    from benchmarks import protocol as P
    from cupyffn import workloads as W
    from dev._json_out import save_json

    T, D, H = args.tokens, W.DIM, W.HIDDEN_DIM
    inputs = W.make_inputs((1, T), D, H, xp=cupy, seed=7)
    args2d = [inputs[n].reshape(-1, inputs[n].shape[-1]) for n in W.INPUT_NAMES]
    out = tuple(cupy.full(s, cupy.nan, dtype=cupy.float32) for s in ((T, D), (H, D), (D, H)))
    flush = P.L2Flush(cupy)
    stream = cupy.cuda.Stream(non_blocking=True)
    plan = cupyffn.GeluFFNBackward(T, D, H, precision=args.precision)
    floor = F.GemmFloor(cupy, T, D, H)
    floor_run = floor.bind(args2d)
    with stream:
        for _ in range(args.warmup):
            plan(*args2d, out=out)
            floor_run()
        stream.synchronize()
        ref = W.reference(inputs, xp=cupy)
        rel = {o: W.relative_l2(a, r, xp=cupy) for o, a, r in zip(W.OUTPUT_NAMES, out, ref)}
        call = record_call(lambda: plan(*args2d, out=out), flush, cupy)
        flo = record_call(floor_run, flush, cupy)
    plan.close()
    floor.close()
    env = G.environment(cupy, None)
    result = {"device": env["device"], "env": env, "commit": G.git_commit(), "tokens": T, "precision": args.precision,
              "warmup": args.warmup, "command": " ".join(["python3", "dev/call_timeline.py"] + sys.argv[1:]),
              "rel_l2_vs_float64": rel,
              "call": {"what": f"cupyffn {args.precision} backward", "kernels": call, "summary": summary(call)},
              "floor": {"what": F.WHAT, "kernels": flo, "summary": summary(flo)}}
    save_json(result, args.out)
    text = markdown(result)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(text + "\n")
    print(text)
    bad = [o for o, v in rel.items() if not v <= 1e-3]
    if bad:
        print(f"FAILED: rel. L2 vs float64 above 1e-3 (or NaN) for {bad}: {rel}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
