"""The torch operators: ``torch.ops.cupyffn.forward`` and ``torch.ops.cupyffn.backward``, one pair for every
configuration of the block (float32, bfloat16 or float16 activations; fp32 master or 16-bit weights, [out, in] or
transposed [in, out] views; biases or not; every precision), with fake (meta) implementations and an autograd
formula, so ``torch.compile(fullgraph=True)`` traces any model using them without a graph break, and
``mode="reduce-overhead"`` / ``torch.cuda.graph`` capture them. Their bodies (`forward_impl`, `backward_impl`) call
cupyffn's front door (cupyffn/api/functional.py) with torch-allocated outputs as out=, on torch's current stream,
CUDA tensors read by pointer, CPU tensors as NumPy views (the route table then runs "ieee" and 16-bit activations on
torch's own ops, cupyffn/cpu/torch_route.py, the other precisions on the NumPy backend). The eager entry point
`EagerGeluFFN` runs the same bodies through a plain autograd.Function, without the custom-op dispatcher's Python
layers.

Schemas (the activation dtype is hidden_states'; the layers cast the input to it, cupyffn/frameworks/torch_layer.py):

    forward(hidden_states, weight1, weight2, bias1?, bias2?, precision?, save) -> (output, linear1_out, tanh_inner,
        gelu_out, weight1_cast, weight2_cast)
                                          tanh_inner: a [0] placeholder for 16-bit activations (recomputed later);
                                          weight*_cast: fp32 master weights in the 16-bit activation dtype (CUDA),
                                          made once per step here and reused by the backward, else [0] placeholders
    backward(grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner?, gelu_out?, precision?,
        need_grad_hidden, need_weight_grads, need_bias_grads, weight1_cast?, weight2_cast?) -> (grad_hidden_states,
        grad_weight1, grad_weight2, grad_bias1, grad_bias2)
                                          [0] placeholders for what is not needed; weight and bias gradients in the
                                          weights' dtype (fp32 master weights: fp32, straight from the GEMMs) and,
                                          for [in, out] weights on the cuBLASLt route, in their layout (no copy)
"""

from typing import Optional, Tuple

import torch

from ..api import functional as _functional
from ..api.validate import Request
from ..core import arrays as _arrays
from ..core import rules as _rules
from ..core import views as _views
from ..core.precision import checked_name as _checked_name

SAVE_MODES = ("all", "linear1_out")
HALF = (torch.bfloat16, torch.float16)
_F32 = torch.float32
_NOTHING = (0,)  # the shape of a placeholder (operators cannot return None)

# torch's current raw stream without building a torch.cuda.Stream object per call (the call inductor's generated
# code makes); the public spelling where this torch lacks it
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
if _raw_stream is None:  # pragma: no cover
    def _raw_stream(index):
        return int(torch.cuda.current_stream(index).cuda_stream)
_cupy = None  # the cupy module, imported on the first CUDA call
_get_device = None  # cupy.cuda.runtime.getDevice, bound with it
_last_stream = (None, None, None)  # (raw pointer, device index, CuPy stream) of the previous call


def cuda_stream(index):
    """torch's current stream on CUDA device `index` as a CuPy stream that does not own it (call with that device
    current in CuPy); the previous call's object is kept, so a training loop on one stream compares one pointer."""
    global _last_stream
    ptr = _raw_stream(index)
    last = _last_stream
    if last[0] == ptr and last[1] == index:
        return last[2]
    stream = _views.external_stream(ptr, index)
    _last_stream = (ptr, index, stream)
    return stream


class TorchDevice:
    """A torch device as cupyffn runs on it, as a context: CuPy's current device switched to it and torch's current
    stream as a CuPy stream (None on the CPU); `arg` is what cupyffn gets for a tensor, `empty` allocates with torch."""

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
            if _get_device() != self.index:
                self._switch = _cupy.cuda.Device(self.index)
                self._switch.__enter__()
            self.stream = cuda_stream(self.index)
        return self

    def __exit__(self, *exc):
        if self._switch is not None:
            self._switch.__exit__(*exc)
        return False

    def arg(self, tensor):
        """What cupyffn gets for `tensor`: the tensor itself on CUDA (read by pointer, cupyffn/core/arrays.py), a
        NumPy view on the CPU (bfloat16 through ml_dtypes' type, which NumPy lacks)."""
        if tensor is None or self.cuda:
            return tensor
        return _views.numpy_view(tensor)

    def empty(self, shape, dtype=_F32):
        return torch.empty(shape, dtype=dtype, device=self.device)


