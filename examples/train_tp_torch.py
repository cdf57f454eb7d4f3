"""Train ``cupyffn.torch.TensorParallelGeluFFN`` over the ranks torchrun starts (Megatron-style sharding).

    torchrun --nproc_per_node=2 examples/train_tp_torch.py                 # CUDA where torch sees it, else the CPU
    torchrun --nproc_per_node=2 examples/train_tp_torch.py --device cuda   # NCCL, one GPU per rank
    torchrun --nproc_per_node=2 examples/train_tp_torch.py --device cpu    # gloo, CPU tensors
    torchrun --nproc_per_node=2 examples/train_tp_torch.py --bench results/tp-bench.json   # GPU timings

Every rank holds hidden_dim / world_size rows of weight1 and the same columns of weight2; the input batch
and the loss are the same on every rank. First a check: the same unsharded ``GeluFFN`` on every rank (one
seed), the tensor-parallel layer built from its weights (``from_full``), one batch through both; every
sharded result (the output, grad_hidden_states, each rank's grad_weight1 / grad_weight2 shard) must be
within the precision's contract of torch autograd in float64 and within twice the contract of the
unsharded cupyffn block, on every rank, or the script exits with status 1. Then training, the task of
examples/train_torch.py: regression onto a fixed random teacher FFN (plain torch ops, weights of twice the
default scale), a fresh batch x ~ N(0, 1) each step (the same on every rank: one CPU generator seed),
loss ``0.5 * mean over the batch of ||y - target||^2``, torch.optim.Adam on each rank's shard.

``--bench PATH`` (CUDA) times instead of training, for each shape of ``--bench-shapes``: one step
(forward + backward) and the backward alone of the tensor-parallel layer with the overlapped
grad_hidden_states all-reduce (``overlap=True``) and without it (``overlap=False``: the all-reduce after
the whole backward), the unsharded block on one GPU (rank 0), and the all-reduce of a grad_hidden_states
alone; each after the same check as above. CUDA-event times on each rank's stream, median over the timed
iterations, the slowest rank's; JSON written to PATH by rank 0.

Defaults (those of examples/train_torch.py): CUDA dim=512, hidden_dim=2048, batch=1024; CPU dim=32, hidden_dim=128, batch=256.
--device cuda where torch sees no CUDA device, or CuPy cannot use the rank's GPU, exits on every rank with the reason
on one line (so does the default, auto, where torch sees a CUDA device that CuPy cannot use).
"""

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    import cupyffn.torch as cupyffn_torch
except ImportError:  # running from a checkout without installing: use the package beside examples/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import cupyffn.torch as cupyffn_torch
import cupyffn  # noqa: E402 (found as cupyffn.torch was)

from train_torch import SIZES, fit, make_teacher, summary  # the task of examples/train_torch.py (beside this file)

BENCH_SHAPES = "4096x4096x16384,8192x4096x16384"  # tokens x dim x hidden_dim
NAMES = ("output", "grad_hidden_states", "grad_weight1", "grad_weight2")


def pick_device(device):
    """The device kind, "cpu" or "cuda", for --device ("auto", "cpu" or "cuda"): auto is CUDA where
    torch.cuda.is_available(). "cuda" where it is not exits (SystemExit, status 1) with the reason on one line;
    setup() checks CuPy on the rank's GPU."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda'; got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise SystemExit(f"train_tp_torch.py: --device cuda, but torch.cuda.is_available() is False (torch "
                         f"{torch.__version__}, {build}); --device cpu runs on CPU tensors with gloo")
    return device


def setup(kind):
    """Join the default process group (kind "cpu": gloo; "cuda": NCCL, one GPU per rank); returns this rank's device."""
    if kind == "cpu":
        dist.init_process_group("gloo")
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    reason = cupyffn.gpu_unavailable_reason(run_kernel=True)  # after set_device: CuPy tries this rank's GPU
    if reason is not None:
        raise SystemExit(f"train_tp_torch.py: --device cuda, but CuPy (cupyffn's GPU path) cannot use {device}: "
                         f"{reason}")
    dist.init_process_group("nccl", device_id=device)
    return device


def _shard(full, name, rank, world):
    if name == "grad_weight1":
        h = full.shape[0] // world
        return full[rank * h:(rank + 1) * h]
    if name == "grad_weight2":
        h = full.shape[1] // world
        return full[:, rank * h:(rank + 1) * h]
    return full


def _rel(a, ref):
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def _results(fn, x, w1, w2, r):
    """(output, grad_x, grad_w1, grad_w2) of loss = sum(fn(x, w1, w2) * r)."""
    x, w1, w2 = (t.detach().clone().requires_grad_() for t in (x, w1, w2))
    y = fn(x, w1, w2)
    (y * r).sum().backward()
    return y.detach(), x.grad, w1.grad, w2.grad


