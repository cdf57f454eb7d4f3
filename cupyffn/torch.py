"""PyTorch layer: ``y = gelu_tanh(x @ weight1.T + b1) @ weight2.T + b2`` with cupyffn's forward and backward.

    from cupyffn.torch import GeluFFN
    ffn = GeluFFN(dim=512, hidden_dim=2048, device="cuda")       # precision: fp16+fp8 on CUDA, save="all"
    y = ffn(x)                                                     # x: float32 [..., 512]
    y.sum().backward()                                             # ffn.weight1.grad, ffn.weight2.grad, x.grad

``weight1`` is ``[hidden_dim, dim]`` and ``weight2`` is ``[dim, hidden_dim]``, both
``[out_features, in_features]`` like ``torch.nn.Linear.weight``; the result equals
``F.linear(F.gelu(F.linear(x, weight1), approximate="tanh"), weight2)`` within the accuracy contract
of the precision (``cupyffn.PRECISIONS[precision].contract``, relative L2 error per output).

Operators: the forward and the backward are ``torch.library.custom_op``s, ``torch.ops.cupyffn.forward``
and ``torch.ops.cupyffn.backward``, with fake (meta) implementations and an autograd formula
(``register_autograd``). So ``torch.compile(model, fullgraph=True)`` traces a model using ``GeluFFN``
without a graph break (the ops stay opaque calls in the compiled graph, forward and backward), and
``torch.compile(mode="reduce-overhead")`` and ``torch.cuda.graph`` capture them: every result is
allocated by torch (``torch.empty``, inside the op) and handed to cupyffn as ``out=``, so under capture
it comes from the graph's memory pool. Capture needs the call's plan built first: run the step once
(the usual warm-up iterations) before capturing.

Eager fast path: outside tracing (``torch.compiler.is_compiling()`` False, no torch dispatch mode such
as FakeTensorMode, no functorch transform, plain tensors) the layer runs the same implementation through a
plain ``torch.autograd.Function`` instead of the operators, skipping the custom-op dispatcher's Python
layers (host time per call; ``_eager`` says why that check is sufficient). ``entry_counts`` counts the calls
of each route. ``gelu_ffn_backward`` is that eager backward as a function (no autograd).

Autocast: ``gelu_ffn`` (the operators) casts its floating-point inputs to float32 under ``torch.autocast``
(``torch.library.register_autocast``) and returns float32; outside autocast only float32 tensors are accepted
(TypeError naming the tensor). The ``GeluFFN`` module instead computes under autocast as ``nn.Linear`` would, in
the autocast dtype, as it does with biases or 16-bit parameters (cupyffn/_torch_lt.py).

Devices and streams: the work is enqueued on torch's current stream of the tensors' device
(``torch.cuda.current_stream(device)``), so it is ordered like any torch op and the host is never
synchronized. CPU tensors run on cupyffn's NumPy backend (zero-copy ``Tensor.numpy()`` views).
cupyffn's own scratch buffers and cuBLAS workspaces come from CuPy's memory pool, not torch's.

Host fast path: no DLPack import. CUDA tensors are read by pointer (data_ptr(), shape, stride(), device:
cupyffn/_arrays.py), on torch's current stream, and repeated tensors take the validated-call fast path keyed
by pointers, shapes and strides (docs/decisions/048-dlpack-free-import.md).

Tensor parallelism: autograd hands grad_input on only when this op's backward returns, so this layer cannot
start the all-reduce of grad_hidden_states early; ``TensorParallelGeluFFN`` (cupyffn/_torch_parallel.py)
does, through ``cupyffn.gelu_ffn_backward(..., grad_hidden_ready=event)``.

Limitations: no double backward (the backward operator has no autograd formula); no ``torch.func``
rules (vmap), untested with ``torch.func``; all three tensors on one device.

This module imports torch; ``import cupyffn`` does not import it.
"""

from typing import Optional, Tuple

import torch

