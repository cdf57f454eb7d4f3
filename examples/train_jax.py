"""Train ``cupyffn.jax.gelu_ffn`` weights with plain SGD inside one ``jax.jit``-compiled training step.

Task: regression onto a fixed random "teacher" FFN of the same shape (plain jnp ops: x @ W1.T ->
GELU(tanh) -> @ W2.T, weights of twice the default scale). Each step draws a fresh batch x ~ N(0, 1)
of shape [batch, dim] (inside the jitted step, from the step number) and minimizes
``0.5 * mean over the batch of ||y - target||^2``. The step (forward, ``jax.value_and_grad`` through
cupyffn's custom VJP, SGD update) is one XLA program: on a GPU, cupyffn's forward and backward run on
XLA's stream from inside it, and the host never waits until the losses are read at the end.

    python examples/train_jax.py                   # the GPU if JAX and CuPy can use one, else the CPU
    python examples/train_jax.py --device cpu --steps 100
    python examples/train_jax.py --device cuda     # the GPU, or exit saying why it cannot be used

GPU memory: XLA preallocates 75% of the GPU by default; cupyffn's buffers come from CuPy's pool beside
it. This script leaves room with XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 unless the variable (or
XLA_PYTHON_CLIENT_PREALLOCATE) is already set.

Defaults: GPU dim=512, hidden_dim=2048, batch=1024; CPU dim=32, hidden_dim=128, batch=256; learning rate
20 / hidden_dim; precision cupyffn's default for the device ("fp16+fp8" on the GPU, "ieee", plain fp32, on
the CPU). ``main()`` returns the per-step losses.
"""

import argparse
import math
import os
import sys
from pathlib import Path

if "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ:  # before JAX starts (docs/frameworks.md, "JAX")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

try:
    import cupyffn.jax as cupyffn_jax
except ImportError:  # running from a checkout without installing: use the package beside examples/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import cupyffn.jax as cupyffn_jax
import cupyffn  # noqa: E402 (found as cupyffn.jax was)

SIZES = {"cpu": (32, 128, 256), "cuda": (512, 2048, 1024)}  # dim, hidden_dim, batch


def pick_device(kind):
    """The JAX device to run on for `kind` ("auto", "cpu" or "cuda"). "cuda" needs JAX's CUDA backend
    (jax.devices("cuda")) and cupyffn's GPU path, CuPy, running a kernel; without them it exits (SystemExit,
    status 1) with the reason on one line, and "auto" takes the CPU."""
    if kind not in ("auto", *SIZES):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda'; got {kind!r}")
    if kind == "cpu":
        return jax.devices("cpu")[0]
    try:
        gpu, reason = jax.devices("cuda")[0], cupyffn.gpu_unavailable_reason(run_kernel=True)
    except RuntimeError as e:  # no CUDA backend in this jaxlib, or it failed to start
        gpu, reason = None, f"JAX has no CUDA device (jax.devices('cuda'): {' '.join(str(e).split())})"
    if reason is None:
        return gpu
    if kind == "auto":
        return jax.devices("cpu")[0]
    raise SystemExit(f"train_jax.py: --device cuda, but {reason}; --device cpu runs on the CPU")


def problem(dim, hidden_dim, seed=0):
    """(teacher, params, data_key) of the task: the teacher's weights (twice the default scale), the initial weights
    (as torch.nn.Linear initializes them) and the key the batches are drawn from (`batch_of`)."""
    k_teacher1, k_teacher2, k_w1, k_w2, k_data = jax.random.split(jax.random.PRNGKey(seed), 5)

    def uniform(key, shape, bound):
        return jax.random.uniform(key, shape, jnp.float32, -bound, bound)

    teacher = (uniform(k_teacher1, (hidden_dim, dim), 2 / math.sqrt(dim)),
               uniform(k_teacher2, (dim, hidden_dim), 2 / math.sqrt(hidden_dim)))
    params = (uniform(k_w1, (hidden_dim, dim), 1 / math.sqrt(dim)),
              uniform(k_w2, (dim, hidden_dim), 1 / math.sqrt(hidden_dim)))
    return teacher, params, k_data