def check_save(save):
    if save not in SAVE_MODES:
        raise ValueError(f"save must be one of {', '.join(repr(s) for s in SAVE_MODES)}; got {save!r}")
    return save


def check_tensors(named, dtype=_F32):
    """Torch tensors of `dtype` (None: any) on one CPU or CUDA device; returns that device."""
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__module__}.{type(t).__name__}")
        if dtype is not None and t.dtype != dtype:
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


def _row_strided(t):
    return t.is_contiguous() or t.dim() == 0 or t.numel() == 0 or _arrays.row_stride(
        tuple(t.shape), tuple(t.element_size() * s for s in t.stride()), t.element_size()) is not None


def readable(tensor):
    """`tensor`, or a contiguous copy where cupyffn cannot read its layout (a last dimension that is not
    unit-stride, or leading dimensions that do not flatten to one row stride, e.g. an expanded gradient)."""
    return tensor if _row_strided(tensor) else tensor.contiguous()


def _transposed(t):
    """`t` is the transpose of a row-strided matrix (transformers' Conv1D weight used as [out, in])."""
    # its transpose is C-contiguous: strides (1, rows); read from the strides, no view made (a per-call cost)
    return t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1 and t.stride() == (1, t.shape[0])


def weights(w1, w2, act, device):
    """The weights as cupyffn reads them: transposed views of [in, out] storage are kept on the cuBLASLt route (16-bit
    activations on CUDA) and on the CPU, copied contiguous for the float32 GPU engine (its conversions read rows)."""
    keep = _transposed(w1) and _transposed(w2) and (act in HALF or device.type == "cpu")
    if keep:
        return w1, w2
    return readable(w1), readable(w2)


def _bias(b, act):
    """A bias as cupyffn takes it beside 16-bit weights: float32 or the activation dtype as it is, else cast."""
    return b if b is None or b.dtype is _F32 or b.dtype == act else b.to(act)


def casts_weights(x, w1):
    """Whether the forward makes the weights' 16-bit copies: fp32 master weights with 16-bit activations on CUDA
    (autocast's case). They are returned and saved, so the backward reuses them: one conversion per step."""
    return x.dtype in HALF and w1.dtype is _F32 and x.device.type == "cuda"


def grads_transposed(x, w1, w2):
    """Whether the weight gradients are written in the weights' [in, out] layout: transposed weights on the cuBLASLt
    route (16-bit activations on CUDA), whose GEMMs write either layout at the same cost; the parameter's gradient
    is then its own layout, and autograd copies nothing."""
    return x.dtype in HALF and x.device.type == "cuda" and _transposed(w1) and _transposed(w2)


def weight_grad(w, dtype, transposed, device):
    """An empty gradient for weight `w` in `dtype`: [in, out] storage seen as w's shape where `transposed`."""
    if transposed:
        return torch.empty(tuple(w.shape[::-1]), dtype=dtype, device=device).t()
    return torch.empty(tuple(w.shape), dtype=dtype, device=device)


