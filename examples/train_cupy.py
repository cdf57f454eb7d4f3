"""Train the GELU(tanh) FFN with cupyffn's forward and backward and plain SGD (no autograd framework).

Task: regression onto a fixed random "teacher" FFN of the same shape. Each step draws a fresh batch
x ~ N(0, 1) of shape [batch, dim], computes the teacher's output, and minimizes
``L = 0.5 / batch * sum((y - target)^2)`` (dy = (y - target) / batch) with ``w -= lr * grad``.

    python examples/train_cupy.py                    # CuPy on the GPU if one is usable, else NumPy
    python examples/train_cupy.py --device cpu --steps 100
    python examples/train_cupy.py --device cuda      # the GPU, or exit saying why it cannot be used

Defaults: GPU dim=512, hidden_dim=2048, batch=1024; CPU (NumPy backend) dim=32, hidden_dim=128,
batch=256. Precision: cupyffn's default for the device unless --precision says otherwise ("fp16+fp8" on the
GPU, "ieee", plain fp32, on the CPU). ``main()`` returns the per-step losses.

Without CuPy installed, or without a usable GPU, --device auto runs on the CPU with NumPy; --device cuda exits
with status 1 and the reason (cupyffn.gpu_unavailable_reason).
"""

import argparse
import sys
from pathlib import Path

import numpy

try:
    import cupyffn
except ImportError:  # running from a checkout without installing: use the package beside examples/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import cupyffn


SIZES = {"cpu": (32, 128, 256), "cuda": (512, 2048, 1024)}  # dim, hidden_dim, batch


def pick_device(device):
    """The device to run on, "cpu" or "cuda", for `device` ("auto", "cpu" or "cuda"). "cuda" without a usable GPU
    exits (SystemExit, status 1) with the reason on one line: CuPy must import and run a kernel on a CUDA device."""
    if device not in ("auto", *SIZES):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda'; got {device!r}")
    if device == "cpu":
        return device
    reason = cupyffn.gpu_unavailable_reason(run_kernel=True)
    if reason is None:
        return "cuda"
    if device == "auto":
        return "cpu"
    raise SystemExit(f"train_cupy.py: --device cuda, but CuPy cannot use a GPU here: {reason}; "
                     "--device cpu runs on the CPU with NumPy")


def linear_init(rng, out_features, in_features, xp, scale=1.0):
    """torch.nn.Linear's weight init, U(-1/sqrt(in), 1/sqrt(in)) times `scale`, as float32 on `xp`."""
    bound = scale / numpy.sqrt(in_features)
    return xp.asarray(rng.uniform(-bound, bound, (out_features, in_features)).astype(numpy.float32))


def main(steps=200, device="auto", precision=None, dim=None, hidden_dim=None, batch=None, lr=None, seed=0,
         verbose=False):
    """Train for `steps` SGD steps; returns the list of losses (floats), one per step.

    device: "auto" (GPU if usable, else CPU), "cuda" or "cpu". precision: None for cupyffn's default on that
    device (cupyffn.DEFAULT_PRECISION on the GPU, cupyffn.CPU_DEFAULT_PRECISION on the CPU) or a name of
    cupyffn.PRECISIONS. lr defaults to 20 / hidden_dim.
    """
    device = pick_device(device)
    if device == "cuda":
        import cupy as xp
    else:
        xp = numpy
    d, h, t = SIZES[device]
    dim, hidden_dim, batch = dim or d, hidden_dim or h, batch or t
    lr = 20.0 / hidden_dim if lr is None else lr
    if precision is None:  # resolved here to be printed: the default cupyffn picks for arrays on this device
        precision = cupyffn.CPU_DEFAULT_PRECISION if device == "cpu" else cupyffn.DEFAULT_PRECISION

    rng = numpy.random.default_rng(seed)
    teacher1 = linear_init(rng, hidden_dim, dim, xp, scale=2.0)
    teacher2 = linear_init(rng, dim, hidden_dim, xp, scale=2.0)
    weight1 = linear_init(rng, hidden_dim, dim, xp)
    weight2 = linear_init(rng, dim, hidden_dim, xp)
    data = xp.random.default_rng(seed + 1)

    if verbose:
        print(f"device={device} dim={dim} hidden_dim={hidden_dim} batch={batch} precision={precision} lr={lr:g}")
    losses = []
    for step in range(steps):
        x = data.standard_normal((batch, dim), dtype=xp.float32)
        target = cupyffn.gelu_ffn_forward(x, teacher1, teacher2, precision="ieee").output
        fwd = cupyffn.gelu_ffn_forward(x, weight1, weight2, precision=precision)
        err = fwd.output - target
        losses.append(float(0.5 * (err * err).sum() / batch))
        grads = cupyffn.gelu_ffn_backward(err / xp.float32(batch), x, weight1, weight2, fwd.linear1_out,
                                          fwd.tanh_inner, fwd.gelu_out, precision=precision,
                                          need_grad_hidden=False)  # x is data: no gradient needed
        weight1 -= xp.float32(lr) * grads.grad_weight1
        weight2 -= xp.float32(lr) * grads.grad_weight2
        if verbose and (step % max(1, steps // 10) == 0 or step == steps - 1):
            print(f"step {step:5d}  loss {losses[-1]:.5f}")
    return losses


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="training steps")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: the GPU where CuPy can use one, else the CPU (NumPy)")
    p.add_argument("--precision", choices=tuple(cupyffn.PRECISIONS), default=None,
                   help=f"cupyffn's precision (None: {cupyffn.DEFAULT_PRECISION} on the GPU, "
                        f"{cupyffn.CPU_DEFAULT_PRECISION} on the CPU)")
    p.add_argument("--lr", type=float, default=None, help="SGD's learning rate (None: 20 / hidden_dim)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = _parse(sys.argv[1:])
    losses = main(steps=args.steps, device=args.device, precision=args.precision, lr=args.lr, seed=args.seed,
                  verbose=True)
    n = min(10, len(losses))  # fewer steps than 10: the mean of those there are, and the line says so
    if n:
        head, tail = numpy.mean(losses[:n]), numpy.mean(losses[-n:])
        print(f"mean loss of the first {n} steps {head:.5f}, of the last {n} steps {tail:.5f} ({tail / head:.3f}x)")
