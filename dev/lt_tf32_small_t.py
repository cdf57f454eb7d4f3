"""The float32 block on cuBLASLt's TF32 GEMMs with no conversion at all against the tf32 engine plan, in one process
(GPU machine; a measurement, not a test; docs/decisions/053-tf32-register-weight-probe.md):

    PYTHONPATH=. python3 dev/lt_tf32_small_t.py [--tokens 256 512 1024] [--out results/lt-tf32-small-t.json]

The bias route of decision 049 (cupyffn/_lt_ffn.py LtBackward) built for float32 activations, precision "tf32" and
no biases: GEMM1 with cuBLASLt's DGELU epilogue, GEMM3 and GEMM4 after it on the caller's stream, GEMM2 on a side
stream, every operand fp32 as given (TF32 tensor cores), no conversion, no scale, no rescue. Against
GeluFFNBackward(precision="tf32") on the same inputs (the benchmark's, cupyffn.workloads.make_inputs), alternated
over --rounds. Per sample the L2 is flushed and a ~0.3 ms spin kernel holds the stream while the host enqueues, so
the events time the GPU's span (dev/io_graph_ab.py's `sample`). Also each route's outputs against float64 and the
benchmark's own check. Writes the JSON and prints a table.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _json_out import save_json  # noqa: E402
from io_graph_ab import SPIN, sample  # noqa: E402


def measure(cupy, cupyffn, T, reps, rounds):
    from cupyffn import workloads as W
    from cupyffn.lt.engine import LtBackward, LtKey

    D, H = W.DIM, W.HIDDEN_DIM
    host = W.make_inputs((T,), seed=T)
    inputs = {k: cupy.asarray(v) for k, v in host.items()}
    ref64 = W.reference(inputs, xp=cupy)
    ref32 = W.reference(inputs, xp=cupy, dtype=cupy.float32)
    s = cupy.cuda.Stream(non_blocking=True)
    flush_buf = cupy.empty(256 * 2 ** 20 // 4, cupy.float32)
    spin = cupy.RawKernel(SPIN, "spin")
    cupy.cuda.Device().synchronize()
    args = [inputs[n] for n in W.INPUT_NAMES]
    plan = cupyffn.GeluFFNBackward(T, D, H, precision="tf32")
    lt = LtBackward(LtKey(0, T, D, H, "float32", "float32", "float32", False, False, precision="tf32"))
    outs = {name: [cupy.empty(sh, cupy.float32) for sh in ((T, D), (H, D), (D, H))] for name in ("engine", "lt")}
    ptrs = {n: inputs[n].data.ptr for n in ("grad_output", "hidden_states", "weight1", "weight2", "linear1_out",
                                             "gelu_out")}
    lt_out = dict(zip(("grad_hidden_states", "grad_weight1", "grad_weight2"), (o.data.ptr for o in outs["lt"])))

    def run_lt():
        with lt.lock:
            lt.run(ptrs, lt_out, s.ptr, False, False)

    runs = {"engine": lambda: plan(*args, out=outs["engine"], stream=s), "lt": run_lt}
    row = {"tokens": T, "check": {}}
    for name, run in runs.items():  # accuracy: outputs NaN-filled first
        with s:
            for o in outs[name]:
                o.fill(cupy.nan)
        run()
        s.synchronize()
        for label, got, r64, r32 in zip(W.OUTPUT_NAMES, outs[name], ref64, ref32):
            c = W.check(got, r32, r64, xp=cupy, tokens=T)
            row["check"][f"{name} {label}"] = {"passed": c.passed, "rel_l2": c.rel_l2,
                                                "err_over_atol": c.err_over_atol}
    samples = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            for i in range(3 + reps):
                ms, _ = sample(cupy, s, run, lambda: flush_buf.fill(1), spin, True)
                if i >= 3:
                    samples[name].append(ms)
    for name, values in samples.items():
        row[name + " ms"] = round(statistics.median(values), 4)
    plan.close()
    lt.close()
    return row


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "lt-tf32-small-t.json"))
    a = p.parse_args(argv)
    import cupy

    import cupyffn

    rows = [measure(cupy, cupyffn, T, a.reps, a.rounds) for T in a.tokens]
    print("T     engine tf32 ms   lt tf32 ms   worst err/atol engine / lt   worst rel L2 engine / lt")
    for r in rows:
        worst = {n: max(v["err_over_atol"] for k, v in r["check"].items() if k.startswith(n)) for n in ("engine", "lt")}
        rel = {n: max(v["rel_l2"] for k, v in r["check"].items() if k.startswith(n)) for n in ("engine", "lt")}
        ok = all(v["passed"] for v in r["check"].values())
        print(f"{r['tokens']:<5} {r['engine ms']:14.4f} {r['lt ms']:12.4f}   {worst['engine']:.3f} / {worst['lt']:.3f}"
              f"   {rel['engine']:.2e} / {rel['lt']:.2e}   {'all pass' if ok else 'FAIL'}")
    save_json({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
               "command": "python3 dev/lt_tf32_small_t.py " + " ".join(argv or sys.argv[1:]), "rows": rows}, a.out)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