# ---------------------------------------------------------------------- the bodies
def forward_impl(x, w1, w2, b1, b2, precision):
    """(output, linear1_out, tanh_inner, gelu_out, weight1_cast, weight2_cast) in x's dtype (tanh_inner a placeholder
    for 16-bit x; the casts placeholders unless `casts_weights`), allocated by torch and written by cupyffn (out=: on
    the CPU by the route table's torch row where torch's numerics are the precision's). precision: a checked name or
    None (float32 x: the device's default, resolved by the door), None for 16-bit."""
    act = x.dtype
    x = readable(x)
    w1, w2 = weights(w1, w2, act, x.device)
    if casts_weights(x, w1):  # torch's cast kernel keeps the [in, out] layout of transposed weights
        w1c, w2c = w1.to(act), w2.to(act)
        # fp32 master biases go as they are: the engine rounds them inside its call (its graph), no cast launched here
        w1, w2, b1, b2 = w1c, w2c, _bias(b1, act), _bias(b2, act)
    else:
        w1c, w2c = x.new_empty(_NOTHING), x.new_empty(_NOTHING)  # two: an operator's outputs may not alias
    lead, dim, hidden = tuple(x.shape[:-1]), x.shape[-1], w1.shape[0]
    with TorchDevice(x.device) as dev:
        y, z, g = dev.empty(lead + (dim,), act), dev.empty(lead + (hidden,), act), dev.empty(lead + (hidden,), act)
        t = dev.empty(lead + (hidden,), act) if act is _F32 else dev.empty(_NOTHING, act)
        arg = dev.arg
        _functional.run(Request("forward", _checked_name(precision), torch_layer=not dev.cuda),
                        (arg(x), arg(w1), arg(w2), arg(b1), arg(b2)),
                        [arg(y), arg(z), arg(t) if act is _F32 else None, arg(g)], dev.stream)
    return y, z, t, g, w1c, w2c


def backward_impl(dy, x, w1, w2, z, t, g, precision, need_x, need_w, need_b, w1c=None, w2c=None):
    """(grad_hidden_states, grad_weight1, grad_weight2, grad_bias1, grad_bias2), None where not needed. w1c, w2c: the
    forward's 16-bit copies of fp32 master weights w1, w2 (None or placeholders: none), multiplied in their place;
    the gradients keep the masters' dtype (and layout: `grads_transposed`)."""
    act = x.dtype
    dy = readable(dy if dy.dtype is act else dy.to(act))
    x = readable(x)  # the forward's input as saved: a layout the forward copied (a transposed x) is copied again
    wt, flip = w1.dtype, grads_transposed(x, w1, w2)
    if w1c is not None and w1c.dim() == 2:
        w1, w2 = w1c, w2c
    w1, w2 = weights(w1, w2, act, x.device)
    with TorchDevice(x.device) as dev:
        gx = dev.empty(tuple(x.shape), act) if need_x else None
        gw1 = weight_grad(w1, wt, flip, x.device) if need_w else None
        gw2 = weight_grad(w2, wt, flip, x.device) if need_w else None
        gb1 = dev.empty((w1.shape[0],), wt) if need_b else None
        gb2 = dev.empty((w2.shape[0],), wt) if need_b else None
        grads = (gx, gw1, gw2, gb1, gb2)
        arg = dev.arg
        _functional.run(Request("backward", _checked_name(precision), need_x, need_w, need_b,
                                torch_layer=not dev.cuda),
                        (arg(dy), arg(x), arg(w1), arg(w2), arg(z), arg(t), arg(g)),
                        [arg(o) for o in (grads if need_b else grads[:3])], dev.stream)
    return grads


# ---------------------------------------------------------------------- the operators
def _dtypes(tensors):
    """The dtype names of `tensors` (None kept) for cupyffn/core/rules.py."""
    return tuple(None if t is None else _arrays.dtype_name(t) for t in tensors)


def _shapes(tensors):
    """The shapes of `tensors` (None kept) as tuples, for cupyffn/core/rules.py."""
    return tuple(None if t is None else tuple(t.shape) for t in tensors)


