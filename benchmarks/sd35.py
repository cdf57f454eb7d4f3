"""``bench.py --suite sd35-bf16``: SD3.5's MLP as it trains, on the 16 official shapes.

The block is diffusers' FeedForward of SD3.5 medium: dim 1536, hidden 6144, biases on both linears, GELU(tanh),
under bf16 autocast with fp32 master weights; the input and the incoming gradient are bf16. Side by side in one
run: cupyffn's layer (``GeluFFN.from_linears``, the 16-bit/bias plan), torch eager (nn.Linear, F.gelu, nn.Linear
under the same autocast) and, with --compile, torch.compile of that eager block and of cupyffn's layer (the same
call for both: dynamic shapes, one compile each). An implementation that raises at a workload is recorded there with
its error, and the suite goes on.
Per workload: the forward alone (a training forward: autocast, parameters requiring grad, the graph then dropped),
the backward alone (autograd, the graph retained, gradients reset to None before each call) and forward +
backward, timed by benchmarks/protocol.py's Timer (CUPTI span; L2 flushed before each call, inputs rotated); every
output's relative L2 error against float64 for each implementation; at every T the floors: the forward's two bf16
GEMMs with their biases alone (torch.addmm) and the backward's four bf16 GEMMs alone (torch.matmul, plain cuBLAS);
the host time per backward call at T = 256 and 8192.
"""

import datetime
import math
import statistics
import sys
import time

from cupyffn import workloads as W

from . import impls as I
from . import protocol as P
from .gpu import INPUT_SETS, QUICK, environment, git_commit
from .report import write_suite

SUITE = "sd35-bf16"
IMPLS = ("cupyffn", "torch-eager", "torch-compile", "cupyffn-compile")
OUTPUTS = ("output", "grad_hidden_states", "grad_weight1", "grad_weight2", "grad_bias1", "grad_bias2")


def _geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _one_line(error, limit=1000):
    text = f"{type(error).__name__}: {' '.join(str(error).split())}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _models(torch, params, compile, device="cuda"):
    import cupyffn.torch as ct

    F = torch.nn.functional
    l1, l2 = torch.nn.Linear(W.DIM, W.HIDDEN_DIM, device=device), torch.nn.Linear(W.HIDDEN_DIM, W.DIM, device=device)
    with torch.no_grad():
        for p, v in zip((l1.weight, l1.bias, l2.weight, l2.bias), params):
            p.copy_(v)

    def eager(x):
        return l2(F.gelu(l1(x), approximate="tanh"))

    models = {"cupyffn": ct.GeluFFN.from_linears(l1, l2), "torch-eager": eager}
    if compile:
        # the backward is timed on a retained graph, which a compiled backward with donated buffers refuses
        import torch._functorch.config

        torch._functorch.config.donated_buffer = False
        models["torch-compile"] = torch.compile(eager, dynamic=True)
        models["cupyffn-compile"] = torch.compile(models["cupyffn"], dynamic=True)  # compiled as torch-compile is
    return models, [l1.weight, l2.weight, l1.bias, l2.bias]