from .core import arrays as _arrays, views as _views
from .api.functional import gelu_ffn_backward as _gelu_ffn_backward
from .api.forward import gelu_ffn_forward as _gelu_ffn_forward
from .core.precision import lookup as _lookup_precision
from .core.precision import resolve as _resolve_precision

# the tensor-parallel names are defined in cupyffn/_torch_parallel.py and imported at the end of this module
__all__ = ["GeluFFN", "GeluFFNFunction", "gelu_ffn", "gelu_ffn_backward", "replace_mlps",
           "TensorParallelGeluFFN", "TensorParallelGeluFFNFunction", "shard_weights", "tensor_parallel_gelu_ffn"]

SAVE_MODES = ("all", "linear1_out")


# torch's current raw stream without building a torch.cuda.Stream object per call (the call inductor's
# generated code makes); the public spelling where this torch lacks it
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
if _raw_stream is None:  # pragma: no cover
    def _raw_stream(index):
        return int(torch.cuda.current_stream(index).cuda_stream)
_F32 = torch.float32
_cupy = None  # the cupy module, imported on the first CUDA call
_get_device = None  # cupy.cuda.runtime.getDevice, bound with it
_last_stream = (None, None, None)  # (raw pointer, device index, CuPy stream) of the previous call


def _cupy_stream(device):
    """torch's current stream on `device` as a CuPy stream that does not own it (call with `device` current)."""
    return _cuda_stream(device.index)


def _cuda_stream(index):
    """_cupy_stream by device index; the previous call's stream object is kept, so a training loop on one stream
    queries one pointer and compares it (no key tuple, no dict lookup)."""
    global _last_stream
    ptr = _raw_stream(index)
    last = _last_stream
    if last[0] == ptr and last[1] == index:
        return last[2]
    stream = _views.external_stream(ptr, index)
    _last_stream = (ptr, index, stream)
    return stream


def _readable(tensor):
    """`tensor`, or a contiguous copy where cupyffn cannot read its layout.

    cupyffn reads any tensor whose last dimension is unit-stride and whose leading dimensions flatten to
    one row stride (C-contiguous tensors, slices of rows or columns of one); anything else (a transpose,
    an expanded gradient) is copied with ``.contiguous()``.
    """
    if tensor.is_contiguous():  # the common case, decided in C++
        return tensor
    if tensor.dim() == 0 or tensor.numel() == 0:
        return tensor
    strides = tuple(4 * s for s in tensor.stride())
    if _arrays.row_stride(tuple(tensor.shape), strides, 4) is None:
        return tensor.contiguous()
    return tensor


def _check_tensors(named):
    """float32 torch tensors on one CPU or CUDA device; returns that device."""
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__module__}.{type(t).__name__}")
        if t.dtype != _F32:
            raise TypeError(f"{name} must be float32 (cupyffn computes in float32; under torch.autocast the inputs "
                            f"are cast to float32 for you); got {t.dtype}")
    device = named[0][1].device
    for name, t in named:
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} is on {t.device}; cupyffn.torch runs CPU and CUDA tensors")
        if t.device != device:
            raise ValueError(f"all tensors must be on one device; {named[0][0]} is on {device} but {name} is on "
                             f"{t.device}")
    return device