@torch.library.custom_op("cupyffn::forward", mutates_args=())
def forward_op(hidden_states: torch.Tensor, weight1: torch.Tensor, weight2: torch.Tensor,
               bias1: Optional[torch.Tensor], bias2: Optional[torch.Tensor], precision: Optional[str],
               save: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, linear1_out, tanh_inner, gelu_out, weight1_cast, weight2_cast); `save` only matters to the autograd
    formula."""
    return forward_impl(hidden_states, weight1, weight2, bias1, bias2, precision)


@forward_op.register_fake
def _forward_fake(hidden_states, weight1, weight2, bias1, bias2, precision, save):
    tensors = (hidden_states, weight1, weight2, bias1, bias2)
    _rules.check("forward", _dtypes(tensors), _shapes(tensors), precision)  # the door's errors, at trace time
    act = hidden_states.dtype
    lead, hidden = tuple(hidden_states.shape[:-1]), weight1.shape[0]
    inner = lead + (hidden,) if act is _F32 else _NOTHING
    if casts_weights(hidden_states, weight1):
        casts = (torch.empty_like(weight1, dtype=act), torch.empty_like(weight2, dtype=act))  # strides kept, as .to
    else:
        casts = (hidden_states.new_empty(_NOTHING), hidden_states.new_empty(_NOTHING))
    return (hidden_states.new_empty(tuple(hidden_states.shape)), hidden_states.new_empty(lead + (hidden,)),
            hidden_states.new_empty(inner), hidden_states.new_empty(lead + (hidden,))) + casts


@torch.library.custom_op("cupyffn::backward", mutates_args=())
def backward_op(grad_output: torch.Tensor, hidden_states: torch.Tensor, weight1: torch.Tensor,
                weight2: torch.Tensor, linear1_out: torch.Tensor, tanh_inner: Optional[torch.Tensor],
                gelu_out: Optional[torch.Tensor], precision: Optional[str], need_grad_hidden: bool,
                need_weight_grads: bool, need_bias_grads: bool, weight1_cast: Optional[torch.Tensor] = None,
                weight2_cast: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                      torch.Tensor, torch.Tensor]:
    """(grad_hidden_states, grad_weight1, grad_weight2, grad_bias1, grad_bias2); one not needed is an empty [0]."""
    grads = backward_impl(grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner, gelu_out, precision,
                          need_grad_hidden, need_weight_grads, need_bias_grads, weight1_cast, weight2_cast)
    dtypes = (hidden_states.dtype,) + (weight1.dtype,) * 4  # the fake's dtypes, placeholders too
    return tuple(g if g is not None else hidden_states.new_empty(_NOTHING, dtype=d) for g, d in zip(grads, dtypes))


@backward_op.register_fake
def _backward_fake(grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner, gelu_out, precision,
                   need_grad_hidden, need_weight_grads, need_bias_grads, weight1_cast=None, weight2_cast=None):
    # the door's shape rules, at trace time; the dtypes are the body's to arrange (it casts grad_output to the
    # activation dtype and multiplies the forward's weight casts)
    _rules.check_needs(need_grad_hidden, need_weight_grads, need_bias_grads)
    _rules.check_shapes("backward", _shapes((grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner,
                                             gelu_out)))
    _rules.check_precision(_arrays.dtype_name(hidden_states), precision)
    wt = weight1.dtype

    def empty(shape, needed, dtype=wt):
        return hidden_states.new_empty(tuple(shape) if needed else _NOTHING, dtype=dtype)

    def weight(w):
        if not need_weight_grads:
            return empty(w.shape, False)
        return weight_grad(w, wt, grads_transposed(hidden_states, weight1, weight2), hidden_states.device)

    return (empty(hidden_states.shape, need_grad_hidden, hidden_states.dtype), weight(weight1), weight(weight2),
            empty((weight1.shape[0],), need_bias_grads), empty((weight2.shape[0],), need_bias_grads))


def _save(ctx, inputs, output):
    """What the backward keeps (both entry points): `save` "all" keeps the saved activations, "linear1_out" only
    the pre-activation (memory mode: the backward recomputes the rest inside its kernels)."""
    x, w1, w2, b1, b2, precision, save = inputs
    _, z, t, g, w1c, w2c = output
    ctx.precision = precision
    ctx.bias_dtypes = (None if b1 is None else b1.dtype, None if b2 is None else b2.dtype)
    keep, cast = save == "all", casts_weights(x, w1)
    ctx.save_for_backward(x, w1, w2, z, t if keep and x.dtype is _F32 else None, g if keep else None,
                          w1c if cast else None, w2c if cast else None)


def _gradients(ctx, grad_output, backward):
    """Gradients of (hidden_states, weight1, weight2, bias1, bias2, precision, save) by `backward` (the operator or
    backward_impl: placeholders or None for what is not needed, dropped here)."""
    need_x, need_w1, need_w2, need_b1, need_b2 = ctx.needs_input_grad[:5]
    need_w, need_b = need_w1 or need_w2, need_b1 or need_b2
    if not (need_x or need_w or need_b):
        return (None,) * 7
    x, w1, w2, z, t, g, w1c, w2c = ctx.saved_tensors
    gx, gw1, gw2, gb1, gb2 = backward(grad_output, x, w1, w2, z, t, g, ctx.precision, need_x, need_w, need_b, w1c,
                                      w2c)
    b1_dt, b2_dt = ctx.bias_dtypes
    if need_b1 and gb1.dtype != b1_dt:
        gb1 = gb1.to(b1_dt)
    if need_b2 and gb2.dtype != b2_dt:
        gb2 = gb2.to(b2_dt)
    return (gx if need_x else None, gw1 if need_w1 else None, gw2 if need_w2 else None, gb1 if need_b1 else None,
            gb2 if need_b2 else None, None, None)


def _operator_backward(ctx, grad_output, *unused_grads):
    """The forward operator's autograd formula; the other forward results are internal (no gradient)."""
    return _gradients(ctx, grad_output, backward_op)


