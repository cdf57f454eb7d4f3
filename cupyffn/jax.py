"""JAX function: ``y = gelu_tanh(x @ weight1.T + bias1) @ weight2.T + bias2`` (biases optional) with cupyffn's
forward and backward.

    from cupyffn.jax import gelu_ffn
    y = gelu_ffn(x, w1, w2)                                  # x [..., D], w1 [H, D], w2 [D, H], float32
    y = gelu_ffn(x16, w1, w2, bias1=b1, bias2=b2)            # bf16/fp16 x, fp32 (master) or x's dtype weights
    loss, grads = jax.jit(jax.value_and_grad(lambda x, w1, w2: (gelu_ffn(x, w1, w2) * r).sum(),
                                             argnums=(0, 1, 2)))(x, w1, w2)

``gelu_ffn`` is a ``jax.custom_vjp`` function whose forward and backward are
``jax.experimental.buffer_callback`` calls: it works eagerly and inside ``jax.jit``, ``jax.grad``,
``jax.value_and_grad``, ``jax.vjp`` (and ``vmap``, one call per batch element). The forward keeps the
residuals (x, weight1, weight2, linear1_out, tanh_inner, gelu_out) as ordinary JAX arrays; the backward
computes the three gradients from them (five with biases). ``weight1`` is ``[H, D]`` and ``weight2`` ``[D, H]``
(``[out_features, in_features]``). Results equal the plain JAX expression within the precision's
contract (``cupyffn.PRECISIONS[precision].contract``, relative L2 error per output).

Biases (keyword, each optional) ride with every configuration. bfloat16 / float16 activations take cupyffn's
cuBLASLt route (docs/precisions.md): the GEMMs on the 16-bit operands with fp32 accumulation and cuBLASLt's fused
bias, GELU and GELU-derivative epilogues; float32 weights and biases are rounded to the activation dtype as
torch's autocast does, and their gradients come back float32 (the master-weight convention; a 16-bit weight's
gradient in its dtype); the residuals are linear1_out and gelu_out in the activation dtype (no tanh_inner).

GPU: XLA calls cupyffn while it runs the compiled program, with XLA's own device buffers (outputs
allocated by XLA, written in place) and XLA's stream: the work is enqueued on that stream, in order with
the rest of the program, and the host is never synchronized (except when a new shape evicts one of the
cached plans: see ``gelu_ffn_backward``'s `stream`). CPU: the same callbacks run cupyffn's NumPy
backend on XLA's host buffers (zero-copy).

Memory (GPU): cupyffn's scratch buffers and cuBLAS workspaces come from CuPy's memory pool, beside XLA's.
By default XLA preallocates 75% of the GPU when it starts, so a large shape can run out of memory in
cupyffn; leave room, before JAX starts, with ``XLA_PYTHON_CLIENT_MEM_FRACTION=.5`` (a fraction that
leaves enough for cupyffn: ``GeluFFNBackward(...).scratch_bytes`` tells how much one shape needs) or
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (XLA then allocates as it goes).

Limitations: no forward mode (``jvp`` / ``jacfwd``: JAX's custom_vjp error) and no higher-order
derivatives; under ``jit`` with sharded inputs XLA gathers them to one device first (the
callback has no sharding rule): use it on single-device arrays or inside ``shard_map``.

This module imports jax; ``import cupyffn`` does not import it.
"""

import ctypes as _ctypes
import functools as _functools
import math as _math

import jax as _jax
import jax.numpy as _jnp
import numpy as _numpy
from jax.experimental.buffer_callback import buffer_callback as _buffer_callback

from .api.functional import gelu_ffn_backward as _gelu_ffn_backward
from .api.functional import gelu_ffn_forward as _gelu_ffn_forward
from .core import rules as _rules
from .core import views as _views
from .core.arrays import dtype_name as _dtype_name
from .core.precision import checked_name as _checked_precision

__all__ = ["gelu_ffn"]

try:
    _Tracer = _jax.core.Tracer
except AttributeError:  # pragma: no cover - a JAX that moved it
    from jax._src.core import Tracer as _Tracer


# ---------------------------------------------------------------------- inside XLA's execution
_DLPACK_CPU = 1  # DLDeviceType kDLCPU


def _in_host_memory(buffers):
    """True for the CPU client's buffers, by their DLPack device type (on the CPU, ctx.stream raises "XLA FFI
    GPU context is not available"; deciding by the buffers keeps any other failure of it from passing for that)."""
    return all(int(b.__dlpack_device__()[0]) == _DLPACK_CPU for b in buffers)


