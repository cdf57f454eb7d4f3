"""Accuracy against the token count: every precision's relative L2 error against float64 at large T, with the
K-chunked GEMMs (the plans' default, cupyffn/gemm/ksplit.py) and without (one accumulator over all of K), and what the
chunks cost in time. Writes results/accuracy-vs-tokens-<gpu>.json and .md (docs/decisions/001-k-chunks.md).

    python -m benchmarks.accuracy                     # T = 8192, 32768, 131072, 352000 (needs ~80 GB of GPU memory)
    python -m benchmarks.accuracy --tokens 8192,32768 --json /tmp/acc.json

The errors are measured on blocks, to keep the float64 reference cheap at T = 352,000: 96 random columns of
grad_weight2, 96 random rows of grad_weight1 and 256 random tokens of grad_hidden_states.
The inputs are the benchmark's (grad_output, hidden_states ~ N(0, 1), weights 0.02 N(0, 1), saved activations
from the forward in float64), made block by block on the GPU (`large_inputs`), also used by the GPU tests.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
BLOCK = 16384  # rows per block of the float64 work


def large_inputs(tokens, dim, hidden, seed=0):
    """The benchmark's seven inputs (2-D float32 CuPy arrays, workloads.INPUT_NAMES order) at any T, the forward's
    saved tensors evaluated in float64 a block of rows at a time (workloads.make_inputs's formulas)."""
    import cupy

    rng = cupy.random.default_rng(seed)
    f32, f64 = cupy.float32, cupy.float64
    dy = rng.standard_normal((tokens, dim), dtype=f32)
    x = rng.standard_normal((tokens, dim), dtype=f32)
    w1 = (0.02 * rng.standard_normal((hidden, dim), dtype=f64)).astype(f32)
    w2 = (0.02 * rng.standard_normal((dim, hidden), dtype=f64)).astype(f32)
    z, t, g = (cupy.empty((tokens, hidden), f32) for _ in range(3))
    w1t = w1.T.astype(f64)
    for r0 in range(0, tokens, BLOCK):
        r1 = min(tokens, r0 + BLOCK)
        z[r0:r1] = x[r0:r1].astype(f64) @ w1t
        zz = z[r0:r1].astype(f64)
        t[r0:r1] = cupy.tanh(SQRT_2_OVER_PI * (zz + 0.044715 * zz ** 3))
        g[r0:r1] = 0.5 * zz * (1.0 + t[r0:r1].astype(f64))
        del zz
    return [dy, x, w1, w2, z, t, g]


def _dgelu64(z, t):
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 0.134145 * z * z)


def sample(tokens, hidden, seed=1, count=96, token_count=256):
    """(columns of grad_weight2, rows of grad_weight1, tokens of grad_hidden_states) whose errors are measured."""
    rng = numpy.random.default_rng(seed)
    pick = lambda n, k: numpy.sort(rng.choice(n, size=min(n, k), replace=False))  # noqa: E731
    return pick(hidden, count), pick(hidden, count), pick(tokens, token_count)


def block_reference(inputs, picked):
    """float64 (grad_hidden_states[tokens], grad_weight1[rows], grad_weight2[:, cols]) of the backward formula on
    the given tensors (tanh_inner and gelu_out as given)."""
    import cupy

    cols, rows, toks = (cupy.asarray(p) for p in picked)
    dy, x, w1, w2, z, t, g = inputs
    f64 = cupy.float64
    tokens, dim = dy.shape
    gw2 = cupy.zeros((dim, cols.size), f64)
    gw1 = cupy.zeros((rows.size, dim), f64)
    w2r = w2[:, rows].astype(f64)
    for r0 in range(0, tokens, BLOCK):
        r1 = min(tokens, r0 + BLOCK)
        dyb = dy[r0:r1].astype(f64)
        gw2 += dyb.T @ g[r0:r1][:, cols].astype(f64)
        gl1 = (dyb @ w2r) * _dgelu64(z[r0:r1][:, rows].astype(f64), t[r0:r1][:, rows].astype(f64))
        gw1 += gl1.T @ x[r0:r1].astype(f64)
    gl1 = (dy[toks].astype(f64) @ w2.astype(f64)) * _dgelu64(z[toks].astype(f64), t[toks].astype(f64))
    gh = gl1 @ w1.astype(f64)
    return gh, gw1, gw2


def block_errors(grads, reference, picked):
    """{output: relative L2 error on the measured block} of grads (grad_hidden, grad_weight1, grad_weight2)."""
    import cupy

    from cupyffn import workloads as W

    cols, rows, toks = (cupy.asarray(p) for p in picked)
    blocks = (grads[0][toks], grads[1][rows], grads[2][:, cols])
    return {name: W.relative_l2(b, r, xp=cupy) for name, b, r in zip(W.OUTPUT_NAMES, blocks, reference)}


def _time_calls(plan, args, out, calls=3):
    """Median ms of `calls` calls after one warm-up (the device drained after it), CUDA events around each call
    on the current stream, each waited for before the next, no L2 flush (benchmarks/timing.py)."""
    import cupy

    from benchmarks import timing

    plan(*args, out=out)
    cupy.cuda.Device().synchronize()
    return timing.flushed_median_ms(cupy, cupy.cuda.get_current_stream(), lambda: plan(*args, out=out), None,
                                    calls, warmup=0)