forward_op.register_autograd(_operator_backward, setup_context=_save)


# ---------------------------------------------------------------------- the eager entry point
class EagerGeluFFN(torch.autograd.Function):
    """The operators' bodies in plain eager mode, without the custom-op dispatcher (autograd_impl, redispatch, the
    dynamo-disable wrapper, the backend lookup), whose Python layers cost more host time per call than the body."""

    @staticmethod
    def forward(ctx, x, w1, w2, b1, b2, precision, save):
        output = forward_impl(x, w1, w2, b1, b2, precision)
        _save(ctx, (x, w1, w2, b1, b2, precision, save), output)
        return output[0]  # linear1_out, tanh_inner, gelu_out: saved (or freed in memory mode), not outputs

    @staticmethod
    def backward(ctx, grad_output):
        # No double backward (as the operator: no formula for it): once_differentiable. Its wrapper runs the body
        # under torch.no_grad() and then, where grad mode is on (create_graph=True), marks the results so that
        # differentiating them raises; where grad mode is already off, as in every backward without create_graph,
        # both steps do nothing, so the body is called directly (one grad-mode query instead of a no_grad context).
        if _grad_enabled():
            return _backward_once(ctx, grad_output)
        return _gradients(ctx, grad_output, backward_impl)


_grad_enabled = torch.is_grad_enabled
_backward_once = torch.autograd.function.once_differentiable(
    lambda ctx, grad_output: _gradients(ctx, grad_output, backward_impl))


# The eager Function runs only when nothing is tracing or intercepting torch calls; otherwise the operators.
# torch.compile and torch.export (strict) trace through dynamo, where torch.compiler.is_compiling() is True;
# inductor and AOT autograd then see the operators dynamo recorded, never this Python. Non-strict export, make_fx,
# opcheck and FakeTensorMode run under a torch dispatch mode (or hand us FakeTensor / FunctionalTensor subclasses);
# torch.func transforms wrap tensors in functorch layers: each case is checked below and takes the operators, which
# are right in every mode (the Function is only a faster route to the same bodies).
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _eager(tensors):
    if torch.compiler.is_compiling() or _dispatch_modes is None or _functorch_active is None:
        return False
    if any(t is not None and type(t) not in _PLAIN for t in tensors):
        return False
    return not _dispatch_modes() and not _functorch_active()


def apply(x, w1, w2, b1, b2, precision, save):
    """The differentiable block through the eager Function or the operators (see _eager); x already in the
    activation dtype, precision a checked name or None (float32 x: the device's default; 16-bit x: always None)."""
    if _eager((x, w1, w2, b1, b2)):
        return EagerGeluFFN.apply(x, w1, w2, b1, b2, precision, save)
    return torch.ops.cupyffn.forward(x, w1, w2, b1, b2, precision, save)[0]
