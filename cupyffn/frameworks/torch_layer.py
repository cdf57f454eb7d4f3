"""The torch layer's route for biases and 16-bit activations (cupyffn/_lt_api.py underneath), and the converters
that put cupyffn in place of a model's MLPs: ``GeluFFN.from_linears`` and ``replace_mlps``.

The autograd Function mirrors what torch's autocast does to ``Linear -> GELU(tanh) -> Linear``: under autocast
the input, weights and biases are cast to the autocast dtype (the casts kept for the backward, as autocast keeps
them), the GEMMs run on those 16-bit operands with fp32 accumulation, and the output is in the autocast dtype.
Gradients come back in the parameters' own dtypes (fp32 master weights get fp32 gradients straight from the
GEMMs' fp32 outputs). Outside autocast the tensors' own dtype decides: bf16/fp16 parameters and input run the
same plan; float32 with biases runs the layer's precision: "ieee" (None; plain fp32 GEMMs with the bias epilogues),
"tf32", or on the float32 engine "bf16x3" / "fp16+fp8" (which also keeps tanh_inner for the backward).
"""

import contextlib
import math

import torch

from ..api.functional import gelu_ffn_backward
from ..api.forward import gelu_ffn_forward
from ..api import lt_api as _lt_api
from ..core import plans as _plan_cache
from ..api.lt_api import ENGINE_BIAS_PRECISIONS, GRADS as _GRADS, _check_precision
from ..lt.engine import LtBackward, LtForward, LtKey

HALF = (torch.bfloat16, torch.float16)


