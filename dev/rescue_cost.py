"""What the tf32 plan's no-op rescue launches cost a whole call at small T (GPU machine; a measurement, not a test;
docs/decisions/054-rescue-launch-cost.md):

    PYTHONPATH=. python3 dev/rescue_cost.py [--tokens 256 512 1024] [--out results/rescue-cost.json]

Two tf32 plans at the official shapes on the same three rotated input sets (cupyffn.workloads.make_inputs). Both are
warmed up as built, so that every scale has settled and every GEMM alpha is written; then one of them is stripped
of its rescue launches (convert's rescue passes, and the decision + rescue after the fused GEMM1) and its schedule
and graphs rebuilt: the ceiling of skipping the rescues on the device when no scale moved. That build is only
right while no scale moves (the same inputs again), so its outputs are compared with the intact plan's (bitwise)
before and after timing. Timing as dev/io_graph_ab.py: the GPU's span (a spin kernel ahead of the events, L2
flushed first) and events from an idle GPU, the two plans alternated over --rounds. Writes the JSON and prints a
table.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _json_out import save_json  # noqa: E402
from io_graph_ab import SPIN, sample  # noqa: E402


def strip_rescues(plan):
    """Remove the rescue launches from `plan`'s engine (measurement build; see the module docstring)."""
    e = plan.engine
    for mode, (convert, fused, _, decide) in list(e.kernels.modes.items()):
        e.kernels.modes[mode] = ({k: (names, first, None) for k, (names, first, _) in convert.items()}, fused, None,
                                 decide)
    e.rebuild_stages()  # its steps and call graphs without them
    e.destroy_graphs()  # and the graphs of its route, captured with them


def measure(cupy, cupyffn, T, reps, rounds):
    from cupyffn import workloads as W

    D, H = W.DIM, W.HIDDEN_DIM
    sets = []
    for k in range(3):
        inputs = {n: cupy.asarray(v) for n, v in W.make_inputs((T,), seed=10 * T + k).items()}
        sets.append([inputs[n] for n in W.INPUT_NAMES])
    s = cupy.cuda.Stream(non_blocking=True)
    flush_buf = cupy.empty(256 * 2 ** 20 // 4, cupy.float32)
    spin = cupy.RawKernel(SPIN, "spin")
    cupy.cuda.Device().synchronize()
    plans = {name: cupyffn.GeluFFNBackward(T, D, H, precision="tf32") for name in ("intact", "no rescues")}
    outs = {name: [[cupy.empty(sh, cupy.float32) for sh in ((T, D), (H, D), (D, H))] for _ in sets]
            for name in plans}
    for _ in range(3):  # warm-up as built: scales settle, alphas written
        for name, plan in plans.items():
            for args, out in zip(sets, outs[name]):
                plan(*args, out=out, stream=s)
    s.synchronize()
    strip_rescues(plans["no rescues"])

    def same():
        for name, plan in plans.items():
            for args, out in zip(sets, outs[name]):
                with s:
                    for o in out:
                        o.fill(cupy.nan)
                plan(*args, out=out, stream=s)
        s.synchronize()
        return all(bool(cupy.array_equal(a, b)) for x, y in zip(outs["intact"], outs["no rescues"])
                   for a, b in zip(x, y))

    row = {"tokens": T, "bitwise equal before timing": same()}
    got = {name: {"queued": [], "idle": []} for name in plans}
    for _ in range(rounds):
        for name, plan in plans.items():
            for i in range(3 + reps):
                args, out = sets[i % 3], outs[name][i % 3]
                for timer in ("queued", "idle"):
                    ms, _ = sample(cupy, s, lambda: plan(*args, out=out, stream=s), lambda: flush_buf.fill(1), spin,
                                   timer == "queued")
                    if i >= 3:
                        got[name][timer].append(ms)
    row["bitwise equal after timing"] = same()
    row["launches"] = {name: [st.stage for st in plan.engine.stage.steps if st.run]
                       for name, plan in plans.items()}
    for name, timers in got.items():
        row[name] = {k: round(statistics.median(v), 4) for k, v in timers.items()}
    for plan in plans.values():
        plan.close()
    cupy.cuda.Device().synchronize()
    return row


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "rescue-cost.json"))
    a = p.parse_args(argv)
    import cupy

    import cupyffn

    rows = [measure(cupy, cupyffn, T, a.reps, a.rounds) for T in a.tokens]
    print("T     intact span ms  no-rescue span ms  ratio   intact idle ms  no-rescue idle ms  bitwise equal")
    for r in rows:
        i, n = r["intact"], r["no rescues"]
        print(f"{r['tokens']:<5} {i['queued']:14.4f} {n['queued']:18.4f} {n['queued'] / i['queued']:7.3f} "
              f"{i['idle']:15.4f} {n['idle']:18.4f}  {r['bitwise equal before timing']}/{r['bitwise equal after timing']}")
    save_json({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
               "command": "python3 dev/rescue_cost.py " + " ".join(argv or sys.argv[1:]), "rows": rows}, a.out)
    for r in rows:
        print(r["tokens"], {name: len(v) for name, v in r["launches"].items()}, "steps with launches")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