class _Call:
    """How a call reaches cupyffn on `device`: the arrays to pass and the stream (None on the CPU)."""

    __slots__ = ("device", "cuda", "index", "stream", "_switch")

    def __init__(self, device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.index = device.index

    def __enter__(self):
        global _cupy, _get_device
        self._switch = None
        self.stream = None
        if self.cuda:
            if _get_device is None:
                import cupy

                _cupy, _get_device = cupy, cupy.cuda.runtime.getDevice
            index = self.index
            if _get_device() != index:
                self._switch = _cupy.cuda.Device(index)
                self._switch.__enter__()
            self.stream = _cuda_stream(index)
        return self

    def __exit__(self, *exc):
        if self._switch is not None:
            self._switch.__exit__(*exc)
        return False

    def arg(self, tensor):
        """What cupyffn gets for `tensor`: a CuPy view on CUDA (no DLPack import, owns nothing: cupyffn._views),
        a NumPy view on the CPU. (The backward hands CUDA tensors over as they are: _backward_impl.)"""
        if tensor is None:
            return None
        if self.cuda:
            return _views.float32_view(tensor.data_ptr(), tensor.shape, tensor.stride(), self.index)
        return tensor.detach().numpy()

    def empty(self, shape):
        return torch.empty(shape, dtype=_F32, device=self.device)

    def like(self, tensor):
        """A new C-contiguous tensor of `tensor`'s shape and dtype (float32 here); cheaper than empty()."""
        return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def _precision_name(precision):
    """The checked name of `precision`, or None (the default of the tensors' device, decided per call)."""
    return None if precision is None else _lookup_precision(precision).name


def _device_default(tensor):
    """The name of the default precision for `tensor`'s device: "ieee" on the CPU, "fp16+fp8" on CUDA
    (cupyffn/_precision.py CPU_DEFAULT, DEFAULT); a non-tensor gets the GPU's and fails its own checks later."""
    cpu = isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"
    return _resolve_precision(None, cpu=cpu).name


def _check_save(save):
    if save not in SAVE_MODES:
        raise ValueError(f"save must be one of {', '.join(repr(s) for s in SAVE_MODES)}; got {save!r}")
    return save


# ---------------------------------------------------------------------- the implementation
# One implementation of each pass; two entry points call it: the custom operators (what torch.compile,
# export and fake tensors see) and, in plain eager mode, the autograd.Function _EagerGeluFFN (no dispatcher).
_NOTHING = (0,)  # shape of the placeholder a not-needed gradient is returned as (ops cannot return None)


def _forward_impl(hidden_states, weight1, weight2, precision):
    """(output, linear1_out, tanh_inner, gelu_out), all allocated by torch and written by cupyffn (out=)."""
    device = _check_tensors((("hidden_states", hidden_states), ("weight1", weight1), ("weight2", weight2)))
    x, w1, w2 = _readable(hidden_states), _readable(weight1), _readable(weight2)
    lead = tuple(x.shape[:-1]) if x.dim() else ()
    hidden = w1.shape[0] if w1.dim() == 2 else 0
    with _Call(device) as call:
        outs = None
        if x.dim() >= 1 and w1.dim() == 2:  # else cupyffn raises the shape error
            outs = (call.empty(lead + (x.shape[-1],)),) + tuple(call.empty(lead + (hidden,)) for _ in range(3))
        arg = call.arg
        _gelu_ffn_forward(arg(x), arg(w1), arg(w2), precision=precision,
                          out=None if outs is None else [arg(o) for o in outs], stream=call.stream)
    return outs


def _backward_impl(grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner, gelu_out, precision,
                   need_grad_hidden, need_weight_grads):
    """(grad_hidden_states, grad_weight1, grad_weight2); one not needed is None."""
    # the saved inputs are the caller's tensors, as the forward got them: the same layouts are copied again
    dy, x, w1, w2 = _readable(grad_output), _readable(hidden_states), _readable(weight1), _readable(weight2)
    with _Call(x.device) as call:
        like = call.like
        gx = like(x) if need_grad_hidden else None
        gw1 = like(w1) if need_weight_grads else None
        gw2 = like(w2) if need_weight_grads else None
        if call.cuda:
            # The tensors as they are: cupyffn's signature reads them by pointer (cupyffn/_arrays.py), which costs
            # less than ten call.arg views read again by the signature; the stream it follows is call.stream.
            _gelu_ffn_backward(dy, x, w1, w2, linear1_out, tanh_inner, gelu_out, precision=precision,
                               out=(gx, gw1, gw2), stream=call.stream, need_grad_hidden=need_grad_hidden,
                               need_weight_grads=need_weight_grads)
        else:
            arg = call.arg
            _gelu_ffn_backward(arg(dy), arg(x), arg(w1), arg(w2), arg(linear1_out), arg(tanh_inner),
                               arg(gelu_out), precision=precision, out=[arg(gx), arg(gw1), arg(gw2)],
                               need_grad_hidden=need_grad_hidden, need_weight_grads=need_weight_grads)
    return gx, gw1, gw2


def _save(ctx, inputs, output):
    """What the backward keeps (both entry points)."""
    x, w1, w2, precision, save = inputs
    _, z, t, g = output
    ctx.precision = precision
    if save == "all":
        ctx.save_for_backward(x, w1, w2, z, t, g)
    else:  # memory mode: tanh_inner and gelu_out are recomputed from z inside the backward's kernels
        ctx.save_for_backward(x, w1, w2, z)


def _gradients(ctx, grad_output, backward):
    """Gradients of (hidden_states, weight1, weight2, precision, save) by `backward` (the backward operator or
    _backward_impl: both return placeholders or None for what is not needed, dropped here)."""
    need_x, need_w1, need_w2 = ctx.needs_input_grad[:3]
    need_weights = need_w1 or need_w2
    if not (need_x or need_weights):
        return None, None, None, None, None
    saved = ctx.saved_tensors
    if len(saved) == 6:
        x, w1, w2, z, t, g = saved
    else:  # memory mode
        (x, w1, w2, z), t, g = saved, None, None
    if grad_output.dtype is not _F32:  # a hook changed it; the math is float32 anyway
        grad_output = grad_output.float()
    grad_x, grad_w1, grad_w2 = backward(grad_output, x, w1, w2, z, t, g, ctx.precision, need_x, need_weights)
    return (grad_x if need_x else None, grad_w1 if need_w1 else None, grad_w2 if need_w2 else None, None, None)


# ---------------------------------------------------------------------- the operators
@torch.library.custom_op("cupyffn::forward", mutates_args=())
def _forward_op(hidden_states: torch.Tensor, weight1: torch.Tensor, weight2: torch.Tensor, precision: str,
                save: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, linear1_out, tanh_inner, gelu_out); `save` only matters to the autograd formula."""
    return _forward_impl(hidden_states, weight1, weight2, precision)


@_forward_op.register_fake
def _forward_fake(hidden_states, weight1, weight2, precision, save):
    # the checks the real op makes first, so a compiled graph fails at trace time as eager does
    _check_tensors((("hidden_states", hidden_states), ("weight1", weight1), ("weight2", weight2)))
    if hidden_states.dim() < 1 or weight1.dim() != 2:
        raise ValueError(f"hidden_states must be [..., dim] and weight1 [hidden_dim, dim]; got "
                         f"{tuple(hidden_states.shape)} and {tuple(weight1.shape)}")
    lead = tuple(hidden_states.shape[:-1])
    hidden = weight1.shape[0]
    return (hidden_states.new_empty(tuple(hidden_states.shape), dtype=_F32),) + tuple(
        hidden_states.new_empty(lead + (hidden,), dtype=_F32) for _ in range(3))


@torch.library.custom_op("cupyffn::backward", mutates_args=())
def _backward_op(grad_output: torch.Tensor, hidden_states: torch.Tensor, weight1: torch.Tensor,
                 weight2: torch.Tensor, linear1_out: torch.Tensor, tanh_inner: Optional[torch.Tensor],
                 gelu_out: Optional[torch.Tensor], precision: str, need_grad_hidden: bool,
                 need_weight_grads: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden_states, grad_weight1, grad_weight2); one not needed is an empty [0] tensor."""
    out = _backward_impl(grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner, gelu_out, precision,
                         need_grad_hidden, need_weight_grads)
    return tuple(o if o is not None else torch.empty(_NOTHING, dtype=_F32, device=hidden_states.device)
                 for o in out)


@_backward_op.register_fake
def _backward_fake(grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner, gelu_out, precision,
                   need_grad_hidden, need_weight_grads):
    def empty(shape, needed):
        return hidden_states.new_empty(tuple(shape) if needed else _NOTHING, dtype=_F32)

    return (empty(hidden_states.shape, need_grad_hidden), empty(weight1.shape, need_weight_grads),
            empty(weight2.shape, need_weight_grads))


def _autograd_backward(ctx, grad_output, *unused_grads):
    """The forward operator's autograd formula; the other forward results are internal (no gradient)."""
    return _gradients(ctx, grad_output, _backward_op)


_forward_op.register_autograd(_autograd_backward, setup_context=_save)
for _device_type in ("cuda", "cpu"):
    torch.library.register_autocast("cupyffn::forward", _device_type, _F32)
del _device_type


# ---------------------------------------------------------------------- the eager entry point
class _EagerGeluFFN(torch.autograd.Function):
    """The layer in plain eager mode: the same _forward_impl / _backward_impl as the operators, without the
    custom-op dispatcher (autograd_impl, redispatch, the dynamo-disable wrapper, the backend lookup) whose
    Python layers cost more host time per call than the body."""

    @staticmethod
    def forward(ctx, hidden_states, weight1, weight2, precision, save):
        output = _forward_impl(hidden_states, weight1, weight2, precision)
        _save(ctx, (hidden_states, weight1, weight2, precision, save), output)
        return output[0]  # linear1_out, tanh_inner, gelu_out: saved (or freed in memory mode), not outputs

    @staticmethod
    def backward(ctx, grad_output):
        # No double backward (as the operator: no formula for it): once_differentiable. Its wrapper runs the body
        # under torch.no_grad() and then, where grad mode is on (create_graph=True), marks the results so that
        # differentiating them raises; where grad mode is already off, as in every backward without create_graph,
        # both steps do nothing, so the body is called directly (one grad-mode query instead of a no_grad context).
        if _grad_enabled():
            return _backward_once(ctx, grad_output)
        return _gradients(ctx, grad_output, _backward_impl)


_grad_enabled = torch.is_grad_enabled
_backward_once = torch.autograd.function.once_differentiable(
    lambda ctx, grad_output: _gradients(ctx, grad_output, _backward_impl))


# The eager Function runs only when nothing is tracing or intercepting torch calls; otherwise the operators.
# torch.compile and torch.export (strict) trace through dynamo, where torch.compiler.is_compiling() is True
# (documented: "traced as part of torch.compile() or torch.export()"); inductor and AOT autograd then see the
# operators dynamo recorded, never this Python. Non-strict export, make_fx, opcheck and FakeTensorMode run
# under a torch dispatch mode (or hand us FakeTensor / FunctionalTensor subclasses); torch.func transforms
# wrap tensors in functorch layers: each case is checked below and takes the operators, which are right in
# every mode (the Function is only a faster route to the same implementation).
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: How many layer calls took each entry point (tests read it; one integer add per call).
entry_counts = {"eager": 0, "operator": 0}


def _eager(x, weight1, weight2):
    if (torch.compiler.is_compiling() or _dispatch_modes is None or _functorch_active is None
            or type(x) not in _PLAIN or type(weight1) not in _PLAIN or type(weight2) not in _PLAIN):
        return False
    return not _dispatch_modes() and not _functorch_active()


def _autocast_float32(t, device_type):
    """torch.library.register_autocast's cast for one input: floating, on the autocast device, not float64."""
    if (isinstance(t, torch.Tensor) and t.dtype != _F32 and t.is_floating_point() and t.dtype != torch.float64
            and t.device.type == device_type):
        return t.to(_F32)
    return t


def _layer(x, weight1, weight2, precision, save):
    """The differentiable block through the eager Function or the operators (see _eager); checked arguments."""
    if precision is None:  # the default of x's device (static under torch.compile: the operators get a name)
        precision = _device_default(x)
    if _eager(x, weight1, weight2):
        entry_counts["eager"] += 1
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):  # as the operator's autocast rule: compute in float32
            x, weight1, weight2 = (_autocast_float32(t, device_type) for t in (x, weight1, weight2))
        return _EagerGeluFFN.apply(x, weight1, weight2, precision, save)
    if not torch.compiler.is_compiling():  # a counter update in a traced graph would be a side effect
        entry_counts["operator"] += 1
    return torch.ops.cupyffn.forward(x, weight1, weight2, precision, save)[0]


