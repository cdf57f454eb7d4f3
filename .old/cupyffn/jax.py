"""JAX function: ``y = gelu_tanh(x @ weight1.T) @ weight2.T`` (no biases) with cupyffn's forward and backward.

    from cupyffn.jax import gelu_ffn
    y = gelu_ffn(x, w1, w2)                                  # x [..., D], w1 [H, D], w2 [D, H], float32
    loss, grads = jax.jit(jax.value_and_grad(lambda x, w1, w2: (gelu_ffn(x, w1, w2) * r).sum(),
                                             argnums=(0, 1, 2)))(x, w1, w2)

``gelu_ffn`` is a ``jax.custom_vjp`` function whose forward and backward are
``jax.experimental.buffer_callback`` calls: it works eagerly and inside ``jax.jit``, ``jax.grad``,
``jax.value_and_grad``, ``jax.vjp`` (and ``vmap``, one call per batch element). The forward keeps the
residuals (x, weight1, weight2, linear1_out, tanh_inner, gelu_out) as ordinary JAX arrays; the backward
computes the three gradients from them. ``weight1`` is ``[H, D]`` and ``weight2`` ``[D, H]``
(``[out_features, in_features]``). Results equal the plain JAX expression within the precision's
contract (``cupyffn.PRECISIONS[precision].contract``, relative L2 error per output).

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
derivatives; float32 only; under ``jit`` with sharded inputs XLA gathers them to one device first (the
callback has no sharding rule): use it on single-device arrays or inside ``shard_map``.

This module imports jax; ``import cupyffn`` does not import it.
"""

import ctypes
import functools
import math

import jax
import jax.numpy as jnp
import numpy
from jax.experimental.buffer_callback import buffer_callback

from . import _views
from ._backward import gelu_ffn_backward as _gelu_ffn_backward
from ._forward import gelu_ffn_forward as _gelu_ffn_forward
from ._precision import lookup as _lookup_precision

__all__ = ["gelu_ffn"]

