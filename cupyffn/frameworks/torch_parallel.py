"""Tensor-parallel (Megatron-style) form of the cupyffn torch layer, on torch.distributed.

    import torch.distributed as dist
    from cupyffn.torch import TensorParallelGeluFFN
    dist.init_process_group("nccl")                     # e.g. under torchrun; "gloo" for CPU tensors
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    ffn = TensorParallelGeluFFN(dim=4096, hidden_dim=16384, device="cuda")   # default process group
    y = ffn(x)                                          # x replicated [..., dim]; y the full output on every rank
    y.sum().backward()                                  # x.grad summed over the ranks; weight grads of the shard

Sharding, for a group of p ranks and h = hidden_dim / p: rank r holds rows ``r*h:(r+1)*h`` of weight1
(``weight1 [h, D]``) and the same columns of weight2 (``weight2 [D, h]``); the input x is the same on
every rank. The forward runs the local block ``gelu_tanh(x @ weight1_r.T) @ weight2_r.T`` (cupyffn's
forward) and all-reduces (sums) it into the full output, the same on every rank. The backward takes
grad_output (the same on every rank, as it is when every rank computes the same loss from the replicated
output), runs cupyffn's backward on the shard, keeps the weight gradients local (they are exactly the
shard's slices of the unsharded block's) and all-reduces grad_hidden_states, whose sum over the ranks is
the unsharded block's.

Overlap (CUDA, ``overlap=True``): the all-reduce of grad_hidden_states starts as soon as its GEMM (GEMM3)
is done, while grad_weight1's GEMM (GEMM4, on cupyffn's side stream) still runs. cupyffn records an event
on the caller's stream right after GEMM3 (``gelu_ffn_backward(..., grad_hidden_ready=event)``); the
all-reduce is issued from a torch side stream that waits on that event only (NCCL's stream waits on the
stream the collective is issued from), and the caller's stream then waits on the all-reduce's work handle,
so grad_hidden_states is complete on the caller's stream when the backward returns, as with any torch op.
``overlap=False`` issues the all-reduce after the whole backward on the caller's stream (the comparison
point of the benchmark in examples/train_tp_torch.py). On CPU tensors (gloo) the backward is computed
synchronously by the NumPy backend and the all-reduce follows it: correct, nothing to overlap.

The accuracy contract of each output is the precision's (``cupyffn.PRECISIONS[p].contract``) up to the
rounding of the p-term sum. float32 tensors only, except under CUDA autocast (``torch.autocast("cuda")``),
where the inputs are cast to float32 (the output is float32; gradients come back in the inputs' dtypes).
No double backward; a graph break for torch.compile (an autograd.Function around collectives, not
cupyffn.torch's custom ops); not capturable in a CUDA graph (the collectives and the side stream); every
rank must call forward and backward in the same order (they are collectives).
"""

import math
import threading

import torch
import torch.distributed as dist

from ..api.functional import gelu_ffn_backward as _gelu_ffn_backward
from ..core import rules as _rules
from ..core.precision import checked_name
from . import torch_ops as _ops

__all__ = ["TensorParallelGeluFFN", "TensorParallelGeluFFNFunction", "shard_weights", "tensor_parallel_gelu_ffn"]


_side_streams = {}  # CUDA device index -> the torch stream the overlapped all-reduce is issued from
_side_lock = threading.Lock()


def _check_int(name, value, minimum):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return value


def _check_divisible(hidden_dim, world_size):
    if hidden_dim % world_size:
        raise ValueError(f"hidden_dim ({hidden_dim}) must be divisible by the world size ({world_size}): "
                         f"every rank holds hidden_dim / world_size rows of weight1")
    return hidden_dim // world_size


def _group_info(process_group):
    """(rank, world_size) of this process in `process_group` (None: the default group), or a clear error."""
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group(...) "
                           "first (e.g. under torchrun), then pass process_group= or use the default group")
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError("this process is not a member of process_group")
    return rank, dist.get_world_size(process_group)


def shard_weights(weight1, weight2, rank, world_size):
    """Rank `rank`'s shard of the unsharded block: ``(weight1[r*h:(r+1)*h], weight2[:, r*h:(r+1)*h])``.

    weight1 ``[H, D]``, weight2 ``[D, H]`` (``[out_features, in_features]``), h = H / world_size. Returns
    new contiguous tensors (copies, on the weights' device, with their dtype); the inputs are not modified.
    """
    for name, w in (("weight1", weight1), ("weight2", weight2)):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(w).__module__}.{type(w).__name__}")
        if w.dim() != 2:
            raise ValueError(f"{name} must be 2-D; got shape {tuple(w.shape)}")
    hidden, dim = weight1.shape
    if tuple(weight2.shape) != (dim, hidden):
        raise ValueError(f"weight2 must have shape (dim, hidden_dim) = {(dim, hidden)} to match weight1 "
                         f"{tuple(weight1.shape)}; got {tuple(weight2.shape)}")
    _check_int("world_size", world_size, 1)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}); got {rank!r}")
    h = _check_divisible(hidden, world_size)
    rows = slice(rank * h, (rank + 1) * h)
    with torch.no_grad():
        return (weight1[rows].clone(memory_format=torch.contiguous_format),
                weight2[:, rows].clone(memory_format=torch.contiguous_format))


