"""The epilogue warps (gemm_tn_dgelu epilogue="warps", XS = 2 in kernels_cu/gemm_sm90.cu) on a Hopper GPU.

The consumers hand each accumulator tile to seven epilogue warps through shared memory; the arithmetic, rounding and
amax are the staged epilogue's, so every case is checked bit for bit against the staged epilogue of the same tile
(cooperative 128 x 128) on fresh inputs with NaN-poisoned outputs, against float64 (relative L2), and for the
poisoned margins of the outputs (nothing stored outside [M, N]). The cases cover the handshake's phases (many tiles
per CTA, T = 1, ragged M and N, K below one stage), gelu_out, memory mode, row strides off 4 (the one-code-at-a-time
stores), and non-finite values.

    PYTHONPATH=. python3 -m pytest -q tests/test_gpu_sm90_epilogue_warps.py
"""

import numpy
import pytest

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
from cupyffn.gemm import sm90 as _sm90  # noqa: E402
from test_gpu_sm90_gemm import (SQRT_2_OVER_PI, activations, b_operand, gelu_grad64, operand,  # noqa: E402
                                padded, rel_l2)


@pytest.fixture(autouse=True)
def hopper():
    if not _sm90.device_supported(cupy.cuda.Device().id):
        pytest.skip("the sm_90a GEMM needs a compute capability 9.0 GPU")


# (m, n, k): T = 1; ragged M and N, K below one stage; one tile row; more tiles than SMs with several per CTA (the
# acc_full / acc_empty phases and the rings across tiles); GEMM1's shape at T = 640 (5 x 48 tiles)
SHAPES = [(1, 6144, 1536), (77, 300, 40), (130, 260, 200), (640, 6144, 1536), (1536, 4096, 192), (2048, 2056, 1000)]
CASES = [pytest.param(m, n, k, gelu, memory, pad,
                      id=f"{m}-{n}-{k}-{'gelu' if gelu else 'g'}-{'mem' if memory else 't'}-pad{pad}")
         for m, n, k in SHAPES for gelu in (False, True) for memory in (False, True)
         for pad in ((0, 2) if (m, n, k) == (130, 260, 200) else (0,))]


def _run(a, b, x, t, gelu, pad, epilogue):
    """One call into NaN-poisoned outputs whose rows are views of n + pad (+ 3 more rows below): (out, its buffer,
    gelu_out, its buffer, amax, gelu_amax)."""
    m, n = x.shape
    out, buf = padded(m, n, numpy.float16, 1, numpy.nan, extra_rows=3, extra_cols=pad)
    g_out, g_buf = padded(m, n, numpy.float16, 1, numpy.nan, extra_rows=3, extra_cols=pad) if gelu else (None, None)
    amax = cupy.zeros(1, cupy.uint32)
    g_amax = cupy.zeros(1, cupy.uint32) if gelu else None
    kw = dict(alpha=2.0 ** -3)
    if gelu:
        kw.update(gelu_out=g_out, gelu_alpha=4.0, gelu_amax=g_amax)
    _sm90.gemm_tn_dgelu(a, b, x, t, out, amax=amax, block_n=128, pingpong=False, epilogue=epilogue,
                             raster=_sm90.FUSED_RASTER, **kw)
    cupy.cuda.get_current_stream().synchronize()
    return out, buf, g_out, g_buf, amax, g_amax


def _poisoned(buf, m, n):
    """True if everything of buf (fp16) outside [m, n] still holds the NaN poison."""
    rest = buf.copy()
    rest[:m, :n] = numpy.nan
    return bool(cupy.isnan(rest).all())