try:
    _Tracer = jax.core.Tracer
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
        return [numpy.asarray(b) for b in buffers], None, None
    stream = ctx.stream
    if callable(stream):  # a JAX whose ExecutionContext spells it as a method
        stream = stream()
    stream_ptr = _pointer(stream)
    from cupy_backends.cuda.api import runtime

    cai = [b.__cuda_array_interface__ for b in buffers]
    device = runtime.pointerGetAttributes(next(c["data"][0] for c in cai if c["data"][0])).device \
        if any(c["data"][0] for c in cai) else runtime.getDevice()
    arrays = []
    for c in cai:
        shape = tuple(c["shape"])
        strides = c.get("strides")
        if strides is None:  # C order
            strides, step = [], 1
            for n in reversed(shape):
                strides.append(step)
                step *= max(n, 1)
            strides = tuple(reversed(strides))
        else:
            strides = tuple(s // 4 for s in strides)
        arrays.append(_views.float32_view(c["data"][0], shape, strides, device))
    return arrays, _views.external_stream(stream_ptr, device), device


def _pointer(obj):
    """The address behind ExecutionContext.stream: a Python int, or a capsule (how nanobind passes a void*)."""
    if obj is None:  # a null stream: CUDA's legacy default stream
        return 0
    if isinstance(obj, int):
        return obj
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype, api.PyCapsule_GetName.argtypes = ctypes.c_char_p, [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
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


@functools.lru_cache(maxsize=None)
def _forward_callback(precision):
    # one callback object per precision: JAX caches compiled eager calls by the callback's identity
    def callback(ctx, out, x, w1, w2):
        def compute(arrays, stream):
            x, w1, w2, *results = arrays
            _gelu_ffn_forward(x, w1, w2, precision=precision, out=results, stream=stream)

        _run(ctx, (x, w1, w2) + tuple(out), compute)

    return callback


@functools.lru_cache(maxsize=None)
def _backward_callback(precision):
    def callback(ctx, out, dy, x, w1, w2, z, t, g):
        def compute(arrays, stream):
            inputs, results = arrays[:7], arrays[7:]
            _gelu_ffn_backward(*inputs, precision=precision, out=results, stream=stream)

        _run(ctx, (dy, x, w1, w2, z, t, g) + tuple(out), compute)

    return callback


# ---------------------------------------------------------------------- traced side
def _shapes(x, w1, w2):
    """Check the arguments (concrete or traced); returns (leading dims, D, H)."""
    for name, a in (("hidden_states (x)", x), ("weight1", w1), ("weight2", w2)):
        if not isinstance(a, jax.Array):
            raise TypeError(f"{name} must be a jax.Array; got {type(a).__module__}.{type(a).__name__}")
        if a.dtype != jnp.float32:
            raise TypeError(f"{name} must be float32 (cupyffn computes in float32); got {a.dtype}")
        if not isinstance(a, _Tracer) and len(a.devices()) != 1:
            raise ValueError(f"{name} is sharded over {len(a.devices())} devices; cupyffn.jax takes single-device "
                             f"arrays (or use it inside shard_map)")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"hidden_states (x) must have shape [..., dim] with dim >= 1; got {x.shape}")
    dim = x.shape[-1]
    if w1.ndim != 2 or w1.shape[1] != dim or w1.shape[0] < 1:
        raise ValueError(f"weight1 must have shape (hidden_dim, dim) with dim = x.shape[-1] = {dim}; got {w1.shape}")
    hidden = w1.shape[0]
    if w2.shape != (dim, hidden):
        raise ValueError(f"weight2 must have shape (dim, hidden_dim) = {(dim, hidden)}; got {w2.shape}")
    return tuple(x.shape[:-1]), dim, hidden


def _forward(x, w1, w2, precision):
    lead, dim, hidden = _shapes(x, w1, w2)
    f32 = jnp.float32
    if math.prod(lead) == 0:  # no tokens: nothing for cupyffn to do
        z = jnp.zeros(lead + (hidden,), f32)
        return jnp.zeros(lead + (dim,), f32), z, z, z
    shapes = (jax.ShapeDtypeStruct(lead + (dim,), f32),) + (jax.ShapeDtypeStruct(lead + (hidden,), f32),) * 3
    return tuple(buffer_callback(_forward_callback(precision), shapes, vmap_method="sequential")(x, w1, w2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gelu_ffn(x, w1, w2, precision):
    return _forward(x, w1, w2, precision)[0]


def _gelu_ffn_fwd(x, w1, w2, precision):
    y, z, t, g = _forward(x, w1, w2, precision)
    return y, (x, w1, w2, z, t, g)


def _gelu_ffn_bwd(precision, residuals, dy):
    x, w1, w2, z, t, g = residuals
    if dy.dtype != jnp.float32:
        raise TypeError(f"the output cotangent must be float32; got {dy.dtype}")
    if math.prod(x.shape[:-1]) == 0:
        return jnp.zeros_like(x), jnp.zeros_like(w1), jnp.zeros_like(w2)
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (x, w1, w2))
    return tuple(buffer_callback(_backward_callback(precision), shapes, vmap_method="sequential")(
        dy, x, w1, w2, z, t, g))


_gelu_ffn.defvjp(_gelu_ffn_fwd, _gelu_ffn_bwd)


def gelu_ffn(x, weight1, weight2, precision=None):
    """``gelu_tanh(x @ weight1.T) @ weight2.T`` (no biases), differentiable with ``jax.grad`` (custom VJP).

    x ``[..., D]``, weight1 ``[H, D]``, weight2 ``[D, H]``: float32 ``jax.Array``s on one CPU or CUDA device
    (or traced values of those). precision: ``"fp16+fp8"``, ``"bf16x3"``, ``"ieee"``, ``"tf32"`` or ``"bf16"``
    (``cupyffn.PRECISIONS``), or None (the default): the device's default, ``"fp16+fp8"`` on a GPU and ``"ieee"``
    (plain fp32, the fastest on the CPU) on the CPU; the others remain valid on the CPU, reproducing the GPU's
    numerics. Returns ``[..., D]`` float32. Works eagerly and under ``jax.jit``.
    """
    # None travels to the callbacks, where cupyffn sees the buffers and picks the default of their device
    # (a traced value has no device to ask at trace time)
    precision = None if precision is None else _lookup_precision(precision).name
    _shapes(x, weight1, weight2)  # errors at the call (trace time under jit), naming the argument
    return _gelu_ffn(x, weight1, weight2, precision)