def measure(tokens_list, precisions, dim, hidden, calls=3):
    import cupy

    import cupyffn
    from cupyffn.api.backward_plan import plan_with_options
    from cupyffn.f32.options import EngineOptions
    from cupyffn.gemm import ksplit as _ksplit

    rows = []
    for tokens in tokens_list:
        inputs = large_inputs(tokens, dim, hidden, seed=tokens)
        picked = sample(tokens, hidden, seed=tokens + 1)
        ref = block_reference(inputs, picked)
        for precision in precisions:
            row = {"tokens": tokens, "precision": precision, "contract": cupyffn.PRECISIONS[precision].contract}
            for label, max_k in (("chunked", _ksplit.MAX_K), ("one_accumulator", None)):
                plan = plan_with_options(tokens, dim, hidden, EngineOptions(max_k=max_k), precision=precision)
                out = (cupy.full((tokens, dim), numpy.nan, cupy.float32),
                       cupy.full((hidden, dim), numpy.nan, cupy.float32),
                       cupy.full((dim, hidden), numpy.nan, cupy.float32))
                grads = plan(*inputs, out=out)
                cupy.cuda.Device().synchronize()
                errors = block_errors(grads, ref, picked)
                finite = all(bool(cupy.isfinite(g).all()) for g in grads)
                ms = _time_calls(plan, inputs, out, calls)
                row[label] = {"rel_l2": errors, "max_rel_l2": max(errors.values()), "finite": finite, "ms": ms,
                              "k_chunks": plan.engine.plan.k_chunked, "gemm_forms": plan.gemm_forms}
                plan.close()
                del out, grads
                cupy.get_default_memory_pool().free_all_blocks()
                print(f"T={tokens} {precision} {label}: max rel L2 {row[label]['max_rel_l2']:.3g} "
                      f"({errors}), {ms:.3f} ms, chunks {row[label]['k_chunks']}", flush=True)
            if "one_accumulator" in row:
                row["chunk_cost"] = row["chunked"]["ms"] / row["one_accumulator"]["ms"]
            rows.append(row)
        del inputs, ref
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def markdown(result):
    env = result["env"]
    lines = [f"# Accuracy against the token count ({env['device']})", "",
             f"Measured on {env['device']} (driver {env.get('driver')}, cuBLAS {env.get('cublas')}, CuPy "
             f"{env['cupy']}) on {result['date']}, commit {result['git_commit']}; `{result['command']}`. "
             f"D = {result['dim']}, H = {result['hidden']}; the benchmark's inputs. Relative L2 error against float64 "
             "on blocks (96 columns of grad_weight2, 96 rows of grad_weight1, 256 tokens of grad_hidden_states), the "
             "worst of the three; time: median of 3 calls (CUDA events). \"chunked\": the plans as they ship (K-chunks "
             f"of at most {result['max_k']}, cupyffn/gemm/ksplit.py); \"one accumulator\": the same plan summing all of K "
             "in one accumulator (`EngineOptions(max_k=None)`).", "",
             "| T | precision | contract | chunked rel. L2 | one accumulator rel. L2 | chunked ms | one accumulator ms | "
             "cost of the chunks |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        cells = []
        for key in ("chunked", "one_accumulator"):
            m = r.get(key)
            cells.append((f"{m['max_rel_l2']:.2e}", f"{m['ms']:.3f}") if m else ("not measured", ""))
        cost = f"{r['chunk_cost']:.3f}x" if "chunk_cost" in r else ""
        lines.append(f"| {r['tokens']} | {r['precision']} | {r['contract']:.0e} | {cells[0][0]} | {cells[1][0]} | "
                     f"{cells[0][1]} | {cells[1][1]} | {cost} |")
    notes = [f"- {r['tokens']} {r['precision']}: {r['note']}" for r in result["rows"] if r.get("note")]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="8192,32768,131072,352000")
    parser.add_argument("--precisions", default="ieee,fp16+fp8,bf16x3,tf32,bf16")
    parser.add_argument("--json", default=None, metavar="PATH", help="write here instead of results/")
    args = parser.parse_args(argv)
    from benchmarks import gpu
    from benchmarks import report as R
    from cupyffn.gemm import ksplit as _ksplit
    from cupyffn import workloads as W

    cupy, reason = gpu.gpu_or_reason()
    if cupy is None:
        print(f"benchmarks.accuracy needs an NVIDIA GPU (none usable: {reason})", file=sys.stderr)
        return 2
    tokens = [int(t) for t in args.tokens.split(",")]
    started = time.time()
    rows = measure(tokens, args.precisions.split(","), W.DIM, W.HIDDEN_DIM)
    result = {"env": gpu.environment(cupy, None), "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
              "git_commit": gpu.git_commit(), "command": "python -m benchmarks.accuracy " + " ".join(argv or sys.argv[1:]),
              "dim": W.DIM, "hidden": W.HIDDEN_DIM, "max_k": _ksplit.MAX_K, "wall_s": time.time() - started,
              "rows": rows}
    base = Path(args.json) if args.json else R.RESULTS / f"accuracy-vs-tokens-{R.slug(result['env']['device'])}.json"
    base.write_text(json.dumps(result, indent=1) + "\n")
    base.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {base} and {base.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