@pytest.mark.parametrize("m,n,k,gelu,memory,pad", CASES)
def test_epilogue_warps_equal_the_staged_epilogue(rng, m, n, k, gelu, memory, pad):
    a, a64 = operand(rng, m, k, "fp16")
    b, b64, _ = b_operand(rng, n, k, "fp16")
    x, t = activations(rng, m, n)
    tt = None if memory else t
    inputs = [v.copy() for v in (a, b, x, t)]
    got = _run(a, b, x, tt, gelu, pad, _sm90.WARPS)
    ref = _run(a, b, x, tt, gelu, pad, "staged")
    out, buf, g_out, g_buf, amax, g_amax = got
    assert bool((out.view(cupy.uint16) == ref[0].view(cupy.uint16)).all()), "out differs from the staged epilogue"
    assert int(amax[0]) == int(ref[4][0]) and int(amax[0]) > 0
    assert _poisoned(buf, m, n), "stores outside [M, N]"
    if gelu:
        assert bool((g_out.view(cupy.uint16) == ref[2].view(cupy.uint16)).all()), "gelu_out differs"
        assert int(g_amax[0]) == int(ref[5][0]) and int(g_amax[0]) > 0
        assert _poisoned(g_buf, m, n), "gelu_out stores outside [M, N]"
    # float64: g = (a @ b^T) * gelu'(x, t), and gelu_out = 0.5 x (1 + t)
    x64 = x.astype(cupy.float64)
    t64 = t.astype(cupy.float64) if not memory else cupy.tanh(SQRT_2_OVER_PI * (x64 + 0.044715 * x64 ** 3))
    g64 = (a64 @ b64.T) * gelu_grad64(x64, t64)
    vals = out.astype(cupy.float64) * 8.0
    assert bool(cupy.isfinite(vals).all())
    assert rel_l2(vals, g64) <= 4e-4
    peak = float(cupy.abs(g64).max())
    assert abs(float(amax.view(cupy.float32)[0]) - peak) <= 2e-3 * peak
    if gelu:
        assert rel_l2(g_out.astype(cupy.float64) / 4.0, 0.5 * x64 * (1 + t64)) <= 4e-4
    for before, now in zip(inputs, (a, b, x, t)):  # inputs are never written
        assert bool((before.view(cupy.uint8) == now.view(cupy.uint8)).all())


def test_epilogue_warps_store_non_finite_values_and_leave_them_out_of_amax(rng):
    """linear1_out NaN gives g = NaN, 1e30 with tanh_inner 0.5 gives g = +-Inf (gelu' overflows): stored as such and
    left out of amax, bit for bit as the staged epilogue does."""
    m, n, k = 700, 1000, 128
    a, _ = operand(rng, m, k, "fp16")
    b, _, _ = b_operand(rng, n, k, "fp16")
    x, t = activations(rng, m, n)
    x[3, 5] = numpy.nan
    x[400, 999], t[400, 999] = 1e30, 0.5
    got = _run(a, b, x, t, True, 0, _sm90.WARPS)
    ref = _run(a, b, x, t, True, 0, "staged")
    out = got[0]
    assert bool(cupy.isnan(out[3, 5])) and bool(cupy.isinf(out[400, 999]))
    assert int((~cupy.isfinite(out.astype(cupy.float32))).sum()) == 2
    assert bool((out.view(cupy.uint16) == ref[0].view(cupy.uint16)).all())
    assert int(got[4][0]) == int(ref[4][0]) and bool(cupy.isfinite(got[4].view(cupy.float32)[0]))
    assert int(got[5][0]) == int(ref[5][0])


@pytest.mark.parametrize("kw,match", [
    (dict(block_n=256), "runs the cooperative 128 x 128 tile"),
    (dict(pingpong=True), "runs the cooperative 128 x 128 tile"),
    (dict(planes=3), "one-plane fp16"),
])
def test_epilogue_warps_refuse_other_schedules(rng, kw, match):
    a, _ = operand(rng, 64, 64, "fp16")
    b, _, _ = b_operand(rng, 128, 64, "fp16")
    x, t = activations(rng, 64, 128)
    out = cupy.full((64, 128), numpy.nan, numpy.float16)
    args = dict(block_n=128, pingpong=False, epilogue=_sm90.WARPS)
    args.update(kw)
    if "planes" in args:  # bf16 operands and planes: no epilogue warps variant
        a, b, out = a.view(cupy.uint16), b.view(cupy.uint16), cupy.full((64, 384), 0x7FC0, numpy.uint16)
    with pytest.raises(ValueError, match=match):
        _sm90.gemm_tn_dgelu(a, b, x, t, out, **args)
    assert bool(cupy.isnan(out).all()) or bool((out == 0x7FC0).all())  # refused before anything ran