def _side_stream(device):
    with _side_lock:
        stream = _side_streams.get(device.index)
        if stream is None:
            stream = _side_streams[device.index] = torch.cuda.Stream(device=device)
    return stream


def _start_all_reduce(tensor, group, ready):
    """Start the sum all-reduce of `tensor` over `group`; returns the work handle (wait on it before use).

    ready: None (the all-reduce is ordered after everything already on the current stream), or a CuPy event
    recorded on the current stream once `tensor` is complete: the collective is then issued from a side
    stream that waits on that event only, so it runs beside the current stream's later work.
    """
    if ready is None:
        return dist.all_reduce(tensor, group=group, async_op=True)
    import cupy

    side = _side_stream(tensor.device)
    cupy.cuda.runtime.streamWaitEvent(int(side.cuda_stream), ready.ptr, 0)
    with torch.cuda.stream(side):
        return dist.all_reduce(tensor, group=group, async_op=True)


class TensorParallelGeluFFNFunction(torch.autograd.Function):
    """The sharded block with its all-reduces; ``apply(x, weight1, weight2, group, precision, save, overlap)``.

    x ``[..., D]`` (the same on every rank), weight1 ``[h, D]`` and weight2 ``[D, h]`` (this rank's shard,
    see ``shard_weights``), float32 on one CPU or CUDA device; group: a process group or None (the default
    group); precision and save as in ``cupyffn.torch.GeluFFNFunction`` (precision None, the default: "fp16+fp8" on
    CUDA, "ieee" on the CPU); overlap: see the module docstring.
    Returns the full output ``[..., D]`` (summed over the ranks).
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)  # CUDA autocast: computed in float32
    def forward(ctx, hidden_states, weight1, weight2, group=None, precision=None, save="all",
                overlap=True):
        precision = checked_name(precision)  # a bad name is reported before the tensors are looked at
        _ops.check_save(save)
        _group_info(group)
        _ops.check_tensors((("hidden_states", hidden_states), ("weight1", weight1), ("weight2", weight2)))
        x, w1, w2 = (_ops.readable(t) for t in (hidden_states, weight1, weight2))
        # the door's shape rules before the layer's own body reads the shapes
        _rules.check_shapes("forward", (tuple(x.shape), tuple(w1.shape), tuple(w2.shape), None, None))
        output, z, t, g = _ops.forward_impl(x, w1, w2, None, None, precision)[:4]
        # The ranks' partial outputs sum to the full one; the caller's stream waits for it (async_op=False).
        dist.all_reduce(output, group=group)
        ctx.group, ctx.precision, ctx.overlap = group, precision, bool(overlap)
        if save == "all":
            ctx.save_for_backward(x, w1, w2, z, t, g)
        else:
            ctx.save_for_backward(x, w1, w2, z)
        return output

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        need_x, need_w1, need_w2 = ctx.needs_input_grad[:3]
        need_weights = need_w1 or need_w2
        none = (None,) * 4
        if not (need_x or need_weights):
            return (None, None, None) + none
        saved = ctx.saved_tensors
        x, w1, w2, z = saved[:4]
        t, g = saved[4:] if len(saved) == 6 else (None, None)
        if grad_output.dtype != torch.float32:
            raise TypeError(f"grad_output must be float32; got {grad_output.dtype}")
        dy = _ops.readable(grad_output)
        overlap = ctx.overlap and need_x and x.is_cuda  # CPU results are complete when the call returns
        if not overlap:  # the layer's own body, then the sum
            grad_x, grad_w1, grad_w2 = _ops.backward_impl(dy, x, w1, w2, z, t, g, ctx.precision, need_x,
                                                          need_weights, False)[:3]
            if need_x:
                _start_all_reduce(grad_x, ctx.group, None).wait()
            return (grad_x, grad_w1 if need_w1 else None, grad_w2 if need_w2 else None) + none
        with _ops.TorchDevice(x.device) as dev:
            out = (dev.empty(x.shape) if need_x else None,
                   dev.empty(w1.shape) if need_weights else None,
                   dev.empty(w2.shape) if need_weights else None)
            extra = {}
            if overlap:
                import cupy

                extra["grad_hidden_ready"] = cupy.cuda.Event(block=False, disable_timing=True)
            _gelu_ffn_backward(dev.arg(dy), dev.arg(x), dev.arg(w1), dev.arg(w2), dev.arg(z), dev.arg(t),
                               dev.arg(g), precision=ctx.precision, out=[dev.arg(o) for o in out],
                               stream=dev.stream, need_grad_hidden=need_x, need_weight_grads=need_weights, **extra)
            grad_x, grad_w1, grad_w2 = out
            work = _start_all_reduce(grad_x, ctx.group, extra.get("grad_hidden_ready")) if need_x else None
        if work is not None:
            work.wait()  # on CUDA: the caller's (current) stream waits for the sum; on the CPU: the host does
        return (grad_x, grad_w1 if need_w1 else None, grad_w2 if need_w2 else None) + none


def tensor_parallel_gelu_ffn(x, weight1, weight2, process_group=None, precision=None, save="all",
                             overlap=True):
    """The full output ``gelu_tanh(x @ W1.T) @ W2.T`` from this rank's shard (weight1 ``[h, D]``, weight2
    ``[D, h]``); differentiable; see ``TensorParallelGeluFFNFunction`` and the module docstring."""
    return TensorParallelGeluFFNFunction.apply(x, weight1, weight2, process_group, precision, save, overlap)


class TensorParallelGeluFFN(torch.nn.Module):
    """``GeluFFN`` sharded over a process group (Megatron-style): this rank holds ``hidden_dim / world_size``
    rows of weight1 and the same columns of weight2.

    Parameters ``weight1 [hidden_dim / p, dim]`` and ``weight2 [dim, hidden_dim / p]``. The default
    initialization draws the full weights as ``GeluFFN`` does (``nn.Linear``'s, fan-in of the full layer)
    from torch's CPU generator and keeps this rank's slices, so with the same seed on every rank the layer is
    exactly the sharded ``GeluFFN(dim, hidden_dim)`` of that seed (it needs the full weights in host memory
    once; ``from_full`` shards given weights instead). Input ``[..., dim]`` (the same on every rank),
    output ``[..., dim]`` (the full output, on every rank). precision, save as in ``GeluFFN``; overlap: see
    the module docstring. Raises ValueError when hidden_dim is not divisible by the group's size and
    RuntimeError when torch.distributed is not initialized.
    """

    def __init__(self, dim, hidden_dim, process_group=None, *, precision=None, save="all",
                 overlap=True, device=None, dtype=torch.float32):
        super().__init__()
        self._setup(dim, hidden_dim, process_group, precision, save, overlap, device, dtype)
        self.reset_parameters()

    def _setup(self, dim, hidden_dim, process_group, precision, save, overlap, device, dtype):
        if dtype != torch.float32:
            raise TypeError(f"TensorParallelGeluFFN supports dtype=torch.float32 only; got {dtype}")
        self.dim = _check_int("dim", dim, 1)
        self.hidden_dim = _check_int("hidden_dim", hidden_dim, 1)
        self.precision = checked_name(precision)  # None: per call
        self.save = _ops.check_save(save)
        self.overlap = bool(overlap)
        self.process_group = process_group
        self.rank, self.world_size = _group_info(process_group)
        self.local_hidden_dim = _check_divisible(hidden_dim, self.world_size)
        factory = {"device": device, "dtype": dtype}
        self.weight1 = torch.nn.Parameter(torch.empty((self.local_hidden_dim, dim), **factory))
        self.weight2 = torch.nn.Parameter(torch.empty((dim, self.local_hidden_dim), **factory))

    @classmethod
    def from_full(cls, weight1, weight2, process_group=None, *, precision=None, save="all",
                  overlap=True, device=None):
        """The layer holding this rank's shard of the unsharded weights weight1 ``[H, D]``, weight2 ``[D, H]``
        (the same on every rank, e.g. a ``GeluFFN``'s); copied to `device` (default: weight1's device)."""
        self = cls.__new__(cls)
        torch.nn.Module.__init__(self)
        for name, w in (("weight1", weight1), ("weight2", weight2)):
            if isinstance(w, torch.Tensor) and w.dtype != torch.float32:
                raise TypeError(f"{name} must be float32; got {w.dtype}")
        hidden, dim = (weight1.shape if isinstance(weight1, torch.Tensor) and weight1.dim() == 2 else (0, 0))
        rank, world = _group_info(process_group)
        w1, w2 = shard_weights(weight1, weight2, rank, world)  # validates the shapes
        self._setup(dim, hidden, process_group, precision, save, overlap,
                    device if device is not None else weight1.device, torch.float32)
        with torch.no_grad():
            self.weight1.copy_(w1)
            self.weight2.copy_(w2)
        return self

    def reset_parameters(self):
        """This rank's slices of full weights drawn like ``GeluFFN.reset_parameters`` on torch's CPU generator."""
        full1 = torch.empty((self.hidden_dim, self.dim))
        full2 = torch.empty((self.dim, self.hidden_dim))
        torch.nn.init.kaiming_uniform_(full1, a=math.sqrt(5))
        torch.nn.init.kaiming_uniform_(full2, a=math.sqrt(5))
        w1, w2 = shard_weights(full1, full2, self.rank, self.world_size)
        with torch.no_grad():
            self.weight1.copy_(w1)
            self.weight2.copy_(w2)

    def forward(self, x):
        return TensorParallelGeluFFNFunction.apply(x, self.weight1, self.weight2, self.process_group,
                                                   self.precision, self.save, self.overlap)

    def extra_repr(self):
        return (f"dim={self.dim}, hidden_dim={self.hidden_dim}, rank={self.rank}, world_size={self.world_size}, "
                f"local_hidden_dim={self.local_hidden_dim}, precision={self.precision!r}, save={self.save!r}, "
                f"overlap={self.overlap}")
