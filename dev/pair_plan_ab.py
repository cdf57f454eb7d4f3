"""Whole fp16+fp8 backward calls with the pair's GEMMs placed differently, per official token count (GPU machine; a
measurement, not a test; docs/decisions/064-pair-kernel-for-every-gemm.md):

    PYTHONPATH=. python3 dev/pair_plan_ab.py [--tokens 256 1024 8192] [--out $OUT/pair-plan-ab.json]

Variants, each a plan of the official shape (D = 1536, H = 6144) on the same three rotated input sets:
  default        the fp16+fp8 plan as built (FORM_TABLE, SM90_PAIR_TOKENS, CUBLAS_PAIR_TOKENS, TWO_STREAMS_TOKENS)
  before         the plan before docs/decisions/064: bf16x3 below T = 2048, the pair from there with GEMM1 alone as
                 the sm90 kernel, two streams at every T
  two-streams    default with EngineOptions(two_streams=True)
  one-stream     default with EngineOptions(two_streams=False)
  sm90-all       EngineOptions(sm90_pair=True): every pair GEMM as the sm90 pair kernel
  tf32           the tf32 plan, for the ratio the issue's target names
"before" is made by swapping the registry's fp16+fp8 Precision and cupyffn/f32/plan.py's SM90_PAIR_TOKENS around each
build and call of that variant (a measurement build, never the product). Timing as dev/io_graph_ab.py's GPU span
(L2 flushed, a spin kernel ahead of the events), the variants alternated call by call, median of --reps. Accuracy:
each variant's relative L2 error against the float64 reference (computed on the GPU) on the first input set,
outputs NaN-filled before the call.
"""

import argparse
import contextlib
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _alternate import alternated_medians, input_sets, output_sets  # noqa: E402
from _json_out import save_json  # noqa: E402

TOKENS = (256, 512, 1024, 2048, 3142, 4096, 4904, 8192)


BEFORE = {"form_start": 2048, "sm90": {"gemm1": ((0, 2 ** 31 - 1),)}}


@contextlib.contextmanager
def tables(change):
    """While active: the fp16+fp8 form table's pair from change["form_start"] on, and SM90_PAIR_TOKENS updated with
    change["sm90"] (GEMMs it does not name: never)."""
    from cupyffn.core import precision as P
    from cupyffn.f32 import plan as engine_plan

    if not change:
        yield
        return
    saved, saved_tokens = P.PRECISIONS["fp16+fp8"], engine_plan.SM90_PAIR_TOKENS
    start = change.get("form_start")
    if start is not None:
        steps = tuple((g, ((0, "bf16x3"), (start, "f16+e4m3"))) for g in P.GEMMS)
        P.PRECISIONS["fp16+fp8"] = dataclasses.replace(saved, steps=steps)
    if "sm90" in change:
        engine_plan.SM90_PAIR_TOKENS = {g: change["sm90"].get(g, ()) for g in P.GEMMS}
    try:
        yield
    finally:
        P.PRECISIONS["fp16+fp8"], engine_plan.SM90_PAIR_TOKENS = saved, saved_tokens


def rel_l2(cupy, got, want):
    return float(cupy.linalg.norm((got.astype(cupy.float64) - want).ravel()) / cupy.linalg.norm(want.ravel()))


def measure(cupy, T, reps):
    from cupyffn import workloads as W
    from cupyffn.api.backward_plan import plan_with_options
    from cupyffn.f32.options import EngineOptions

    D, H = W.DIM, W.HIDDEN_DIM
    sets = input_sets(cupy, T)
    variants = {"default": (EngineOptions(), "fp16+fp8", None),
                "before": (EngineOptions(two_streams=True), "fp16+fp8", BEFORE),
                "two-streams": (EngineOptions(two_streams=True), "fp16+fp8", None),
                "one-stream": (EngineOptions(two_streams=False), "fp16+fp8", None),
                "sm90-all": (EngineOptions(sm90_pair=True), "fp16+fp8", None),
                "tf32": (EngineOptions(), "tf32", None)}
    s = cupy.cuda.Stream(non_blocking=True)
    plans, outs = {}, {}
    for name, (options, precision, change) in variants.items():
        with tables(change):
            plans[name] = plan_with_options(T, D, H, options, precision=precision)
        outs[name] = output_sets(cupy, T, len(sets))
    cupy.cuda.Device().synchronize()

    def call(name, i):
        with tables(variants[name][2]):
            plans[name](*sets[i % 3], out=outs[name][i % 3], stream=s)

    row = {"tokens": T}
    want = W.reference(dict(zip(W.INPUT_NAMES, sets[0])), xp=cupy)
    for name in variants:
        with s:
            for o in outs[name][0]:
                o.fill(cupy.nan)
        call(name, 0)
        s.synchronize()
        row.setdefault("rel_l2", {})[name] = max(rel_l2(cupy, o, w) for o, w in zip(outs[name][0], want))
        row.setdefault("forms", {})[name] = plans[name].gemm_forms
        row.setdefault("sm90", {})[name] = sorted(plans[name].engine.plan.sm90_pair)
    row["ms"] = alternated_medians(cupy, s, {name: (lambda i, name=name: call(name, i)) for name in variants}, reps)
    for plan in plans.values():
        plan.close()
    cupy.cuda.Device().synchronize()
    return row


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "pair-plan-ab.json"))
    a = p.parse_args(argv)
    import cupy

    rows = []
    for T in a.tokens:
        rows.append(measure(cupy, T, a.reps))
        r = rows[-1]
        print(T, " ".join(f"{k} {v:.4f}" for k, v in r["ms"].items()),
              "| rel_l2", " ".join(f"{k} {v:.1e}" for k, v in r["rel_l2"].items()), flush=True)
        save_json({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                   "command": "python3 dev/pair_plan_ab.py " + " ".join(argv or sys.argv[1:]), "rows": rows}, a.out)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
