"""JAX function: ``y = gelu_tanh(x @ weight1.T) @ weight2.T`` (no biases) with cupyffn's forward and backward.

    from cupyffn.jax import gelu_ffn
    y = gelu_ffn(x, w1, w2)                                  # x [..., D], w1 [H, D], w2 [D, H], float32
    grads = jax.grad(lambda x, w1, w2: (gelu_ffn(x, w1, w2) * r).sum(), argnums=(0, 1, 2))(x, w1, w2)

``gelu_ffn`` is a ``jax.custom_vjp`` function: the forward calls ``cupyffn.gelu_ffn_forward`` and keeps
the residuals (x, weight1, weight2, linear1_out, tanh_inner, gelu_out); the backward calls
``cupyffn.gelu_ffn_backward`` on them. ``weight1`` is ``[H, D]`` and ``weight2`` ``[D, H]``
(``[out_features, in_features]``). Results equal the plain JAX expression within the precision's
contract (``cupyffn.PRECISIONS[precision].contract``, relative L2 error per output).

Devices: arrays on one CUDA device cross to CuPy zero-copy through DLPack; cupyffn runs on CuPy's current
stream of that device, ordered after JAX's pending writes by the DLPack handshake, and the results come
back with ``jnp.from_dlpack`` (zero-copy; JAX's stream waits for them; their memory belongs to CuPy's
pool and is returned to it when JAX drops them). Arrays on the CPU run on cupyffn's NumPy backend
(``numpy.asarray`` in, ``jnp.asarray`` out, which copies).

Limitations: the calls into CuPy / NumPy happen eagerly, so ``gelu_ffn`` cannot be traced: calling it
inside ``jax.jit``, ``vmap``, ``scan`` etc. (or ``jax.grad`` under ``jit``) raises TypeError. Call it
outside jit (``jax.grad`` / ``jax.value_and_grad`` / ``jax.vjp`` on their own are fine; ``jax.jacrev``
vmaps the backward and raises too). No forward mode (``jvp`` / ``jacfwd``: JAX's custom_vjp error) and
no higher-order derivatives. float32 only; single-device (unsharded) arrays only.

This module imports jax; ``import cupyffn`` does not import it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy

from ._backward import gelu_ffn_backward as _gelu_ffn_backward
from ._forward import gelu_ffn_forward as _gelu_ffn_forward
from ._precision import DEFAULT as _DEFAULT_PRECISION
from ._precision import lookup as _lookup_precision

__all__ = ["gelu_ffn"]

_DL_CPU = 1
_DL_CUDA = 2

try:
    _Tracer = jax.core.Tracer
except AttributeError:  # pragma: no cover - a JAX that moved it
    from jax._src.core import Tracer as _Tracer


def _not_traced(named, where):
    for name, a in named:
        if isinstance(a, _Tracer):
            raise TypeError(
                f"cupyffn.jax.gelu_ffn got a traced value for {name} ({type(a).__name__}) in {where}: it calls "
                f"CuPy/NumPy eagerly and cannot run inside jax.jit, vmap, scan or other tracing transformations. "
                f"Call it outside jit (jax.grad / value_and_grad / vjp without jit are fine).")


def _check(named, where_label):
    """Concrete float32 jax.Arrays on one device; returns (jax.Device, DLPack (device type, device id))."""
    _not_traced(named, where_label)
    where = None
    for name, a in named:
        if not isinstance(a, jax.Array):
            raise TypeError(f"{name} must be a jax.Array; got {type(a).__module__}.{type(a).__name__}")
        if a.dtype != jnp.float32:
            raise TypeError(f"{name} must be float32 (cupyffn computes in float32); got {a.dtype}")
        if len(a.devices()) != 1:
            raise ValueError(f"{name} is sharded over {len(a.devices())} devices; cupyffn.jax takes single-device "
                             f"arrays")
        dl = tuple(int(v) for v in a.__dlpack_device__())
        if dl[0] not in (_DL_CPU, _DL_CUDA):
            raise ValueError(f"{name} is on {next(iter(a.devices()))}; cupyffn.jax runs CPU and CUDA arrays")
        if where is None:
            where = dl
        elif dl != where:
            raise ValueError(f"all arrays must be on one device; {named[0][0]} is on {named[0][1].devices()} but "
                             f"{name} is on {a.devices()}")
    return next(iter(named[0][1].devices())), where


def _run(placement, compute):
    """compute(convert_in, stream) on the inputs' device (`placement` from _check); results as jax.Arrays there."""
    device, where = placement
    if where[0] == _DL_CPU:
        results = compute(numpy.asarray, None)
        return tuple(None if r is None else jax.device_put(r, device) for r in results)  # not the default device
    import cupy

    with cupy.cuda.Device(where[1]):
        stream = cupy.cuda.get_current_stream()
        results = compute(lambda a: a, stream)  # cupyffn imports jax.Arrays through DLPack on `stream`
        with stream:  # JAX's stream is made to wait for `stream` (cupy's __dlpack__ handshake)
            return tuple(None if r is None else jnp.from_dlpack(r) for r in results)


def _forward(x, w1, w2, precision):
    placement = _check((("hidden_states (x)", x), ("weight1", w1), ("weight2", w2)), "the forward")
    return _run(placement, lambda conv, stream: _gelu_ffn_forward(conv(x), conv(w1), conv(w2), precision=precision,
                                                             stream=stream))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gelu_ffn(x, w1, w2, precision):
    return _forward(x, w1, w2, precision)[0]


def _gelu_ffn_fwd(x, w1, w2, precision):
    y, z, t, g = _forward(x, w1, w2, precision)
    return y, (x, w1, w2, z, t, g)


def _gelu_ffn_bwd(precision, residuals, dy):
    x, w1, w2, z, t, g = residuals
    _not_traced((("the output cotangent", dy),), "the backward")
    if dy.dtype != jnp.float32:
        raise TypeError(f"the output cotangent must be float32; got {dy.dtype}")
    placement = _check((("hidden_states (x)", x), ("weight1", w1), ("weight2", w2)), "the backward")
    dy = jax.device_put(dy, placement[0])  # no-op when it is already there
    return _run(placement, lambda conv, stream: _gelu_ffn_backward(
        conv(dy), conv(x), conv(w1), conv(w2), conv(z), conv(t), conv(g), precision=precision, stream=stream))


_gelu_ffn.defvjp(_gelu_ffn_fwd, _gelu_ffn_bwd)


def gelu_ffn(x, weight1, weight2, precision=_DEFAULT_PRECISION):
    """``gelu_tanh(x @ weight1.T) @ weight2.T`` (no biases), differentiable with ``jax.grad`` (custom VJP).

    x ``[..., D]``, weight1 ``[H, D]``, weight2 ``[D, H]``: float32 ``jax.Array``s on one CPU or CUDA device.
    precision: ``"bf16x3"`` (default), ``"ieee"``, ``"tf32"`` or ``"bf16"`` (``cupyffn.PRECISIONS``).
    Returns ``[..., D]`` float32. Not traceable: raises TypeError inside ``jax.jit`` (module docstring).
    """
    # Tracers are only refused where cupyffn is called (_forward / _gelu_ffn_bwd): under jax.grad alone the
    # arguments here are linearize tracers, but the custom VJP's forward and backward see concrete arrays.
    return _gelu_ffn(x, weight1, weight2, _lookup_precision(precision).name)