def activation_dtype(x, weight):
    """The dtype the block computes in for input `x` and parameters of dtype `weight.dtype`."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if x.dtype in HALF:
        return x.dtype
    return weight.dtype


def _stream(device):
    """torch's current stream on a CUDA `device` as a CuPy stream (cupyffn.torch's, the last one kept), or None on
    the CPU."""
    if device.type != "cuda":
        return None
    import cupy

    from ..torch import _cuda_stream

    with cupy.cuda.Device(device.index):  # a new stream object is made with its device current
        return _cuda_stream(device.index)


def _arg(t):
    """What the functional API gets for `t`: the tensor itself on CUDA (read by pointer), a NumPy view on the CPU
    (bf16 through ml_dtypes' bfloat16, which NumPy lacks)."""
    if t is None or t.is_cuda:
        return t
    if t.dtype is torch.bfloat16:
        from ..core.views import numpy_dtype

        return t.detach().view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return t.detach().numpy()


def _cast(t, dtype):
    return None if t is None else t.to(dtype).contiguous()


# ---------------------------------------------------------------------- the pointer path
# The layer's own tensors on CUDA go to the cached cuBLASLt plans by pointer: the functional API's argument import,
# signature and checks cost ~0.2 ms of host time per call at small T (docs/decisions/051), and
# every tensor here is one the layer made or checked; a repeated pointer set replays a captured graph
# (cupyffn/_graph_replay.py). A call the path cannot take (CPU tensors, the float32 engine's precisions, zero
# tokens, rows not 16-byte aligned) goes through the functional API, which checks and explains.
_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _run_pointers(backward, key, enqueue, pointers, device, stream_ptr):
    """Enqueue the cached plan of `key` (LtBackward if `backward`, else LtForward) on `stream_ptr` of GPU `device`,
    unchecked (the layer's own tensors): `enqueue(plan, stream_ptr, capturing)`, replayed as a graph per `pointers`
    (cupyffn/_graph_replay.py) except under a caller's capture. Nothing is NaN-filled after a failure (the outputs
    are the layer's temporaries)."""
    import cupy

    plans, build = (_lt_api._backwards, LtBackward) if backward else (_lt_api._forwards, LtForward)
    capturing = _plan_cache.is_capturing(stream_ptr)

    def run(plan):
        if capturing:
            enqueue(plan, stream_ptr, True)
        else:
            plan.replay(pointers, lambda sp, cap: enqueue(plan, sp, cap), stream_ptr)

    with contextlib.nullcontext() if cupy.cuda.runtime.getDevice() == device else cupy.cuda.Device(device):
        _lt_api._run_gpu(plans, key, lambda: build(key), run, lambda: None, None, capturing, "cupyffn.torch.GeluFFN")


def _pointer_path(precision, x, tensors, D, H):
    """Whether a call on `tensors` (None entries skipped) can take the pointer path."""
    if not x.is_cuda or precision in ENGINE_BIAS_PRECISIONS or x.numel() == 0:
        return False
    size = x.element_size()
    return (D * size) % 16 == 0 and (H * size) % 16 == 0 and all(
        t is None or t.data_ptr() % 16 == 0 for t in tensors)


def _pointer_forward(ctx, x, w1, w2, b1, b2, y, z, g):
    act = _NAMES[x.dtype]
    D, H = x.shape[-1], w1.shape[0]
    key = LtKey(x.device.index, x.numel() // D, D, H, act, act, act, b1 is not None, b2 is not None,
                precision=_lt_api._fp32_precision(ctx.precision, act))
    ptrs = [None if t is None else t.data_ptr() for t in (x, w1, w2, b1, b2)]
    outs = (y.data_ptr(), z.data_ptr(), g.data_ptr())
    _run_pointers(False, key, lambda plan, sp, capturing: plan.run(*ptrs, outs, sp, capturing), (*ptrs, *outs),
                  x.device.index, torch.cuda.current_stream(x.device).cuda_stream)


def _pointer_backward(ctx, dy, x, w1, w2, z, g, grads, wt):
    """grads: (grad_hidden_states, grad_weight1, grad_weight2, grad_bias1, grad_bias2), None where not wanted."""
    act = _NAMES[x.dtype]
    D, H = x.shape[-1], w1.shape[0]
    need_b = grads[3] is not None
    key = LtKey(x.device.index, x.numel() // D, D, H, act, act, _NAMES[wt], need_b, need_b, grads[0] is not None,
                grads[1] is not None, g is None, _lt_api._fp32_precision(ctx.precision, act))
    a = {"grad_output": dy.data_ptr(), "hidden_states": x.data_ptr(), "weight1": w1.data_ptr(),
         "weight2": w2.data_ptr(), "linear1_out": z.data_ptr(), "gelu_out": None if g is None else g.data_ptr()}
    out = {n: None if t is None else t.data_ptr() for n, t in zip(_GRADS, grads)}
    _run_pointers(True, key, lambda plan, sp, capturing: plan.run(a, out, sp, capturing, False),
                  (*a.values(), *out.values()), x.device.index, torch.cuda.current_stream(x.device).cuda_stream)


class LtFunction(torch.autograd.Function):
    """``gelu_tanh(x W1^T + b1) W2^T + b2`` in `act` (module docstring); x already in `act`."""

    @staticmethod
    def forward(ctx, x, weight1, weight2, bias1, bias2, act, save, precision):
        w1, w2, b1, b2 = (_cast(t, act) for t in (weight1, weight2, bias1, bias2))
        ctx.precision = precision if act is torch.float32 else None  # 16-bit activations: multiplied as they are
        x = x.contiguous()
        lead, D, H = tuple(x.shape[:-1]), x.shape[-1], w1.shape[0]
        y, z, g = (torch.empty(lead + (n,), dtype=act, device=x.device) for n in (D, H, H))
        # the float32 engine's split precisions also return tanh_inner (the cuBLASLt plans recompute it)
        tanh = torch.empty_like(z) if ctx.precision in ENGINE_BIAS_PRECISIONS else None
        if _pointer_path(ctx.precision, x, (x, w1, w2, b1, b2), D, H):
            _pointer_forward(ctx, x, w1, w2, b1, b2, y, z, g)
        else:
            gelu_ffn_forward(_arg(x), _arg(w1), _arg(w2), bias1=_arg(b1), bias2=_arg(b2), precision=ctx.precision,
                             out=[_arg(y), _arg(z), _arg(tanh), _arg(g)], stream=_stream(x.device))
        kept = save == "all"
        ctx.save_for_backward(x, w1, w2, z, g if kept else None, tanh if kept else None)
        ctx.dtypes = (weight1.dtype, None if bias1 is None else bias1.dtype, None if bias2 is None else bias2.dtype)
        ctx.biased = (bias1 is not None, bias2 is not None)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        x, w1, w2, z, g, t = ctx.saved_tensors
        need_x, need_w1, need_w2, need_b1, need_b2 = ctx.needs_input_grad[:5]
        need_w, need_b = need_w1 or need_w2, need_b1 or need_b2
        wt = ctx.dtypes[0]  # gradients in the parameters' dtype (fp32 master weights: fp32)
        dev = x.device

        def empty(shape, dtype, needed):
            return torch.empty(shape, dtype=dtype, device=dev) if needed else None

        gx = empty(x.shape, x.dtype, need_x)
        gw1, gw2 = empty(w1.shape, wt, need_w), empty(w2.shape, wt, need_w)
        gb1, gb2 = empty((w1.shape[0],), wt, need_b), empty((w2.shape[0],), wt, need_b)
        dy = grad_output.to(x.dtype).contiguous()
        D, H = x.shape[-1], w1.shape[0]
        if _pointer_path(ctx.precision, x, (dy,), D, H):  # the saved tensors passed the forward's checks
            _pointer_backward(ctx, dy, x, w1, w2, z, g, (gx, gw1, gw2, gb1, gb2), wt)
        else:
            out = [_arg(t) for t in (gx, gw1, gw2, gb1, gb2)]
            gelu_ffn_backward(*(_arg(a) for a in (dy, x, w1, w2, z, t, g)), out=out if need_b else out[:3],
                              stream=_stream(dev), need_grad_hidden=need_x, need_weight_grads=need_w,
                              need_bias_grads=need_b, precision=ctx.precision)
        b1_dt, b2_dt = ctx.dtypes[1:]
        gb1 = gb1 if gb1 is None or b1_dt in (None, wt) else gb1.to(b1_dt)
        gb2 = gb2 if gb2 is None or b2_dt in (None, wt) else gb2.to(b2_dt)
        return (gx, gw1 if need_w1 else None, gw2 if need_w2 else None, gb1 if need_b1 else None,
                gb2 if need_b2 else None, None, None, None)


def lt_layer(x, weight1, weight2, bias1, bias2, save, precision=None):
    """The layer's forward through LtFunction (biases, or 16-bit activations); `precision` applies to float32
    activations (None, "ieee", "tf32", "bf16x3" or "fp16+fp8")."""
    act = activation_dtype(x, weight1)
    if act not in HALF + (torch.float32,):
        raise TypeError(f"cupyffn computes in bfloat16, float16 or float32; got {act}")
    return LtFunction.apply(x.to(act), weight1, weight2, bias1, bias2, act, save, precision)


# ---------------------------------------------------------------------- converters
_TANH_GELUS = ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh", "FastGELUActivation")


def _tanh_gelu(act):
    """Whether module `act` is GELU with the tanh approximation, as cupyffn computes it (a reason if not)."""
    if isinstance(act, torch.nn.GELU):
        return None if act.approximate == "tanh" else f"GELU(approximate={act.approximate!r}) (erf GELU)"
    name = type(act).__name__
    if name in _TANH_GELUS and name != "FastGELUActivation":
        return None
    if name == "GELU" and getattr(act, "approximate", None) == "tanh":  # diffusers' GELU (with .proj)
        return None
    return f"activation {name} (cupyffn computes GELU(tanh) only)"


def _no_dropout(*modules):
    for m in modules:
        if m is None or isinstance(m, torch.nn.Identity):
            continue
        if isinstance(m, torch.nn.Dropout):
            if m.p > 0:
                return f"dropout p={m.p} (cupyffn has no dropout; set it to 0 to swap this MLP)"
            continue
        return f"unexpected module {type(m).__name__} in the MLP"
    return None


def _plan(module):
    """(linear1 weight [H, D], bias1, linear2 weight [D, H], bias2, None) for a module replace_mlps knows, with the
    weights as [out, in] tensors (Conv1D's are transposed); or (None, reason)."""
    name = type(module).__name__
    if isinstance(module, torch.nn.Sequential) and len(module) == 3 and all(
            isinstance(module[i], torch.nn.Linear) for i in (0, 2)):
        why = _tanh_gelu(module[1])
        if why:
            return None, why
        return (module[0], module[2]), None
    if name == "FeedForward" and hasattr(module, "net"):  # diffusers: net = [GELU(proj), Dropout, Linear(, Dropout)]
        net = list(module.net)
        if len(net) < 3 or not hasattr(net[0], "proj") or not isinstance(net[2], torch.nn.Linear):
            return None, "a FeedForward whose net is not [GELU(proj), Dropout, Linear]"
        why = _tanh_gelu(net[0]) or _no_dropout(net[1], *net[3:])
        return (None, why) if why else ((net[0].proj, net[2]), None)
    if name in ("GPT2MLP", "GPTBigCodeMLP") and hasattr(module, "c_fc") and hasattr(module, "c_proj"):
        why = _tanh_gelu(module.act) or _no_dropout(getattr(module, "dropout", None))
        return (None, why) if why else ((module.c_fc, module.c_proj), None)
    return None, None


def _as_linear_weights(layer):
    """(weight [out, in], bias) of an nn.Linear or a transformers Conv1D (weight stored [in, out]: copied
    transposed into a new Parameter)."""
    if isinstance(layer, torch.nn.Linear):
        return layer.weight, layer.bias
    if type(layer).__name__ == "Conv1D":
        return torch.nn.Parameter(layer.weight.detach().t().contiguous()), layer.bias
    raise TypeError(f"expected nn.Linear or Conv1D, got {type(layer).__name__}")


def _from_linears(cls, linear1, linear2, **options):
    """A GeluFFN computing ``linear2(gelu_tanh(linear1(x)))`` with these very Parameters (Conv1D weights are
    copied transposed into new Parameters)."""
    w1, b1 = _as_linear_weights(linear1)
    w2, b2 = _as_linear_weights(linear2)
    H, D = w1.shape
    if tuple(w2.shape) != (D, H):
        raise ValueError(f"linear2 must map hidden_dim {H} back to dim {D}; its weight is {tuple(w2.shape)} "
                         f"([out_features, in_features])")
    ffn = cls(D, H, bias=b1 is not None or b2 is not None, device=w1.device, dtype=w1.dtype, _empty=True, **options)
    ffn.weight1, ffn.weight2 = w1, w2
    ffn.bias1, ffn.bias2 = b1, b2
    return ffn


def replace_mlps(model, **options):
    """Swap, in place, every MLP of `model` that cupyffn reproduces exactly for a ``GeluFFN`` holding its weights.

    Recognized: ``nn.Sequential(Linear, GELU(approximate="tanh"), Linear)``, diffusers' ``FeedForward`` with
    activation "gelu-approximate", transformers' ``GPT2MLP`` (``gelu_new``; its Conv1D weights, stored [in, out],
    are copied transposed into new Parameters: build the optimizer after the swap) and ``GPTBigCodeMLP``
    (``gelu_pytorch_tanh``). nn.Linear Parameters are kept (the same objects). `options` go to GeluFFN
    (precision, save).

    Returns ``(replaced, skipped)``: the module names swapped, and {name: reason} for MLP-like modules left
    alone because cupyffn would compute something else (erf GELU, other activations, dropout with p > 0).
    """
    replaced, skipped = [], {}
    for name, module in list(model.named_modules()):
        if any(name.startswith(r + ".") for r in replaced):
            continue
        layers, why = _plan(module)
        if layers is not None and not name:
            layers, why = None, "the model itself is the MLP: use GeluFFN.from_linears"
        if why:
            skipped[name] = why
        if layers is None:
            continue
        ffn = _from_linears(GeluFFN, *layers, **options)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, ffn)
        replaced.append(name)
    return replaced, skipped


