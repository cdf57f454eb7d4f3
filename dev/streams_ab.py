"""Whole backward calls with the side stream on and off, per precision and official token count (GPU machine; a
measurement, not a test; docs/decisions/064-pair-kernel-for-every-gemm.md):

    PYTHONPATH=. python3 dev/streams_ab.py [--precisions tf32 bf16x3] [--tokens 256 8192] [--out $OUT/streams-ab.json]

Per (precision, T) three plans of the official shape on the same three rotated input sets: the default
(TWO_STREAMS_TOKENS), EngineOptions(two_streams=True) and EngineOptions(two_streams=False). Timing as
dev/io_graph_ab.py's GPU span (L2 flushed, a spin kernel ahead of the events), the plans alternated call by call,
median of --reps; the one-stream and two-stream outputs are compared bitwise (the same launches in another order of
streams).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _alternate import alternated_medians, input_sets, output_sets  # noqa: E402
from _json_out import save_json  # noqa: E402

TOKENS = (256, 512, 1024, 2048, 3142, 4096, 4904, 8192)


def measure(cupy, precision, T, reps):
    from cupyffn import workloads as W
    from cupyffn.api.backward_plan import plan_with_options
    from cupyffn.f32.options import EngineOptions

    D, H = W.DIM, W.HIDDEN_DIM
    sets = input_sets(cupy, T)
    options = {"default": EngineOptions(), "two": EngineOptions(two_streams=True),
               "one": EngineOptions(two_streams=False)}
    plans = {name: plan_with_options(T, D, H, o, precision=precision) for name, o in options.items()}
    outs = {name: output_sets(cupy, T, len(sets)) for name in plans}
    s = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()

    def call(name, i):
        plans[name](*sets[i % 3], out=outs[name][i % 3], stream=s)

    for name in plans:
        for i in range(3):
            call(name, i)
    s.synchronize()
    row = {"precision": precision, "tokens": T,
           "default_two_streams": plans["default"].engine.plan.two_streams,
           "bitwise_equal": all(bool(cupy.array_equal(a, b)) for a, b in zip(outs["one"][0], outs["two"][0]))}
    row["ms"] = alternated_medians(cupy, s, {name: (lambda i, name=name: call(name, i)) for name in plans}, reps)
    for plan in plans.values():
        plan.close()
    cupy.cuda.Device().synchronize()
    return row


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--precisions", nargs="+", default=["tf32", "bf16x3"])
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "streams-ab.json"))
    a = p.parse_args(argv)
    import cupy

    rows = []
    for precision in a.precisions:
        for T in a.tokens:
            r = measure(cupy, precision, T, a.reps)
            rows.append(r)
            ms = r["ms"]
            print(f"{precision:8} {T:5}  default {ms['default']:.4f}  two {ms['two']:.4f}  one {ms['one']:.4f}  "
                  f"one/two {ms['one'] / ms['two']:.3f}  bitwise {r['bitwise_equal']}", flush=True)
            save_json({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                       "command": "python3 dev/streams_ab.py " + " ".join(argv or sys.argv[1:]), "rows": rows}, a.out)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
