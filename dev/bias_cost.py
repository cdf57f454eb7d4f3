"""What the bias gradients and biases cost in the split float32 precisions (GPU machine; a measurement, not a test):

    PYTHONPATH=. python3 dev/bias_cost.py [--tokens 256 1024 2048 4096 8192] [--out results/bias-cost.json]

Per precision ("bf16x3", "fp16+fp8") and T, at SD3.5's dim 1536 / hidden 6144: the backward plan with and without
need_bias_grads (alternated over --rounds, the median round), the forward with and without both biases (CUDA events,
L2 flushed before each sample, the median: benchmarks/timing.py), and both plans' stages serialized
(benchmarks/stages.py profile: "grad_bias2", "grad_bias1", "dgelu"). Writes the JSON and a markdown table beside it (same name, .md), and prints the table.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _event_timing import flushed_median_ms  # noqa: E402
from benchmarks.stages import profile as profile_stages  # noqa: E402
from _json_out import save_json  # noqa: E402

D, H = 1536, 6144


def measure(cupy, cupyffn, precision, T, reps, rounds):
    rng = cupy.random.default_rng(T)
    x, dy = (rng.standard_normal((T, D), dtype=cupy.float32) for _ in range(2))
    w1 = rng.standard_normal((H, D), dtype=cupy.float32) / 40
    w2 = rng.standard_normal((D, H), dtype=cupy.float32) / 80
    b1, b2 = rng.standard_normal(H, dtype=cupy.float32), rng.standard_normal(D, dtype=cupy.float32)
    flush_buf = cupy.empty(256 * 2 ** 20 // 4, cupy.float32)
    s = cupy.cuda.Stream(non_blocking=True)
    row = {"precision": precision, "tokens": T}
    fwd = [cupy.empty(sh, cupy.float32) for sh in ((T, D), (T, H), (T, H), (T, H))]
    for name, kw in (("forward", {}), ("forward + biases", {"bias1": b1, "bias2": b2})):
        row[name] = flushed_median_ms(cupy, s, lambda: cupyffn.gelu_ffn_forward(
            x, w1, w2, precision=precision, out=fwd, stream=s, **kw), lambda: flush_buf.fill(1), reps, 3)
    args = (dy, x, w1, w2, fwd[1], fwd[2], fwd[3])
    plans = {name: cupyffn.GeluFFNBackward(T, D, H, precision=precision, need_bias_grads=bias)
             for name, bias in (("backward", False), ("backward + bias grads", True))}
    outs = {name: [cupy.empty(sh, cupy.float32) for sh in ((T, D), (H, D), (D, H), (H,), (D,))][:5 if bias else 3]
            for name, bias in (("backward", False), ("backward + bias grads", True))}
    samples = {name: [] for name in plans}
    for _ in range(rounds):  # alternated, so that a drift of the GPU's clocks falls on both
        for name, plan in plans.items():
            samples[name].append(flushed_median_ms(cupy, s, lambda: plan(*args, out=outs[name], stream=s),
                                                   lambda: flush_buf.fill(1), reps, 3))
    for name, values in samples.items():
        row[name] = sorted(values)[len(values) // 2]
        row[name + " rounds"] = values
    name = "backward + bias grads"
    stages = profile_stages(plans[name], *args, out=outs[name], stream=s, reps=5, before_each=lambda: flush_buf.fill(1))
    row["stages ms"] = {k: round(v["ms"], 4) for k, v in stages.items()}
    stages = profile_stages(plans["backward"], *args, out=outs["backward"], stream=s, reps=5,
                            before_each=lambda: flush_buf.fill(1))
    row["stages ms without"] = {k: round(v["ms"], 4) for k, v in stages.items()}
    for plan in plans.values():
        plan.close()
    return row


def markdown(rows, device):
    lines = [f"# Biases in the split float32 precisions: cost on the {device} (dev/bias_cost.py)", "",
             f"dim {D}, hidden {H}; ms by CUDA events, L2 flushed, median (backward: median of alternated rounds); "
             "stage ms serialized (profile_stages).", "",
             "| precision | T | backward ms | + bias grads | ratio | forward ms | + biases | ratio | grad_bias2 / "
             "grad_bias1 stage ms | dgelu stage ms with / without sums |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        st = r["stages ms"]
        lines.append(f"| {r['precision']} | {r['tokens']} | {r['backward']:.4f} | {r['backward + bias grads']:.4f} | "
                     f"{r['backward + bias grads'] / r['backward']:.3f} | {r['forward']:.4f} | "
                     f"{r['forward + biases']:.4f} | {r['forward + biases'] / r['forward']:.3f} | "
                     f"{st['grad_bias2']:.4f} / {st['grad_bias1']:.4f} | {st['dgelu']:.4f} / "
                     f"{r['stages ms without']['dgelu']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8192])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "results"), "bias-cost.json"))
    a = p.parse_args(argv)
    import cupy

    import cupyffn

    rows = [measure(cupy, cupyffn, prec, T, a.reps, a.rounds) for prec in ("bf16x3", "fp16+fp8") for T in a.tokens]
    import datetime

    from benchmarks.gpu import environment, git_commit

    env = environment(cupy, None)
    save_json({"environment": env, "commit": git_commit(), "date": datetime.date.today().isoformat(), "dim": D,
               "hidden_dim": H, "rows": rows}, a.out)
    text = markdown(rows, env["device"])
    with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
        f.write(text)
    print(text)

if __name__ == "__main__":
    main()