def _on_device(ctx, buffers):
    """cupyffn's view of XLA's `buffers` and the stream to run on: (arrays, stream, device id or None for the CPU)."""
    if _in_host_memory(buffers):
        return [_numpy.asarray(b) for b in buffers], None, None
    stream = ctx.stream
    if callable(stream):  # a JAX whose ExecutionContext spells it as a method
        stream = stream()
    stream_ptr = _pointer(stream)
    from cupy_backends.cuda.api import runtime

    cai = [b.__cuda_array_interface__ for b in buffers]
    device = runtime.pointerGetAttributes(next(c["data"][0] for c in cai if c["data"][0])).device \
        if any(c["data"][0] for c in cai) else runtime.getDevice()
    arrays = []
    for b, c in zip(buffers, cai):
        dtype = str(b.dtype)
        size = _numpy.dtype(b.dtype).itemsize
        shape = tuple(c["shape"])
        strides = c.get("strides")
        if strides is None:  # C order
            strides, step = [], 1
            for n in reversed(shape):
                strides.append(step)
                step *= max(n, 1)
            strides = tuple(reversed(strides))
        else:
            strides = tuple(s // size for s in strides)
        arrays.append(_views.typed_view(c["data"][0], shape, strides, device, dtype))
    return arrays, _views.external_stream(stream_ptr, device), device


def _pointer(obj):
    """The address behind ExecutionContext.stream: a Python int, or a capsule (how nanobind passes a void*)."""
    if obj is None:  # a null stream: CUDA's legacy default stream
        return 0
    if isinstance(obj, int):
        return obj
    api = _ctypes.pythonapi
    api.PyCapsule_GetName.restype, api.PyCapsule_GetName.argtypes = _ctypes.c_char_p, [_ctypes.py_object]
    api.PyCapsule_GetPointer.restype = _ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [_ctypes.py_object, _ctypes.c_char_p]
    try:
        return int(api.PyCapsule_GetPointer(obj, api.PyCapsule_GetName(obj)) or 0)
    except (TypeError, ValueError) as e:
        raise TypeError(f"cupyffn.jax: XLA's stream came as {type(obj).__name__}, neither an int nor a capsule") from e


def _run(ctx, buffers, compute):
    arrays, stream, device = _on_device(ctx, buffers)
    if device is None:
        compute(arrays, None)
        return
    import cupy

    with cupy.cuda.Device(device):
        compute(arrays, stream)


@_functools.lru_cache(maxsize=None)
def _forward_callback(precision, has_bias1, has_bias2, half):
    # one callback object per configuration: JAX caches compiled eager calls by the callback's identity
    def callback(ctx, out, x, w1, w2, *biases):
        def compute(arrays, stream):
            x, w1, w2 = arrays[:3]
            given = iter(arrays[3:3 + len(biases)])
            b1, b2 = (next(given) if has_bias1 else None), (next(given) if has_bias2 else None)
            results = arrays[3 + len(biases):]
            if half:  # output, linear1_out, gelu_out: no tanh_inner
                results = (results[0], results[1], None, results[2])
            _gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2, precision=precision, out=results, stream=stream)

        _run(ctx, (x, w1, w2) + biases + tuple(out), compute)

    return callback


@_functools.lru_cache(maxsize=None)
def _backward_callback(precision, bias_grads, half):
    def callback(ctx, out, dy, x, w1, w2, z, *saved):
        def compute(arrays, stream):
            dy, x, w1, w2, z = arrays[:5]
            t, g = (None, arrays[5]) if half else arrays[5:7]
            results = arrays[6 if half else 7:]
            _gelu_ffn_backward(dy, x, w1, w2, z, t, g, need_bias_grads=bias_grads, precision=precision, out=results,
                               stream=stream)

        _run(ctx, (dy, x, w1, w2, z) + saved + tuple(out), compute)

    return callback


# ---------------------------------------------------------------------- traced side
def _check(x, w1, w2, b1, b2, precision):
    """Check the arguments (concrete or traced: at trace time under jit): jax arrays on one device here, their shapes,
    dtypes and precision by the door's rules (cupyffn/core/rules.py), which read the same on every entry point."""
    named = (("hidden_states (x)", x), ("weight1", w1), ("weight2", w2), ("bias1", b1), ("bias2", b2))
    for name, a in named:
        if a is None:
            continue
        if not isinstance(a, _jax.Array):
            raise TypeError(f"{name} must be a jax.Array; got {type(a).__module__}.{type(a).__name__}")
        if not isinstance(a, _Tracer) and len(a.devices()) != 1:
            raise ValueError(f"{name} is sharded over {len(a.devices())} devices; cupyffn.jax takes single-device "
                             f"arrays (or use it inside shard_map)")
    arrays = (x, w1, w2, b1, b2)
    _rules.check("forward", tuple(None if a is None else _dtype_name(a) for a in arrays),
                 tuple(None if a is None else tuple(a.shape) for a in arrays), precision)