class GeluFFN(torch.nn.Module):
    """``Linear(dim -> hidden_dim) -> GELU(tanh) -> Linear(hidden_dim -> dim)`` on cupyffn, a drop-in for a model's MLP.

    Parameters ``weight1 [hidden_dim, dim]``, ``weight2 [dim, hidden_dim]`` (``[out_features, in_features]``) and,
    with ``bias=True``, ``bias1 [hidden_dim]``, ``bias2 [dim]``, initialized like ``torch.nn.Linear``; ``dtype``
    float32 (default), bfloat16 or float16. ``precision`` and ``save`` as in ``GeluFFNFunction`` (precision applies
    to float32 computation; with biases it is "ieee" (None), "tf32", "bf16x3" or "fp16+fp8"). Without biases, in
    float32 and outside autocast, the layer runs the float32 plans (``gelu_ffn``: custom operators, torch.compile
    without graph breaks). Otherwise (biases, 16-bit parameters or input, or under ``torch.autocast``) it runs the 16-bit/bias
    plan as ``nn.Linear`` would under the same autocast: computes in the autocast dtype (else the input's 16-bit
    dtype, else the parameters' dtype), returns that dtype, and gives gradients in the parameters' dtypes
    (docs/precisions.md). That route is an eager autograd.Function (torch.compile treats it as a graph break).

    ``GeluFFN.from_linears(linear1, linear2)`` wraps two existing layers (their Parameters, shared);
    ``cupyffn.torch.replace_mlps(model)`` swaps a model's MLPs.
    """

    def __init__(self, dim, hidden_dim, *, bias=False, precision=None, save="all", device=None,
                 dtype=torch.float32, _empty=False):
        super().__init__()
        from ..torch import _check_save, _precision_name

        if dtype not in (torch.float32,) + HALF:
            raise TypeError(f"GeluFFN supports dtype float32, bfloat16 or float16; got {dtype}")
        for name, value in (("dim", dim), ("hidden_dim", hidden_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        self.dim, self.hidden_dim = dim, hidden_dim
        self.precision = _precision_name(precision)
        if bias:  # refused here rather than at the first float32 call
            _check_precision(self.precision, "float32")
        self.save = _check_save(save)
        if _empty:  # from_linears sets the Parameters
            return
        factory = {"device": device, "dtype": dtype}
        self.weight1 = torch.nn.Parameter(torch.empty((hidden_dim, dim), **factory))
        self.weight2 = torch.nn.Parameter(torch.empty((dim, hidden_dim), **factory))
        self.bias1 = torch.nn.Parameter(torch.empty(hidden_dim, **factory)) if bias else None
        self.bias2 = torch.nn.Parameter(torch.empty(dim, **factory)) if bias else None
        self.reset_parameters()

    @classmethod
    def from_linears(cls, linear1, linear2, **options):
        """A GeluFFN computing ``linear2(gelu_tanh(linear1(x)))`` with these very Parameters (nn.Linear; a
        transformers Conv1D's [in, out] weight is copied transposed into a new Parameter)."""
        return _from_linears(cls, linear1, linear2, **options)

    def reset_parameters(self):
        """``torch.nn.Linear``'s initialization: kaiming_uniform_(a=sqrt(5)) weights, U(+-1/sqrt(fan_in)) biases."""
        for w, b in ((self.weight1, self.bias1), (self.weight2, self.bias2)):
            torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            if b is not None:
                bound = 1 / math.sqrt(w.shape[1])
                torch.nn.init.uniform_(b, -bound, bound)

    def forward(self, x):
        from ..torch import _layer

        w1 = self.weight1
        if (self.bias1 is None and self.bias2 is None and w1.dtype == torch.float32 and x.dtype not in HALF
                and not torch.is_autocast_enabled(x.device.type)):
            return _layer(x, w1, self.weight2, self.precision, self.save)
        return lt_layer(x, w1, self.weight2, self.bias1, self.bias2, self.save, self.precision)

    def extra_repr(self):
        return (f"dim={self.dim}, hidden_dim={self.hidden_dim}, bias={self.bias1 is not None}, "
                f"dtype={self.weight1.dtype}, precision={self.precision!r}, save={self.save!r}")
