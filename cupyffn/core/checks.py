"""`check_activations=True`: are the saved activations finite, and really the tanh-GELU of linear1_out?

First every element of linear1_out and of the tanh_inner / gelu_out given is tested for NaN / Inf (on the device
for GPU arrays): one non-finite element poisons the gradients, yet is too rare for the sampled comparison below to
see. Then a sample of at most 4096 positions is gathered, copied to the host and compared in float64 with the
formulas. Both synchronize with the stream, which is why the check is opt-in. A failure raises
ActivationMismatchError naming the most likely cause: non-finite values (an overflowed forward, an uninitialized
buffer), the exact (erf) GELU instead of the tanh approximation, tanh's argument stored instead of its output,
swapped buffers, or stale / mismatched tensors.
"""

import contextlib
import math

import numpy

from . import activation
from . import arrays as _arrays

SAMPLES = 4096
# Saved tensors are fp32 and may come from a different fp32 evaluation order (or a fast tanh):
# allow a few ulps plus a little; the mix-ups above differ by 1e-4 and more on typical values.
_ATOL, _RTOL = 1e-5, 1e-5
_MATCH = 0.99  # fraction of sampled positions that must agree


class ActivationMismatchError(ValueError):
    """tanh_inner / gelu_out are not tanh_GELU(linear1_out) (see check_activations)."""


def _erf(x):
    return numpy.vectorize(math.erf, otypes=[numpy.float64])(x)


def _agree(got, want, atol=_ATOL, rtol=_RTOL):
    return float(numpy.mean(numpy.abs(got - want) <= atol + rtol * numpy.abs(want))) >= _MATCH


def positions(n, cols):
    """The sampled (rows, cols) of an [n / cols, cols] tensor: at most SAMPLES, fixed seed."""
    flat = numpy.unique(numpy.random.default_rng(0).integers(0, n, min(n, SAMPLES)))
    return numpy.divmod(flat, cols)


#: the rounding unit of each activation dtype: 16-bit saved tensors are judged at two of their units
_EPS = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


#: per activation dtype, the unsigned type of its bits and its exponent field: all ones is NaN or Inf (a test of the
#: bits, so that it needs no NaN support of the dtype's arithmetic, bfloat16's included)
_EXPONENT = {"float32": (numpy.uint32, 0x7F800000), "float16": (numpy.uint16, 0x7C00),
             "bfloat16": (numpy.uint16, 0x7F80)}
_NAMES = {4: "linear1_out", 5: "tanh_inner", 6: "gelu_out"}


def non_finite(call, index):
    """None, or a sentence saying how many elements of input `index` are NaN / Inf and where the first one is."""
    m, a = call.inputs[index], call.arrays[index]
    view = _arrays.view2d(a, m)
    xp = numpy if isinstance(view, numpy.ndarray) else __import__("cupy")
    bits, exponent = _EXPONENT[m.dtype]
    bad = (view.view(bits) & exponent) == exponent
    count = int(xp.count_nonzero(bad))
    if count == 0:
        return None
    row, col = (int(i) for i in numpy.unravel_index(int(xp.argmax(bad)), bad.shape))
    first = float(view[row, col].astype(xp.float32))
    return (f"{_NAMES[index]} holds {count} non-finite element{'s' if count > 1 else ''} (the first, {first}, at "
            f"row {row}, column {col} of its [{m.rows}, {m.cols}] view): an overflowed forward or an "
            f"uninitialized buffer; the gradients would be NaN")


def _sample(call, index, rows, cols):
    """float64 host copies of input `index` at the sampled (rows, cols)."""
    m, a = call.inputs[index], call.arrays[index]
    view = _arrays.view2d(a, m)
    if isinstance(view, numpy.ndarray):
        return view[rows, cols].astype(numpy.float32).astype(numpy.float64)
    import cupy

    picked = view[cupy.asarray(rows), cupy.asarray(cols)].astype(cupy.float32)
    return cupy.asnumpy(picked).astype(numpy.float64)


def check(call, stream=None):
    """Raise ActivationMismatchError if linear1_out or the tanh_inner / gelu_out given to a backward `call`
    (cupyffn/api/validate.py) hold NaN / Inf, or if their samples disagree with linear1_out's tanh-GELU."""
    z_m = call.inputs[4]
    n = z_m.rows * z_m.cols
    if n == 0:
        return
    ctx = stream if stream is not None else contextlib.nullcontext()
    with ctx:
        problems = [p for p in (non_finite(call, i) for i in (4, 5, 6) if call.inputs[i] is not None) if p]
    if problems:
        raise ActivationMismatchError("check_activations: " + "; ".join(problems))
    if call.inputs[5] is None and call.inputs[6] is None:  # memory mode: nothing saved to compare
        return
    rows, cols = positions(n, z_m.cols)
    with ctx:
        z = _sample(call, 4, rows, cols)
        t = _sample(call, 5, rows, cols) if call.inputs[5] is not None else None
        g = _sample(call, 6, rows, cols) if call.inputs[6] is not None else None
    if call.act in _EPS:
        judge(z, t, g, atol=1e-5, rtol=4 * _EPS[call.act])
    else:
        judge(z, t, g)


def judge(z, t, g, atol=_ATOL, rtol=_RTOL):
    """Raise ActivationMismatchError unless the float64 samples t (tanh_inner) and g (gelu_out), either may be
    None, are the tanh-GELU's of z within atol + rtol |value| (the 16-bit plans pass their dtype's rounding)."""
    inner = activation.SQRT_2_OVER_PI * (z + activation.CUBIC * z ** 3)
    t_ref, g_ref = activation.forward(z)
    problems = []
    if t is not None and not _agree(t, t_ref, atol, rtol):
        if _agree(t, inner, atol, rtol):
            problems.append("tanh_inner holds the argument of tanh (sqrt(2/pi) * (z + 0.044715 z^3)), not tanh's output")
        elif g is not None and _agree(t, g_ref, atol, rtol) and _agree(g, t_ref, atol, rtol):
            problems.append("tanh_inner and gelu_out look swapped")
        else:
            problems.append("tanh_inner is not tanh(sqrt(2/pi) * (z + 0.044715 z^3)) of linear1_out: stale or "
                            "mismatched buffers (another step, layer or batch?)")
    if g is not None:
        g_erf = 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0)))
        # Where the two GELUs differ clearly, which one does gelu_out follow? (Near 0 they agree to
        # far below fp32 noise, so a tolerance test alone cannot tell them apart.)
        tol = atol + rtol * numpy.abs(g_ref)
        telling = numpy.abs(g_ref - g_erf) > 10 * tol
        erf_like = telling.sum() >= 16 and float(numpy.mean(
            numpy.abs(g - g_erf)[telling] < numpy.abs(g - g_ref)[telling])) >= 0.9
    if g is not None and (erf_like or not _agree(g, g_ref, atol, rtol)):
        if erf_like:
            problems.append("gelu_out is the exact (erf) GELU, but cupyffn implements the tanh approximation: use "
                            "gelu(approximate='tanh') in the forward, or cupyffn.gelu_ffn_forward")
        elif not any("swapped" in p for p in problems):
            problems.append("gelu_out is not 0.5 * z * (1 + tanh_inner) of linear1_out: stale or mismatched buffers "
                            "(another step, layer or batch?)")
    if problems:
        raise ActivationMismatchError("check_activations: " + "; ".join(problems) +
                                      f" ({len(z)} sampled positions compared)")