def _forward(x, w1, w2, b1, b2, precision):
    """(output, linear1_out, tanh_inner or None (16-bit x), gelu_out) of arguments `gelu_ffn` checked."""
    lead, dim, hidden = x.shape[:-1], x.shape[-1], w1.shape[0]
    half = x.dtype != _jnp.float32
    if _math.prod(lead) == 0:  # no tokens: nothing for cupyffn to do
        z = _jnp.zeros(lead + (hidden,), x.dtype)
        return _jnp.zeros(lead + (dim,), x.dtype), z, None if half else z, z
    act = _jax.ShapeDtypeStruct(lead + (hidden,), x.dtype)
    shapes = (_jax.ShapeDtypeStruct(lead + (dim,), x.dtype),) + (act,) * (2 if half else 3)
    biases = tuple(b for b in (b1, b2) if b is not None)
    callback = _forward_callback(precision, b1 is not None, b2 is not None, half)
    results = tuple(_buffer_callback(callback, shapes, vmap_method="sequential")(x, w1, w2, *biases))
    return (results[0], results[1], None, results[2]) if half else results


@_functools.partial(_jax.custom_vjp, nondiff_argnums=(5,))
def _gelu_ffn(x, w1, w2, b1, b2, precision):
    return _forward(x, w1, w2, b1, b2, precision)[0]


def _gelu_ffn_fwd(x, w1, w2, b1, b2, precision):
    y, z, t, g = _forward(x, w1, w2, b1, b2, precision)
    return y, (x, w1, w2, z, t, g, b1, b2)  # the biases only say which gradients to return


def _gelu_ffn_bwd(precision, residuals, dy):
    x, w1, w2, z, t, g, b1, b2 = residuals
    has_b1, has_b2 = b1 is not None, b2 is not None
    if dy.dtype != x.dtype:
        raise TypeError(f"the output cotangent must be {x.dtype} (the output's dtype); got {dy.dtype}")
    lead, dim, hidden = x.shape[:-1], x.shape[-1], w1.shape[0]
    bias_grads = has_b1 or has_b2
    half = x.dtype != _jnp.float32
    if _math.prod(lead) == 0:
        grads = (_jnp.zeros_like(x), _jnp.zeros_like(w1), _jnp.zeros_like(w2),
                 _jnp.zeros((hidden,), w1.dtype), _jnp.zeros((dim,), w1.dtype))
    else:
        # with any bias both bias gradients are computed (each costs one column sum)
        shapes = tuple(_jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, w1, w2))
        if bias_grads:
            shapes += (_jax.ShapeDtypeStruct((hidden,), w1.dtype), _jax.ShapeDtypeStruct((dim,), w1.dtype))
        saved = (g,) if half else (t, g)
        callback = _backward_callback(precision, bias_grads, half)
        grads = tuple(_buffer_callback(callback, shapes, vmap_method="sequential")(dy, x, w1, w2, z, *saved))
        grads += (None, None)
    # bias gradients come in the weights' dtype (the door writes one gradient dtype): each in its bias's dtype
    return grads[:3] + (grads[3].astype(b1.dtype) if has_b1 else None, grads[4].astype(b2.dtype) if has_b2 else None)


_gelu_ffn.defvjp(_gelu_ffn_fwd, _gelu_ffn_bwd)


def gelu_ffn(x, weight1, weight2, precision=None, *, bias1=None, bias2=None):
    """``gelu_tanh(x @ weight1.T + bias1) @ weight2.T + bias2``, differentiable with ``jax.grad`` (custom VJP).

    x ``[..., D]``, weight1 ``[H, D]``, weight2 ``[D, H]``, bias1 ``[H]`` and bias2 ``[D]`` (keyword, each
    optional): ``jax.Array``s on one CPU or CUDA device (or traced values of those).

    float32 x: weights and biases float32; precision: ``"fp16+fp8"``, ``"bf16x3"``, ``"ieee"``, ``"tf32"`` or
    ``"bf16"`` (``cupyffn.PRECISIONS``), or None (the default): the device's default, ``"fp16+fp8"`` on a GPU and
    ``"ieee"`` (plain fp32, the fastest on the CPU) on the CPU; the others remain valid on the CPU, reproducing the
    GPU's numerics. Returns ``[..., D]`` float32.

    bfloat16 / float16 x: weights float32 or x's dtype (both alike), biases the weights' dtype or float32; the output
    in x's dtype; precision None. On the GPU, D and H must be multiples of 8 for 16-bit x (cuBLASLt's row alignment).
    Gradients come back in their primal's dtype. Works eagerly and under ``jax.jit``.
    """
    # None travels to the callbacks, where cupyffn sees the buffers and picks the default of their device
    # (a traced value has no device to ask at trace time)
    precision = _checked_precision(precision)
    _check(x, weight1, weight2, bias1, bias2, precision)  # errors at the call (trace time under jit)
    return _gelu_ffn(x, weight1, weight2, bias1, bias2, precision)
