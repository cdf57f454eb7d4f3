"""Whether a precision's forward output carries a bias against float64, beside its relative L2 (issue 61's lead).

    PYTHONPATH=. python3 dev/forward_bias_probe.py [--device gpu|cpu] [--tokens 2048] [--out $OUT/forward-bias.json]

The jax-mlp training loop's first loss, which the forward alone sets, lay further from strict fp32's with fp16+fp8
on the GPU (3.6e-6) than with TF32 (1.9e-6), while this tool's NumPy-route run gives fp16+fp8's forward a loss
error of 1.7e-9 (`results/forward-bias-cpu.json`; decision 069): a bias that relative L2 does not show would explain
it. Here, on the loop's kind of data (a student FFN
against a teacher FFN, examples/train_jax.py: weights uniform at 1/sqrt(fan-in), the teacher's at twice that,
x ~ N(0, 1)), for each precision: `cupyffn.gelu_ffn_forward` on the device's arrays (CuPy arrays on the GPU, NumPy
arrays on the CPU: the NumPy route), against the float64 forward of the same inputs:
- `rel_l2`: ||y - y64|| / ||y64||;
- `scale_bias`: the least-squares slope of d = y - y64 on y64, sum(d y64) / sum(y64^2): a systematic shrinking
  or growing of the output (a rounding toward zero shows as a negative slope), against the slope random rounding
  gives, of the order of rel_l2 / sqrt(elements);
- `mean_over_rms`: mean(d) / rms(y64);
- `loss_rel`: |L - L64| / L64 for the loop's loss L = 0.5 sum((y - target)^2) / T, target the teacher's float64
  output.
Writes the JSON (--out) and prints a table.
"""

import argparse
import math
import os
import sys

PRECISIONS = ("ieee", "fp16+fp8", "bf16x3", "tf32")


def problem(dim, hidden, tokens, seed=0):
    """(x, w1, w2, target): float32 inputs, the float64 teacher's output as target."""
    import numpy

    from cupyffn.workloads import forward_reference

    rng = numpy.random.default_rng(seed)

    def uniform(shape, bound):
        return rng.uniform(-bound, bound, size=shape).astype(numpy.float32)

    t1, t2 = uniform((hidden, dim), 2 / math.sqrt(dim)), uniform((dim, hidden), 2 / math.sqrt(hidden))
    w1, w2 = uniform((hidden, dim), 1 / math.sqrt(dim)), uniform((dim, hidden), 1 / math.sqrt(hidden))
    x = rng.standard_normal((tokens, dim), dtype=numpy.float32)
    return x, w1, w2, forward_reference(x, t1, t2)[0]


def statistics(y, y64, target):
    """The figures of the module docstring for output `y` (float64) against `y64`."""
    import numpy

    d = y - y64
    loss = 0.5 * numpy.sum((y - target) ** 2) / y.shape[0]
    loss64 = 0.5 * numpy.sum((y64 - target) ** 2) / y.shape[0]
    return {"rel_l2": float(numpy.linalg.norm(d) / numpy.linalg.norm(y64)),
            "scale_bias": float(numpy.sum(d * y64) / numpy.sum(y64 * y64)),
            "mean_over_rms": float(d.mean() / numpy.sqrt(numpy.mean(y64 * y64))),
            "loss_rel": float(abs(loss - loss64) / loss64)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=1536)
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "forward-bias.json"))
    args = ap.parse_args(argv)

    import numpy

    import cupyffn
    from cupyffn.workloads import forward_reference
    from dev._json_out import save_json

    x, w1, w2, target = problem(args.dim, args.hidden, args.tokens)
    y64 = forward_reference(x, w1, w2)[0]
    if args.device == "gpu":
        import cupy

        xs, w1s, w2s = (cupy.asarray(a) for a in (x, w1, w2))
        host = cupy.asnumpy
        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        device = name.decode() if isinstance(name, bytes) else str(name)
    else:
        xs, w1s, w2s, host = x, w1, w2, numpy.asarray
        device = "cpu (NumPy route)"
    rows = {}
    for precision in args.precisions.split(","):
        y = host(cupyffn.gelu_ffn_forward(xs, w1s, w2s, precision=precision).output).astype(numpy.float64)
        if not numpy.isfinite(y).all():
            print(f"FAILED: {precision}'s output is not finite")
            return 1
        rows[precision] = statistics(y, y64, target)
        r = rows[precision]
        print(f"{precision:10s} rel L2 {r['rel_l2']:.2e}  scale bias {r['scale_bias']:+.2e}  "
              f"mean/rms {r['mean_over_rms']:+.2e}  loss rel {r['loss_rel']:.2e}", flush=True)
    save_json({"device": device, "sizes": {"dim": args.dim, "hidden": args.hidden, "tokens": args.tokens},
               "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