def check_against_unsharded(full, layer, x, r):
    """Errors of the sharded results against float64 autograd and the unsharded ``full`` (a GeluFFN), maxed
    over the ranks (every rank gets the same answer): ({name: (vs_float64, vs_unsharded)}, ok)."""
    rank, world = layer.rank, layer.world_size
    contract = cupyffn.PRECISIONS[layer.precision].contract
    w1_full, w2_full = full.weight1.detach(), full.weight2.detach()
    ref = _results(lambda a, b, c: F.linear(F.gelu(F.linear(a, b), approximate="tanh"), c),
                   x.double(), w1_full.double(), w2_full.double(), r.double())
    single = _results(lambda a, b, c: cupyffn_torch.gelu_ffn(a, b, c, full.precision, full.save), x, w1_full, w2_full, r)
    sharded = _results(lambda a, b, c: cupyffn_torch.tensor_parallel_gelu_ffn(
        a, b, c, layer.process_group, layer.precision, layer.save, layer.overlap),
        x, layer.weight1.detach(), layer.weight2.detach(), r)
    errors = torch.tensor([[_rel(got, _shard(want, name, rank, world)) for got, want, name in zip(sharded, refs, NAMES)]
                           for refs in (ref, single)], dtype=torch.float64, device=x.device)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX, group=layer.process_group)
    errors = errors.cpu()
    ok = bool((errors[0] <= contract).all() and (errors[1] <= 2 * contract).all())
    return {name: (float(errors[0, i]), float(errors[1, i])) for i, name in enumerate(NAMES)}, ok


