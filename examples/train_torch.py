"""Train ``cupyffn.torch.GeluFFN`` with a torch optimizer (autograd through cupyffn's backward).

Task: regression onto a fixed random "teacher" FFN of the same shape (plain torch ops: Linear ->
GELU(tanh) -> Linear, weights of twice the default scale). Each step draws a fresh batch
x ~ N(0, 1) of shape [batch, dim] and minimizes ``0.5 * mean over the batch of ||y - target||^2``
with torch.optim.Adam (or SGD).

    python examples/train_torch.py                   # CUDA if torch and CuPy can use a GPU, else CPU
    python examples/train_torch.py --device cpu --optimizer sgd
    python examples/train_torch.py --device cuda     # CUDA, or exit saying why it cannot be used

Defaults: CUDA dim=512, hidden_dim=2048, batch=1024; CPU dim=32, hidden_dim=128, batch=256; precision
cupyffn's default for the device ("fp16+fp8" on CUDA, "ieee", plain fp32, on the CPU).
``main()`` returns the per-step losses.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import cupyffn.torch as cupyffn_torch
except ImportError:  # running from a checkout without installing: use the package beside examples/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import cupyffn.torch as cupyffn_torch
import cupyffn  # noqa: E402 (found as cupyffn.torch was)

SIZES = {"cpu": (32, 128, 256), "cuda": (512, 2048, 1024)}  # dim, hidden_dim, batch
DEFAULT_LR = {"adam": 3e-3, "sgd": None}  # SGD: 20 / hidden_dim


def cuda_unavailable_reason():
    """None when CUDA tensors can train here, else why not (one line): torch must see a device
    (torch.cuda.is_available()) and cupyffn's GPU path, CuPy, must run a kernel on it."""
    if not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"torch.cuda.is_available() is False (torch {torch.__version__}, {build})"
    return cupyffn.gpu_unavailable_reason(run_kernel=True)


def pick_device(device):
    """The device to run on, "cpu" or "cuda", for `device` ("auto", "cpu" or "cuda"). "cuda" where CUDA cannot
    be used exits (SystemExit, status 1) with cuda_unavailable_reason() on one line."""
    if device not in ("auto", *SIZES):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda'; got {device!r}")
    if device == "cpu":
        return device
    reason = cuda_unavailable_reason()
    if reason is None:
        return "cuda"
    if device == "auto":
        return "cpu"
    raise SystemExit(f"train_torch.py: --device cuda, but {reason}; --device cpu runs on CPU tensors")


def main(steps=200, device="auto", precision=None, save="all", optimizer="adam", dim=None, hidden_dim=None,
         batch=None, lr=None, seed=0, verbose=False):
    """Train for `steps` optimizer steps; returns the list of losses (floats), one per step.

    device: "auto" (CUDA where cuda_unavailable_reason() is None, else CPU), "cuda" or "cpu".
    optimizer: "adam" (lr 3e-3) or "sgd" (lr 20 / hidden_dim).
    """
    device = pick_device(device)
    if optimizer not in DEFAULT_LR:
        raise ValueError(f"optimizer must be 'adam' or 'sgd'; got {optimizer!r}")
    d, h, t = SIZES[device]
    dim, hidden_dim, batch = dim or d, hidden_dim or h, batch or t
    if precision is None:  # resolved here to be printed: the default cupyffn picks for tensors on this device
        precision = cupyffn.CPU_DEFAULT_PRECISION if device == "cpu" else cupyffn.DEFAULT_PRECISION
    if lr is None:
        lr = DEFAULT_LR[optimizer] or 20.0 / hidden_dim

    gen = torch.Generator().manual_seed(seed)  # CPU generator: the same weights and data on every device
    teacher = make_teacher(dim, hidden_dim, gen, device)
    torch.manual_seed(seed)  # initialize on the CPU and move: the same starting weights on every device
    model = cupyffn_torch.GeluFFN(dim, hidden_dim, precision=precision, save=save, device="cpu").to(device)
    opt = (torch.optim.Adam(model.parameters(), lr=lr) if optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=lr))

    if verbose:
        print(f"device={device} {model} batch={batch} optimizer={optimizer} lr={lr:g}")
    return fit(model, opt, teacher, gen, steps, batch, device, print if verbose else None)


def make_teacher(dim, hidden_dim, gen, device):
    """The teacher's (weight1 [hidden_dim, dim], weight2 [dim, hidden_dim]): uniform, twice nn.Linear's scale,
    drawn from the CPU generator `gen` (the same on every device), then moved to `device`."""
    teacher1 = (2 * torch.rand(hidden_dim, dim, generator=gen) - 1) * (2 / dim ** 0.5)
    teacher2 = (2 * torch.rand(dim, hidden_dim, generator=gen) - 1) * (2 / hidden_dim ** 0.5)
    return teacher1.to(device), teacher2.to(device)


def fit(model, opt, teacher, gen, steps, batch, device, say=None):
    """`steps` optimizer steps of the regression onto `teacher`, each on a fresh batch x ~ N(0, 1) drawn from
    `gen`; returns the per-step losses. say(line), if given, reports every steps // 10 steps and the last."""
    teacher1, teacher2 = teacher
    losses = []
    for step in range(steps):
        x = torch.randn(batch, teacher1.shape[1], generator=gen).to(device)
        with torch.no_grad():
            target = F.linear(F.gelu(F.linear(x, teacher1), approximate="tanh"), teacher2)
        loss = 0.5 * (model(x) - target).square().sum() / batch
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if say is not None and (step % max(1, steps // 10) == 0 or step == steps - 1):
            say(f"step {step:5d}  loss {losses[-1]:.5f}")
    return losses


def summary(losses):
    """The last line the torch training examples print: mean loss of the first and of the last 10 steps (of all of
    them, and saying so, where fewer ran)."""
    n = min(10, len(losses))
    if n == 0:
        return "no steps were run"
    head, tail = sum(losses[:n]) / n, sum(losses[-n:]) / n
    return f"mean loss of the first {n} steps {head:.5f}, of the last {n} steps {tail:.5f} ({tail / head:.3f}x)"


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="training steps")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA where torch and CuPy can use it, else CPU tensors")
    p.add_argument("--precision", choices=("fp16+fp8", "bf16x3", "ieee", "tf32", "bf16"), default=None,
                   help="cupyffn's precision (None: fp16+fp8 on CUDA, ieee on the CPU)")
    p.add_argument("--save", choices=("all", "linear1_out"), default="all",
                   help="what the forward saves for the backward (linear1_out: memory mode)")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="the optimizer")
    p.add_argument("--lr", type=float, default=None, help="learning rate (None: 3e-3 for adam, 20 / hidden_dim "
                                                          "for sgd)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = _parse(sys.argv[1:])
    losses = main(steps=args.steps, device=args.device, precision=args.precision, save=args.save,
                  optimizer=args.optimizer, lr=args.lr, seed=args.seed, verbose=True)
    print(summary(losses))