def batch_of(data_key, step, batch, teacher, precision=None):
    """(x, target) of step `step`: x ~ N(0, 1) of shape [batch, dim] and the teacher's output on it (plain jnp ops,
    their matmuls at `precision`: a jax.lax.Precision, None for JAX's default)."""
    x = jax.random.normal(jax.random.fold_in(data_key, step), (batch, teacher[0].shape[1]), jnp.float32)
    return x, plain_ffn(x, teacher[0], teacher[1], precision)


def plain_ffn(x, w1, w2, precision=None):
    """x @ w1.T -> GELU(tanh) -> @ w2.T in plain jnp ops, the matmuls at `precision` (None: JAX's default)."""
    return jnp.matmul(jax.nn.gelu(jnp.matmul(x, w1.T, precision=precision), approximate=True), w2.T,
                      precision=precision)


def objective(y, target):
    """0.5 * the mean over the batch of ||y - target||^2."""
    return 0.5 * jnp.sum((y - target) ** 2) / y.shape[0]


def main(steps=200, device="auto", precision=None, dim=None, hidden_dim=None, batch=None, lr=None, seed=0,
         verbose=False):
    """Train for `steps` SGD steps; returns the list of losses (floats), one per step.

    device: "auto" (JAX's first CUDA device where cupyffn can use it, else the CPU), "cuda" or "cpu".
    """
    dev = pick_device(device)
    kind = "cpu" if dev.platform == "cpu" else "cuda"
    d, h, t = SIZES[kind]
    dim, hidden_dim, batch = dim or d, hidden_dim or h, batch or t
    lr = 20.0 / hidden_dim if lr is None else lr
    if precision is None:  # resolved here to be printed: the default cupyffn picks for arrays on this device
        precision = cupyffn.CPU_DEFAULT_PRECISION if kind == "cpu" else cupyffn.DEFAULT_PRECISION

    teacher, params, k_data = problem(dim, hidden_dim, seed)
    teacher, params = jax.device_put((teacher, params), dev)

    def loss_fn(params, x, target):
        return objective(cupyffn_jax.gelu_ffn(x, params[0], params[1], precision), target)

    @jax.jit
    def train_step(params, teacher, step):
        x, target = batch_of(k_data, step, batch, teacher)
        loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
        return tuple(p - lr * g for p, g in zip(params, grads)), loss

    if verbose:
        print(f"device={dev} dim={dim} hidden_dim={hidden_dim} batch={batch} precision={precision} lr={lr:g}")
    losses = []
    for step in range(steps):
        params, loss = train_step(params, teacher, jnp.asarray(step, jnp.uint32))
        losses.append(loss)  # a device array: reading it now would make the host wait for the step
    losses = [float(v) for v in jax.device_get(losses)]
    if verbose:
        for step in sorted({*range(0, steps, max(1, steps // 10)), steps - 1}):
            print(f"step {step:5d}  loss {losses[step]:.5f}")
        n = min(10, len(losses))  # fewer steps than 10: the mean of those there are
        if n:
            first, last = sum(losses[:n]) / n, sum(losses[-n:]) / n
            print(f"mean loss of the first {n} steps {first:.5f}, of the last {n} steps {last:.5f}")
    return losses


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="training steps")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: the GPU where JAX and cupyffn can use one, else the CPU")
    p.add_argument("--precision", choices=("fp16+fp8", "bf16x3", "ieee", "tf32", "bf16"), default=None,
                   help="cupyffn's precision (None: fp16+fp8 on the GPU, ieee on the CPU)")
    p.add_argument("--dim", type=int, help="the layer's dim (None: 512 on the GPU, 32 on the CPU)")
    p.add_argument("--hidden-dim", type=int, help="its hidden_dim (None: 2048 on the GPU, 128 on the CPU)")
    p.add_argument("--batch", type=int, help="tokens per step (None: 1024 on the GPU, 256 on the CPU)")
    p.add_argument("--lr", type=float, help="SGD's learning rate (None: 20 / hidden_dim)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    return p.parse_args(argv)


if __name__ == "__main__":
    a = _parse(sys.argv[1:])
    main(steps=a.steps, device=a.device, precision=a.precision, dim=a.dim, hidden_dim=a.hidden_dim, batch=a.batch,
         lr=a.lr, seed=a.seed, verbose=True)