def _say(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def run_check(dim, hidden_dim, tokens, device, precision, save, overlap, seed):
    """The start-up check on fresh random data; exits with status 1 (on every rank) if it fails."""
    torch.manual_seed(seed)  # the same unsharded block on every rank
    full = cupyffn_torch.GeluFFN(dim, hidden_dim, precision=precision, save=save, device="cpu").to(device)
    layer = cupyffn_torch.TensorParallelGeluFFN.from_full(full.weight1, full.weight2, precision=precision, save=save,
                                                          overlap=overlap, device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    x, r = (torch.randn(tokens, dim, generator=gen).to(device) for _ in range(2))
    errors, ok = check_against_unsharded(full, layer, x, r)
    contract = cupyffn.PRECISIONS[precision].contract
    _say(f"check ({tokens}x{dim}x{hidden_dim}, {precision}, world size {layer.world_size}): "
         + ", ".join(f"{n} {e64:.1e}/{e1:.1e}" for n, (e64, e1) in errors.items())
         + f" (vs float64 / vs unsharded; contract {contract:g}): {'ok' if ok else 'FAILED'}")
    if not ok:
        dist.destroy_process_group()
        raise SystemExit(1)
    return errors, full, layer


def train(steps, device, precision, save, overlap, dim, hidden_dim, batch, lr, seed, verbose):
    """The check, then `steps` Adam steps on the sharded layer; returns the per-step losses (the same on every rank)."""
    _, _, model = run_check(dim, hidden_dim, batch, device, precision, save, overlap, seed)
    gen = torch.Generator().manual_seed(seed)  # CPU generator: the same teacher and data on every rank
    teacher = make_teacher(dim, hidden_dim, gen, device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    if verbose:
        _say(f"device={device.type} {model} batch={batch} lr={lr:g}")
    return fit(model, opt, teacher, gen, steps, batch, device, _say if verbose else None)


# ---------------------------------------------------------------------- benchmark (CUDA)
def _time(fn, warmup, iters):
    """Median CUDA-event time of fn() on the current stream, in ms."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def _slowest(value, device):
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _step_and_backward(module, x, r, warmup, iters):
    """(ms of forward + backward, ms of the backward alone) of loss = sum(module(x) * r)."""
    params = list(module.parameters())
    xs = x.detach().clone().requires_grad_()

    def step():
        torch.autograd.grad(module(xs), [xs] + params, r)

    y = module(xs)

    def backward():
        torch.autograd.grad(y, [xs] + params, r, retain_graph=True)

    return _time(step, warmup, iters), _time(backward, warmup, iters)


def bench(path, shapes, device, precision, save, seed, warmup, iters):
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for tokens, dim, hidden in shapes:
        errors, full, layer = run_check(dim, hidden, tokens, device, precision, save, True, seed)
        gen = torch.Generator().manual_seed(seed + 2)
        x, r = (torch.randn(tokens, dim, generator=gen).to(device) for _ in range(2))
        row = {"tokens": tokens, "dim": dim, "hidden_dim": hidden, "check_vs_float64": {n: e[0] for n, e in errors.items()},
               "check_vs_unsharded": {n: e[1] for n, e in errors.items()}}
        for overlap in (True, False):
            layer.overlap = overlap
            dist.barrier()
            step_ms, backward_ms = _step_and_backward(layer, x, r, warmup, iters)
            key = "overlap" if overlap else "no_overlap"
            row[f"tp_step_ms_{key}"] = _slowest(step_ms, device)
            row[f"tp_backward_ms_{key}"] = _slowest(backward_ms, device)
        grad = torch.randn(tokens, dim, device=device)
        dist.barrier()
        row["all_reduce_ms"] = _slowest(_time(lambda: dist.all_reduce(grad), warmup, iters), device)
        del layer
        dist.barrier()
        if rank == 0:  # the unsharded block on one GPU; the other ranks wait at the barrier
            row["single_gpu_step_ms"], row["single_gpu_backward_ms"] = _step_and_backward(full, x, r, warmup, iters)
        dist.barrier()
        del full
        torch.cuda.empty_cache()
        if rank == 0:
            rows.append(row)
            print(f"{tokens}x{dim}x{hidden} {precision}: step {row['tp_step_ms_overlap']:.3f} ms with overlap, "
                  f"{row['tp_step_ms_no_overlap']:.3f} ms without, {row['single_gpu_step_ms']:.3f} ms on one GPU; "
                  f"backward {row['tp_backward_ms_overlap']:.3f} / {row['tp_backward_ms_no_overlap']:.3f} / "
                  f"{row['single_gpu_backward_ms']:.3f} ms; all-reduce of grad_hidden {row['all_reduce_ms']:.3f} ms",
                  flush=True)
    if rank == 0:
        import cupy

        nccl = torch.cuda.nccl.version()
        meta = {"world_size": world, "device": torch.cuda.get_device_name(device), "precision": precision, "save": save,
                "warmup": warmup, "iters": iters, "torch": torch.__version__, "cupy": cupy.__version__,
                "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
                "python": platform.python_version(),
                "timing": "median CUDA-event ms per iteration on each rank's stream, slowest rank"}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")
        print(f"wrote {path}")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda: NCCL, one GPU per rank; cpu: CPU tensors and gloo; auto: cuda where torch sees a CUDA "
                        "device, else cpu")
    p.add_argument("--steps", type=int, default=200, help="training steps")
    p.add_argument("--precision", choices=tuple(cupyffn.PRECISIONS), default=None,
                   help=f"cupyffn's precision (None: {cupyffn.DEFAULT_PRECISION} on CUDA, "
                        f"{cupyffn.CPU_DEFAULT_PRECISION} on the CPU)")
    p.add_argument("--save", choices=("all", "linear1_out"), default="all",
                   help="what the forward saves for the backward (linear1_out: memory mode)")
    p.add_argument("--no-overlap", action="store_true", help="all-reduce grad_hidden_states after the whole backward")
    p.add_argument("--dim", type=int, help="the layer's dim (None: 512 on CUDA, 32 on the CPU)")
    p.add_argument("--hidden-dim", type=int, help="its hidden_dim (None: 2048 on CUDA, 128 on the CPU)")
    p.add_argument("--batch", type=int, help="tokens per step (None: 1024 on CUDA, 256 on the CPU)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    p.add_argument("--bench", metavar="PATH", help="time instead of training and write JSON to PATH (CUDA)")
    p.add_argument("--bench-shapes", default=BENCH_SHAPES, help="comma-separated TOKENSxDIMxHIDDEN (--bench)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per shape (--bench)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per shape (--bench)")
    return p.parse_args(argv)


def main(argv):
    args = _parse(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("launch with torchrun, e.g.: torchrun --nproc_per_node=2 examples/train_tp_torch.py "
                         "[--device cpu]")
    kind = pick_device(args.device)
    if args.bench and kind == "cpu":
        raise SystemExit("--bench times CUDA streams; it cannot run on the CPU")
    if args.precision is None:  # cupyffn's default for the device, named: the check and the output report it
        args.precision = cupyffn.CPU_DEFAULT_PRECISION if kind == "cpu" else cupyffn.DEFAULT_PRECISION
    device = setup(kind)
    try:
        if args.bench:
            shapes = [tuple(int(v) for v in s.split("x")) for s in args.bench_shapes.split(",")]
            bench(args.bench, shapes, device, args.precision, args.save, args.seed, args.warmup, args.iters)
        else:
            d, h, t = SIZES[device.type]
            losses = train(args.steps, device, args.precision, args.save, not args.no_overlap, args.dim or d,
                           args.hidden_dim or h, args.batch or t, args.lr, args.seed, verbose=True)
            _say(summary(losses))
        # Every rank past its last collective before any tears the group down: a rank that destroys it while
        # its peer's gloo thread still talks to it made that peer abort at exit (seen once in CI, on CPU).
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