def _forward(torch, model, x):
    """One timed training forward (under autocast; the parameters require grad, so the graph is recorded)."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        return model(x)


def _step(torch, model, params, x, dy, forward):
    """One timed call: forward (under autocast) + backward, or the backward of a retained graph `forward`."""
    for p in params:
        p.grad = None
    if forward is None:
        with torch.autocast(dy.device.type, dtype=torch.bfloat16):
            y = model(x)
        y.backward(dy)
    else:
        forward.backward(dy, retain_graph=True)


def _errors(torch, model, params, x, dy, ref):
    xg = x.detach().clone().requires_grad_()
    for p in params:
        p.grad = None
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        y = model(xg)
    y.backward(dy)
    got = [y.detach(), xg.grad, params[0].grad, params[1].grad, params[2].grad, params[3].grad]  # values, no graph
    return {n: ((g.double() - r).norm() / r.norm()).item() for n, g, r in zip(OUTPUTS, got, ref)}


def _reference(torch, x, dy, params):
    F = torch.nn.functional
    xd = x.double().requires_grad_()
    pd = [p.detach().double().requires_grad_() for p in params]
    y = F.linear(F.gelu(F.linear(xd, pd[0], pd[2]), approximate="tanh"), pd[1], pd[3])
    y.backward(dy.double())
    return [y.detach(), xd.grad] + [p.grad for p in pd]


def _gemm_floor(torch, T, timer):
    """The four GEMMs of the backward alone in bf16 (plain torch.matmul, cuBLAS), fp32 weight-gradient outputs
    excluded: the floor the fused plan is compared with."""
    bf = torch.bfloat16
    dy, x = (torch.randn(T, W.DIM, device="cuda", dtype=bf) for _ in range(2))
    gl, g = (torch.randn(T, W.HIDDEN_DIM, device="cuda", dtype=bf) for _ in range(2))
    w1, w2 = torch.randn(W.HIDDEN_DIM, W.DIM, device="cuda", dtype=bf), torch.randn(W.DIM, W.HIDDEN_DIM,
                                                                                     device="cuda", dtype=bf)

    def run(i):
        dy @ w2, gl @ w1, gl.t() @ x, dy.t() @ g

    return statistics.median(timer.measure(run)["times"])


def _forward_floor(torch, T, timer):
    """The forward's two bf16 GEMMs with their biases alone (torch.addmm, cuBLAS's bias epilogue), without the GELU:
    the floor the fused forward (GELU in GEMM1's epilogue) is compared with."""
    bf = torch.bfloat16
    x, g = torch.randn(T, W.DIM, device="cuda", dtype=bf), torch.randn(T, W.HIDDEN_DIM, device="cuda", dtype=bf)
    w1, w2 = torch.randn(W.HIDDEN_DIM, W.DIM, device="cuda", dtype=bf), torch.randn(W.DIM, W.HIDDEN_DIM,
                                                                                     device="cuda", dtype=bf)
    b1, b2 = torch.randn(W.HIDDEN_DIM, device="cuda", dtype=bf), torch.randn(W.DIM, device="cuda", dtype=bf)

    def run(i):
        torch.addmm(b1, x, w1.t()), torch.addmm(b2, g, w2.t())

    return statistics.median(timer.measure(run)["times"])


def _host_us(torch, model, params, x, dy, calls=50):
    """Median host time (us) of one backward call, the GPU queue drained before each."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = model(x)
    out = []
    for _ in range(calls + 5):
        torch.cuda.synchronize()
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        y.backward(dy, retain_graph=True)
        out.append(1e6 * (time.perf_counter() - t0))
    torch.cuda.synchronize()
    return statistics.median(out[5:])


def run_suite(args, cupy):
    import torch

    stream = cupy.cuda.Stream(non_blocking=True)
    ctx = I.stream_context(cupy, torch, stream)
    flush = P.L2Flush(cupy)
    timer = P.Timer(cupy, ctx, flush, warmup=args.warmup, iters=args.iters, use_cupti=args.timer == "auto",
                    idle=args.timer == "events-idle")
    env = environment(cupy, torch)
    started = time.perf_counter()
    rows = []
    for w in W.WORKLOADS:
        if args.quick and w.label not in QUICK:
            continue
        T, lead = w.tokens, (w.batch_size, w.seq_len)
        g = torch.Generator(device="cuda").manual_seed(T)

        def normal(*shape, scale=1.0, dtype=torch.float32):
            return (scale * torch.randn(*shape, device="cuda", generator=g)).to(dtype)

        params = [normal(W.HIDDEN_DIM, W.DIM, scale=0.02), normal(W.HIDDEN_DIM, scale=0.02),
                  normal(W.DIM, W.HIDDEN_DIM, scale=0.02), normal(W.DIM, scale=0.02)]
        models, leaves = _models(torch, params, args.compile)
        xs = [normal(*lead, W.DIM, dtype=torch.bfloat16) for _ in range(INPUT_SETS)]
        dy = normal(*lead, W.DIM, dtype=torch.bfloat16)
        ref = _reference(torch, xs[0], dy, [leaves[0], leaves[1], leaves[2], leaves[3]])
        row = {"label": w.label, "tokens": T, "results": {}}
        with ctx():
            row["gemm_floor_ms"] = _gemm_floor(torch, T, timer)
            row["forward_floor_ms"] = _forward_floor(torch, T, timer)
        for name, model in models.items():
            graphs = []
            try:
                with ctx():
                    errors = _errors(torch, model, leaves, xs[0], dy, ref)
                    fw = timer.measure(lambda i: _forward(torch, model, xs[i % len(xs)]))
                    fb = timer.measure(lambda i: _step(torch, model, leaves, xs[i % len(xs)], dy, None))
                    for x in xs:
                        xg = x.detach().clone().requires_grad_()
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            graphs.append(model(xg))
                    bw = timer.measure(lambda i: _step(torch, model, leaves, None, dy, graphs[i % len(graphs)]))
                    graphs.clear()
                row["results"][name] = {"forward_ms": statistics.median(fw["times"]),
                                        "backward_ms": statistics.median(bw["times"]),
                                        "fwd_bwd_ms": statistics.median(fb["times"]), "timing": bw["timing"],
                                        "rel_l2": errors}
                if T in (256, 8192):
                    with ctx():
                        row["results"][name]["host_backward_us"] = _host_us(torch, model, leaves, xs[0], dy)
            except Exception as e:  # recorded in the row; the other implementations still run
                graphs.clear()
                row["results"][name] = {"error": _one_line(e)}
        rows.append(row)
        print(f"{w.label:12s} T={T:5d} floor {row['gemm_floor_ms']:.4f} ms  " + "  ".join(
            f"{n} failed: {r['error'][:200]}" if "error" in r else f"{n} fwd {r['forward_ms']:.4f} bwd "
            f"{r['backward_ms']:.4f} fwd+bwd "
            f"{r['fwd_bwd_ms']:.4f}" for n, r in row["results"].items()), flush=True)
        del models
        torch.cuda.empty_cache()
    return {"suite": SUITE, "env": env, "git_commit": git_commit(), "command": " ".join(["python", "bench.py"] +
                                                                                          sys.argv[1:]), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "timing": timer.method, "wall_s": time.perf_counter() - started,
        "workloads": rows, "summary": summarize(rows)}


def summarize(rows):
    """Geomeans and means per implementation (those that ran at every workload), the comparisons, and "errors": each
    implementation's first error and the workloads where it failed."""
    names = [n for n in IMPLS if all(n in r["results"] and "error" not in r["results"][n] for r in rows)]
    out = {"implementations": {}, "errors": {}}
    for r in rows:
        for n, res in r["results"].items():
            if "error" in res:
                out["errors"].setdefault(n, {"error": res["error"], "workloads": []})["workloads"].append(r["label"])
    for n in names:
        bw = [r["results"][n]["backward_ms"] for r in rows]
        fb = [r["results"][n]["fwd_bwd_ms"] for r in rows]
        out["implementations"][n] = {"backward_geomean_ms": _geomean(bw), "backward_mean_ms": statistics.mean(bw),
                                     "fwd_bwd_geomean_ms": _geomean(fb), "fwd_bwd_mean_ms": statistics.mean(fb)}
        if all("forward_ms" in r["results"][n] for r in rows):
            fw = [r["results"][n]["forward_ms"] for r in rows]
            out["implementations"][n].update(forward_geomean_ms=_geomean(fw), forward_mean_ms=statistics.mean(fw))
    per = out["implementations"]
    rivals = [n for n in names if n.startswith("torch-")]
    if "cupyffn" in per and rivals:
        best = min(rivals, key=lambda n: per[n]["backward_geomean_ms"])
        out["backward_speedup_vs_best_torch"] = per[best]["backward_geomean_ms"] / per["cupyffn"]["backward_geomean_ms"]
        out["best_torch"] = best
        out["fwd_bwd_speedup_vs_best_torch"] = (min(per[n]["fwd_bwd_geomean_ms"] for n in rivals)
                                                / per["cupyffn"]["fwd_bwd_geomean_ms"])
    if "cupyffn" in per and "torch-eager" in per:
        worst = max((r["results"]["cupyffn"]["rel_l2"][o] / max(r["results"]["torch-eager"]["rel_l2"][o], 1e-30), o,
                     r["tokens"]) for r in rows for o in OUTPUTS)
        out["worst_error_ratio_vs_torch_eager"] = {"ratio": worst[0], "output": worst[1], "tokens": worst[2]}
    if all("forward_ms" in r["results"].get(n, {}) for r in rows for n in ("cupyffn", "torch-eager")):
        # the forward's two targets: never slower than torch eager's; near its two GEMMs' floor at T >= 2048
        slowest = max((r["results"]["cupyffn"]["forward_ms"] / r["results"]["torch-eager"]["forward_ms"], r["tokens"])
                      for r in rows)
        out["forward_slowest_vs_torch_eager"] = {"ratio": slowest[0], "tokens": slowest[1]}
        large = [(r["results"]["cupyffn"]["forward_ms"] / r["forward_floor_ms"], r["tokens"]) for r in rows
                 if r["tokens"] >= 2048 and "forward_floor_ms" in r]
        if large:
            ratio, tokens = max(large)
            out["forward_over_floor_from_2048"] = {"ratio": ratio, "tokens": tokens}
    big = [r for r in rows if r["tokens"] == 8192]
    if big and "backward_ms" in big[0]["results"].get("cupyffn", {}):
        out["t8192_backward_over_gemm_floor"] = big[0]["results"]["cupyffn"]["backward_ms"] / big[0]["gemm_floor_ms"]
    host = [r for r in rows if "host_backward_us" in r["results"].get("cupyffn", {})]
    out["host_backward_us"] = {r["tokens"]: {n: res["host_backward_us"] for n, res in r["results"].items()
                                              if "host_backward_us" in res} for r in host}
    return out


def markdown(result):
    s, env = result["summary"], result["env"]
    per = s["implementations"]

    def ms(value):  # a table cell: "-" where a run (an older one: no forward) has no such figure
        return "-" if value is None else f"{value:.4f}"

    lines = [f"# {SUITE}: SD3.5's MLP (dim 1536, hidden 6144, biases) under bf16 autocast, {env['device']}", "",
             f"{result['date'][:10]}, commit {str(result['git_commit'])[:7]}, CuPy {env['cupy']}, torch "
             f"{env['torch']}, timing {result['timing']}: `{result['command']}` (benchmarks/sd35.py says what is "
             "timed).", "", "| implementation | forward geomean ms | forward mean ms | backward geomean ms | "
             "backward mean ms | fwd+bwd geomean ms | fwd+bwd mean ms |", "|---|---|---|---|---|---|---|"]
    for n, e in per.items():
        lines.append(f"| {n} | {ms(e.get('forward_geomean_ms'))} | {ms(e.get('forward_mean_ms'))} | "
                     f"{e['backward_geomean_ms']:.4f} | {e['backward_mean_ms']:.4f} | "
                     f"{e['fwd_bwd_geomean_ms']:.4f} | {e['fwd_bwd_mean_ms']:.4f} |")
    if "backward_speedup_vs_best_torch" in s:
        lines += ["", f"Backward: cupyffn {s['backward_speedup_vs_best_torch']:.2f}x faster (geomean) than the faster "
                  f"torch ({s['best_torch']}); forward + backward {s['fwd_bwd_speedup_vs_best_torch']:.2f}x."]
    if "worst_error_ratio_vs_torch_eager" in s:
        wr = s["worst_error_ratio_vs_torch_eager"]
        lines[-1] += (f" Worst error ratio against torch eager's own (rel. L2 vs float64): {wr['ratio']:.2f} "
                      f"({wr['output']}, T = {wr['tokens']}).")
    if "forward_slowest_vs_torch_eager" in s:
        fs = s["forward_slowest_vs_torch_eager"]
        lines.append(f"Forward: cupyffn's over torch eager's at most {fs['ratio']:.2f}x (T = {fs['tokens']})"
                     + (f"; over its two GEMMs with biases alone (torch.addmm) at most "
                        f"{s['forward_over_floor_from_2048']['ratio']:.2f}x from T = 2048 (T = "
                        f"{s['forward_over_floor_from_2048']['tokens']})" if "forward_over_floor_from_2048" in s else "")
                     + ".")
    if "t8192_backward_over_gemm_floor" in s:
        lines.append(f"At T = 8192 the backward takes {s['t8192_backward_over_gemm_floor']:.2f}x the four bf16 "
                     "GEMMs alone (torch.matmul).")
    for T, h in s.get("host_backward_us", {}).items():
        lines.append(f"Host time per backward call at T = {T}: " + ", ".join(f"{n} {v:.0f} us" for n, v in h.items())
                     + ".")
    for n, e in s.get("errors", {}).items():
        lines.append(f"{n} failed at {len(e['workloads'])} workloads ({', '.join(e['workloads'])}): "
                     + e["error"].replace("|", "\\|"))
    lines += ["", "| workload | T | forward floor ms | backward floor ms | " + " | ".join(
        f"{n} fwd ms | {n} bwd ms | {n} fwd+bwd ms" for n in per) + " |", "|---|---|---|---|" + "---|---|---|" * len(per)]
    for r in result["workloads"]:
        lines.append(f"| {r['label']} | {r['tokens']} | {ms(r.get('forward_floor_ms'))} | {ms(r['gemm_floor_ms'])} | "
                     + " | ".join(f"{ms(r['results'][n].get('forward_ms'))} | {ms(r['results'][n]['backward_ms'])} | "
                                  f"{ms(r['results'][n]['fwd_bwd_ms'])}" for n in per) + " |")
    return "\n".join(lines) + "\n"


def write(result, results_dir, slug):
    write_suite(result, SUITE, markdown(result), results_dir, slug)


BEGIN, END = "<!-- sd35:begin (generated by `python bench.py --readme`; do not edit) -->", "<!-- sd35:end -->"


def readme_section(result):
    """The README's summary of the newest sd35-bf16 run."""
    s, per = result["summary"], result["summary"]["implementations"]
    lines = [f"{result['env']['device']}, {result['date'][:10]}, commit {str(result['git_commit'])[:7]}, "
             f"{result['timing']}: backward {s['backward_speedup_vs_best_torch']:.2f}x the faster torch "
             f"(geomean), {s['t8192_backward_over_gemm_floor']:.2f}x the bf16 GEMMs alone at T = 8192.", "",
             "| implementation | backward geomean ms | fwd+bwd geomean ms |", "|---|---|---|"]
    lines += [f"| {n} | {e['backward_geomean_ms']:.4f} | {e['fwd_bwd_geomean_ms']:.4f} |" for n, e in per.items()]
    return "\n".join(lines) + "\n"