# ---------------------------------------------------------------------- public API
class GeluFFNFunction:
    """``output = gelu_tanh(hidden_states @ weight1.T) @ weight2.T`` with cupyffn's forward and backward.

    ``GeluFFNFunction.apply(hidden_states, weight1, weight2, precision, save)`` (kept for code written
    against the earlier ``torch.autograd.Function``; it is ``gelu_ffn``):

    * hidden_states ``[..., D]``, weight1 ``[H, D]``, weight2 ``[D, H]``: float32, one CPU or CUDA device.
      A tensor whose layout cupyffn cannot read (last dimension not unit-stride, or leading dimensions
      that do not flatten to one row stride, e.g. ``weight.t()``) is copied with ``.contiguous()``;
      every other tensor is passed as it is (zero-copy).
    * precision: ``"fp16+fp8"``, ``"bf16x3"``, ``"ieee"``, ``"tf32"`` or ``"bf16"`` (``cupyffn.PRECISIONS``), or
      None (the default): the tensors' device's default, ``"fp16+fp8"`` on CUDA and ``"ieee"`` (plain fp32,
      the fastest on the CPU) on the CPU; the others remain valid on the CPU, reproducing the GPU's numerics.
    * save: what is kept for the backward. ``"all"``: hidden_states, the weights, linear1_out
      (``z = x @ weight1.T``), tanh_inner and gelu_out (3 x [..., H] floats). ``"linear1_out"``
      (memory mode): hidden_states, the weights and z only; the backward recomputes tanh_inner and
      gelu_out from z inside its kernels (same results within the contract). The forward computes all
      three either way; in memory mode tanh_inner and gelu_out are freed when it returns.

    The backward runs ``cupyffn.gelu_ffn_backward`` with ``need_grad_hidden`` / ``need_weight_grads``
    from ``ctx.needs_input_grad`` (a weight gradient that is computed but not needed is dropped).
    """

    @staticmethod
    def apply(hidden_states, weight1, weight2, precision=None, save="all"):
        return gelu_ffn(hidden_states, weight1, weight2, precision, save)


def gelu_ffn(x, weight1, weight2, precision=None, save="all"):
    """``gelu_tanh(x @ weight1.T) @ weight2.T`` (no biases), differentiable; see ``GeluFFNFunction``.

    x ``[..., D]``, weight1 ``[H, D]``, weight2 ``[D, H]`` (``[out_features, in_features]``), float32 on one
    CPU or CUDA device (any floating dtype under ``torch.autocast``: cast to float32). Returns a ``[..., D]``
    float32 tensor. Traceable by ``torch.compile`` (``fullgraph=True``) and capturable in CUDA graphs.
    """
    return _layer(x, weight1, weight2, _precision_name(precision), _check_save(save))


def gelu_ffn_backward(grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner=None, gelu_out=None,
                      precision=None, need_grad_hidden=True, need_weight_grads=True):
    """The layer's backward as eager autograd runs it, without autograd: (grad_hidden_states, grad_weight1,
    grad_weight2), None for what is not needed; new float32 tensors from torch, on torch's current stream.

    The tensors are float32 on one CPU or CUDA device; linear1_out, tanh_inner, gelu_out as
    ``cupyffn.gelu_ffn_backward`` takes them (None for tanh_inner and gelu_out: memory mode); precision as in
    ``GeluFFNFunction`` (None: the default of the tensors' device). Not traceable
    by torch.compile (``torch.ops.cupyffn.backward`` is the traceable operator, with placeholders in place
    of None).
    """
    precision = _device_default(hidden_states) if precision is None else _lookup_precision(precision).name
    return _backward_impl(grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner, gelu_out,
                          precision, need_grad_hidden, need_weight_grads)


from .frameworks.torch_layer import GeluFFN, replace_mlps  # noqa: E402,F401 (the layer, the converters: cupyffn/_torch_lt.py)
from .frameworks.torch_parallel import TensorParallelGeluFFN, TensorParallelGeluFFNFunction, shard_weights, tensor_parallel_gelu_ffn  # parallelism, cupyffn/_torch_parallel.py)
