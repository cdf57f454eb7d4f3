"""The sm_90a GEMM (kernels_cu/gemm_sm90.cu through cupyffn/_sm90_gemm.py) on a Hopper GPU.

Every result is checked against a float64 product of the same 16-bit operands (and against cuBLAS
on the same operands); outputs are NaN-poisoned before the call, and the poisoned margins around
them (extra columns and rows of the buffer) and NaN padding of the operands' rows must survive:
that is what the predicated stores and the TMA bounds protect.

Quick subset (marker ``sm90_quick``: ~25 representative cases -- odd shapes, K not a multiple of 64,
more tiles than SMs with ping-pong and K > the pipeline depth, each epilogue and memory mode, both
operand types, each schedule, the staged and the direct dgelu epilogue (and the two bitwise equal);
~1 min on an H200 with a cold compile cache):

    PYTHONPATH=. python3 -m pytest -q -m sm90_quick tests/test_gpu_sm90_gemm.py

or in two processes, ping-pong last, so that a pipeline trap there (which ends the CUDA context and
fails every later test of its process) cannot hide the other verdicts:

    PYTHONPATH=. python3 -m pytest -v --tb=line -m sm90_quick -k "not pp" tests/test_gpu_sm90_gemm.py
    PYTHONPATH=. python3 -m pytest -v --tb=line -m sm90_quick -k pp tests/test_gpu_sm90_gemm.py

The whole file (~300 cases, 30 kernel variants to compile: a few minutes):
``PYTHONPATH=. python3 -m pytest -q tests/test_gpu_sm90_gemm.py`` (or, the same,
``-m "sm90_quick or not sm90_quick"``).
"""

import math

import numpy
import pytest

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
from cupyffn import _cublas, _sm90_gemm  # noqa: E402

SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


@pytest.fixture(autouse=True)
def hopper():
    if not _sm90_gemm.device_supported(cupy.cuda.Device().id):
        pytest.skip("the sm_90a GEMM needs a compute capability 9.0 GPU")


def bf16_bits(x32):
    """Round-to-nearest-even bf16 bit patterns of finite float32 values (numpy or cupy)."""
    xp = cupy.get_array_module(x32)
    u = x32.view(xp.uint32).astype(xp.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(xp.uint16)


def bf16_value(bits):
    xp = cupy.get_array_module(bits)
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def padded(rows, cols, dtype, ld_multiple, fill, extra_rows=0, extra_cols=0):
    """A [rows, cols] view into a bigger buffer filled with `fill`: row stride rounded up to
    ld_multiple (plus extra_cols), extra_rows more rows below. Returns (view, buffer)."""
    ld = -(-(cols + extra_cols) // ld_multiple) * ld_multiple
    buf = cupy.full((rows + extra_rows, max(ld, ld_multiple)), fill, dtype=dtype)
    return buf[:rows, :cols], buf


def operand(rng, rows, cols, kind, pad_cols=8):
    """16-bit operand [rows, cols] (K contiguous) with NaN in the padding of each row, and its value in float64."""
    x32 = rng.standard_normal((rows, cols), dtype=numpy.float32)
    if kind == "fp16":
        view, buf = padded(rows, cols, numpy.float16, 8, numpy.nan, extra_cols=pad_cols)
        view[...] = cupy.asarray(x32.astype(numpy.float16))
        return view, cupy.asarray(view.get().astype(numpy.float64))
    nan_bits = numpy.uint16(0x7FC0)  # bf16 NaN
    view, buf = padded(rows, cols, numpy.uint16, 8, nan_bits, extra_cols=pad_cols)
    view[...] = cupy.asarray(bf16_bits(x32))
    return view, bf16_value(view).astype(cupy.float64)


def b_operand(rng, n, k, kind, b_layout):
    """The B operand as the kernel takes it for b_layout ("nk": [N, K]; "kn": [K, N], a weight as stored,
    NaN in its row padding), its value as float64 [N, K], and a K-contiguous [N, K] copy for cuBLAS."""
    if b_layout == "nk":
        b, b64 = operand(rng, n, k, kind)
        return b, b64, b
    b_kn, b_kn64 = operand(rng, k, n, kind)
    return b_kn, b_kn64.T, cupy.ascontiguousarray(b_kn.T)


def cublas_tn(a, b):
    """a @ b^T by cublasGemmEx on the tensor cores (16-bit in, fp32 out, as the engine calls it): the
    accuracy our kernel must match (tensor-core fp32 accumulation is less exact than IEEE fp32)."""
    m, k = a.shape
    n = b.shape[0]
    code = _cublas.R_16F if a.dtype == numpy.float16 else _cublas.R_16BF
    c = cupy.full((m, n), cupy.nan, cupy.float32)
    g = _cublas.Gemm(m, n, k, code, code, _cublas.R_32F, b_trans=True, lda=a.strides[0] // 2,
                     ldb=b.strides[0] // 2, ldc=n, name="reference")
    one, zero = cupy.ones(1, cupy.float32), cupy.zeros(1, cupy.float32)
    g.a.value, g.b.value, g.c.value = a.data.ptr, b.data.ptr, c.data.ptr
    g.alpha.value, g.beta.value = one.data.ptr, zero.data.ptr
    handle = _cublas.acquire(cupy.cuda.Device().id)
    try:
        handle.bind(cupy.cuda.get_current_stream().ptr)
        g(handle)
        cupy.cuda.get_current_stream().synchronize()
    finally:
        _cublas.release(handle)
    return c


def rel_l2(x, ref):
    x = cupy.asarray(x, dtype=cupy.float64)
    return float(cupy.linalg.norm(x - ref) / cupy.linalg.norm(ref))


SHAPES = [
    (1, 64, 16),
    (77, 300, 64),
    (130, 257, 40),      # N odd, K below one 64-wide step
    (129, 136, 200),     # K not a multiple of 64
    (256, 6144, 1536),   # GEMM1 at T = 256
    (1000, 1536, 6144),  # GEMM3-like, K = H
    (1536, 4096, 192),   # more tiles than SMs: persistent CTAs, pipeline phases across tiles
    (2048, 2056, 1000),  # ~2 tiles per CTA with more k-steps than stages; a partial tile column
]


CONFIG_IDS = [f"bn{bn}{'pp' if pp else ''}" for bn, pp in _sm90_gemm.CONFIGS]
QUICK = pytest.mark.sm90_quick

# The quick subset, by test id. (2048, 2056, 1000) with bn128pp: a CTA has 2-3 tiles and 16 k-steps
# > 6 stages, the case where the ping-pong consumers must take turns (see gemm_sm90.cu).
FP32_QUICK = {"130-257-40-fp16-bn256-nk", "129-136-200-bf16-bn128-nk", "1000-1536-6144-fp16-bn256-nk",
              "1536-4096-192-bf16-bn128pp-nk", "2048-2056-1000-fp16-bn128pp-nk", "2048-2056-1000-bf16-bn256-nk",
              "2048-2056-1000-fp16-bn128-nk", "130-257-40-bf16-bn128pp-kn", "129-136-200-fp16-bn256-kn",
              "2048-2056-1000-fp16-bn128pp-kn", "1000-1536-6144-bf16-bn128-kn"}


def marked(cases, quick):
    """pytest.param for each (id, values), marked sm90_quick where the id is in `quick` (all of which must exist)."""
    cases = list(cases)
    missing = set(quick) - {case_id for case_id, _ in cases}
    assert not missing, f"quick-subset ids that match no case: {sorted(missing)}"
    return [pytest.param(*values, id=case_id, marks=[QUICK] if case_id in quick else []) for case_id, values in cases]


FP32_CASES = marked(((f"{m}-{n}-{k}-{kind}-{cid}-{bl}", (m, n, k, kind, config, bl)) for m, n, k in SHAPES
                     for kind in ("fp16", "bf16") for config, cid in zip(_sm90_gemm.CONFIGS, CONFIG_IDS)
                     for bl in _sm90_gemm.B_LAYOUTS), FP32_QUICK)


@pytest.mark.parametrize("m,n,k,kind,config,b_layout", FP32_CASES)
def test_gemm_tn_fp32_out(rng, m, n, k, kind, config, b_layout):
    block_n, pingpong = config
    a, a64 = operand(rng, m, k, kind)
    b, b64, b_nk = b_operand(rng, n, k, kind, b_layout)
    out, buf = padded(m, n, numpy.float32, 2, numpy.nan, extra_rows=3, extra_cols=5)
    a_before, b_before = a.copy(), b.copy()
    result = _sm90_gemm.gemm_tn(a, b, out, block_n=block_n, pingpong=pingpong, b_layout=b_layout)
    cupy.cuda.get_current_stream().synchronize()
    assert result is out
    ref = a64 @ b64.T
    assert bool(cupy.isfinite(out).all()), "some outputs were not written"
    err = rel_l2(out, ref)
    # cuBLAS on the very same operands and tensor cores: the accuracy to match
    cublas = cublas_tn(a, b_nk)
    err_cublas = rel_l2(cublas, ref)
    assert err <= 1e-4 and err <= 4 * err_cublas + 1e-6, (err, err_cublas)
    assert rel_l2(out, cublas.astype(cupy.float64)) <= 8 * err_cublas + 1e-6
    # elementwise: no tile, row or column may be off (a missing or misplaced tile errs by ~scale)
    scale = float(cupy.sqrt(cupy.mean(ref * ref)))
    assert float(cupy.abs(out - ref).max()) <= 1e-3 * scale, (float(cupy.abs(out - ref).max()), scale)
    # margins untouched (still the NaN poison), inputs unchanged
    assert bool(cupy.isnan(buf[:m, n:]).all()) and bool(cupy.isnan(buf[m:]).all())
    assert bool((a.view(cupy.uint16) == a_before.view(cupy.uint16)).all())
    assert bool((b.view(cupy.uint16) == b_before.view(cupy.uint16)).all())


def gelu_grad64(x, t):
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * SQRT_2_OVER_PI * (1 + 0.134145 * x * x)


def activations(rng, m, n, ld_multiple=4):
    """linear1_out (fp32, a padded view) and tanh_inner as a forward pass stores it (fp32); row strides
    multiples of ld_multiple (4: the staged epilogue's 16-byte rows; 2: the least any epilogue takes)."""
    x32 = (2 * rng.standard_normal((m, n))).astype(numpy.float32)
    t32 = numpy.tanh(numpy.float32(SQRT_2_OVER_PI) * (x32 + numpy.float32(0.044715) * x32 * x32 * x32))
    x, _ = padded(m, n, numpy.float32, ld_multiple, numpy.nan, extra_cols=3)
    t, _ = padded(m, n, numpy.float32, ld_multiple, numpy.nan, extra_cols=1)
    x[...] = cupy.asarray(x32)
    t[...] = cupy.asarray(t32)
    return x, t


# (2048, 2056, 1000): several tiles per CTA with more k-steps than stages (the ping-pong turn-taking case)
DGELU_SHAPES = [(1, 64, 16), (77, 302, 64), (130, 257, 40), (256, 6144, 1536), (1536, 4096, 192), (2048, 2056, 1000)]
# Both epilogues (staged: x and t through shared memory by cp.async; direct: global loads) on every case.
DGELU_QUICK = {"77-302-64-bn128-bf16-1.0-False-staged", "130-257-40-bn128pp-fp16-16.0-True-staged",
               "256-6144-1536-bn256-fp16-0.125-False-staged", "1536-4096-192-bn256-bf16-1.0-True-staged",
               "1536-4096-192-bn128pp-fp16-16.0-False-staged", "2048-2056-1000-bn128pp-bf16-1.0-False-staged",
               "2048-2056-1000-bn256-fp16-16.0-False-staged", "1-64-16-bn128-fp16-0.125-True-staged",
               "130-257-40-bn256-bf16-1.0-False-direct", "2048-2056-1000-bn128pp-fp16-16.0-True-direct",
               "130-257-40-bn128pp-fp16-16.0-False-staged-kn", "2048-2056-1000-bn128pp-fp16-16.0-False-staged-kn",
               "2048-2056-1000-bn256-bf16-1.0-True-staged-kn", "77-302-64-bn128-fp16-16.0-True-staged-kn"}


def _dgelu_cases():
    for m, n, k in DGELU_SHAPES:
        for config, cid in zip(_sm90_gemm.CONFIGS, CONFIG_IDS):
            for fmt, alpha in (("bf16", 1.0), ("fp16", 2.0 ** 4), ("fp16", 2.0 ** -3)):
                for memory in (False, True):
                    for epi in _sm90_gemm.EPILOGUES:
                        yield f"{m}-{n}-{k}-{cid}-{fmt}-{alpha}-{memory}-{epi}", (m, n, k, config, fmt, alpha, memory, epi, "nk")
                    if alpha != 2.0 ** -3:  # b [K, N] (the engine's weight2): the staged epilogue, both formats
                        yield (f"{m}-{n}-{k}-{cid}-{fmt}-{alpha}-{memory}-staged-kn",
                               (m, n, k, config, fmt, alpha, memory, "staged", "kn"))


DGELU_CASES = marked(_dgelu_cases(), DGELU_QUICK)


@pytest.mark.parametrize("m,n,k,config,out_format,alpha,memory_mode,epilogue,b_layout", DGELU_CASES)
def test_gemm_tn_dgelu(rng, m, n, k, config, out_format, alpha, memory_mode, epilogue, b_layout):
    block_n, pingpong = config
    kind = "bf16" if out_format == "bf16" else "fp16"  # the plans: bf16 operands -> bf16; fp16 -> scaled fp16
    a, a64 = operand(rng, m, k, kind)
    b, b64, b_nk = b_operand(rng, n, k, kind, b_layout)
    x, t = activations(rng, m, n)
    x_before, t_before = x.copy(), t.copy()
    if out_format == "bf16":
        out, buf = padded(m, n, numpy.uint16, 2, 0x7FC0, extra_rows=2, extra_cols=3)
    else:
        out, buf = padded(m, n, numpy.float16, 2, numpy.nan, extra_rows=2, extra_cols=3)
    amax = cupy.zeros(1, cupy.uint32)
    _sm90_gemm.gemm_tn_dgelu(a, b, x, None if memory_mode else t, out, alpha=alpha, amax=amax, block_n=block_n,
                             pingpong=pingpong, epilogue=epilogue, b_layout=b_layout)
    cupy.cuda.get_current_stream().synchronize()
    x64, t64 = x.astype(cupy.float64), t.astype(cupy.float64)
    if memory_mode:
        t64 = cupy.tanh(SQRT_2_OVER_PI * (x64 + 0.044715 * x64 ** 3))
    ref = (a64 @ b64.T) * gelu_grad64(x64, t64)
    if out_format == "bf16":
        got = bf16_value(out).astype(cupy.float64)
        unit = 2.0 ** -8  # bf16: 8 significant bits, relative rounding error <= 2^-9
        margin = buf.copy()
        margin[:m, :n] = 0x7FC0
        assert bool((margin == 0x7FC0).all()), "stores outside [M, N]"
    else:
        got = out.astype(cupy.float64) / alpha
        unit = 2.0 ** -10
        assert bool(cupy.isnan(buf[:m, n:]).all()) and bool(cupy.isnan(buf[m:]).all()), "stores outside [M, N]"
    assert bool(cupy.isfinite(got).all()), "some outputs were not written"
    err = rel_l2(got, ref)
    assert err <= unit, err  # RMS rounding error is unit / (2 sqrt 3); fp32 accumulation adds ~1e-6
    scale = float(cupy.sqrt(cupy.mean(ref * ref)))
    bound = unit * cupy.abs(ref) + 1e-3 * scale  # one rounding (half a unit) plus accumulation noise
    worst = float((cupy.abs(got - ref) / bound).max())
    assert worst <= 1.0, worst
    # the same through cuBLAS + a separate fp32 pass, rounded the same way: equal up to one rounding step
    g32 = cublas_tn(a, b_nk) * gelu_grad64(x64, t64).astype(cupy.float32)
    if out_format == "bf16":
        sep = bf16_value(bf16_bits(g32)).astype(cupy.float64)
        assert float((got == sep).mean()) >= 0.95
    else:
        sep = (g32 * numpy.float32(alpha)).astype(cupy.float16).astype(cupy.float64) / alpha
        assert float((got == sep).mean()) >= 0.95
    assert float((cupy.abs(got - sep) / (2 * unit * cupy.abs(sep) + 1e-3 * scale)).max()) <= 1.0
    assert bool((x == x_before).all()) and bool((t == t_before).all())
    # max |g| before rounding and scaling, from the fp32 values: within accumulation error of the exact one
    exact_max = float(cupy.abs(ref).max())
    assert abs(float(amax.view(cupy.float32)[0]) - exact_max) <= 1e-4 * exact_max, (amax.view(cupy.float32), exact_max)


PLANES_CASES = [pytest.param(m, n, k, config, memory, epilogue, b_layout,
                             id=f"{m}-{n}-{k}-{cid}-{memory}-{epilogue}-{b_layout}",
                             marks=[QUICK] if (cid, epilogue) in (("bn256", "staged"), ("bn128pp", "direct")) else [])
                for m, n, k in ((77, 302, 64), (1000, 1032, 384))
                for config, cid in zip(_sm90_gemm.CONFIGS, CONFIG_IDS)
                for memory, epilogue, b_layout in ((False, "staged", "kn"), (True, "staged", "nk"),
                                                   (False, "direct", "kn"))]


@pytest.mark.parametrize("m,n,k,config,memory_mode,epilogue,b_layout", PLANES_CASES)
def test_dgelu_bf16x3_planes(rng, m, n, k, config, memory_mode, epilogue, b_layout):
    """planes=3 (the bf16x3 plan's grad_linear1): columns [0, N) and [2N, 3N) hold hi, bit-identical to the
    one-plane bf16 output of the same kernel on the same operands (the same accumulators and rounding);
    [N, 2N) holds lo = bf16(g - hi), so hi + lo is g to ~2^-16 of the float64 reference; nothing is
    stored outside [M, 3N]."""
    block_n, pingpong = config
    a, a64 = operand(rng, m, k, "bf16")
    b, b64, _ = b_operand(rng, n, k, "bf16", b_layout)
    x, t = activations(rng, m, n)
    tt = None if memory_mode else t
    kw = dict(block_n=block_n, pingpong=pingpong, epilogue=epilogue, b_layout=b_layout)
    one, _ = padded(m, n, numpy.uint16, 2, 0x7FC0)
    _sm90_gemm.gemm_tn_dgelu(a, b, x, tt, one, **kw)
    out, buf = padded(m, 3 * n, numpy.uint16, 2, 0x7FC0, extra_rows=2, extra_cols=5)
    amax = cupy.zeros(1, cupy.uint32)
    _sm90_gemm.gemm_tn_dgelu(a, b, x, tt, out, amax=amax, planes=3, **kw)
    cupy.cuda.get_current_stream().synchronize()
    hi, lo, hi2 = out[:, :n], out[:, n:2 * n], out[:, 2 * n:]
    assert int((hi != one).sum()) == 0, "plane 0 is not the one-plane bf16 result"
    assert int((hi2 != hi).sum()) == 0, "plane 2 is not plane 0"
    margin = buf.copy()
    margin[:m, :3 * n] = 0x7FC0
    assert bool((margin == 0x7FC0).all()), "stores outside [M, 3N]"
    x64, t64 = x.astype(cupy.float64), t.astype(cupy.float64)
    if memory_mode:
        t64 = cupy.tanh(SQRT_2_OVER_PI * (x64 + 0.044715 * x64 ** 3))
    ref = (a64 @ b64.T) * gelu_grad64(x64, t64)
    got = bf16_value(hi).astype(cupy.float64) + bf16_value(lo).astype(cupy.float64)
    assert bool(cupy.isfinite(got).all())
    hi_only = rel_l2(bf16_value(hi).astype(cupy.float64), ref)
    both = rel_l2(got, ref)
    assert both <= 2.0 ** -15, both  # hi + lo: ~16 significant bits, plus fp32 accumulation (~1e-6)
    assert both * 20 <= hi_only, (both, hi_only)  # lo carries what hi dropped
    exact_max = float(cupy.abs(ref).max())
    assert abs(float(amax.view(cupy.float32)[0]) - exact_max) <= 1e-4 * exact_max


NONFINITE_CASES = [pytest.param(config, fmt, epilogue, id=f"{cid}-{fmt}-{epilogue}",
                                 marks=[QUICK] if (cid, epilogue) in (("bn256", "staged"), ("bn128pp", "direct")) else [])
                    for config, cid in zip(_sm90_gemm.CONFIGS, CONFIG_IDS) for fmt in ("fp16", "bf16", "bf16x3")
                    for epilogue in _sm90_gemm.EPILOGUES]


@pytest.mark.parametrize("config,out_format,epilogue", NONFINITE_CASES)
def test_dgelu_amax_leaves_out_non_finite_values(rng, config, out_format, epilogue):
    """g = NaN (linear1_out NaN) and g = +-Inf (linear1_out 1e30 with tanh_inner 0.5: gelu' overflows) are
    stored as such and left out of amax, which is max |g| over the finite g: one Inf or NaN must not decide
    the scale of the whole tensor, nor hide the finite neighbour it shares a stored pair with."""
    block_n, pingpong = config
    m, n, k = 300, 520, 96  # 3 x 3-5 tiles, N ends inside a tile
    kind = "fp16" if out_format == "fp16" else "bf16"
    a, a64 = operand(rng, m, k, kind)
    b, b64 = operand(rng, n, k, kind)
    x, t = activations(rng, m, n)
    r_nan, c_nan = rng.integers(0, m, 40), rng.integers(0, n, 40)
    r_inf, c_inf = rng.integers(0, m, 40), rng.integers(0, n, 40)
    x[cupy.asarray(r_nan), cupy.asarray(c_nan)] = cupy.nan
    x[cupy.asarray(r_inf), cupy.asarray(c_inf)] = 1e30
    t[cupy.asarray(r_inf), cupy.asarray(c_inf)] = 0.5
    planes = 3 if out_format == "bf16x3" else 1
    alpha = 2.0 ** -2 if out_format == "fp16" else 1.0
    if out_format == "fp16":
        out = cupy.full((m, n), cupy.nan, cupy.float16)
    else:
        out = cupy.full((m, planes * n), 0x7FC0, cupy.uint16)
    amax = cupy.zeros(1, cupy.uint32)
    _sm90_gemm.gemm_tn_dgelu(a, b, x, t, out, alpha=alpha, amax=amax, block_n=block_n, pingpong=pingpong,
                             epilogue=epilogue, planes=planes)
    cupy.cuda.get_current_stream().synchronize()
    nan_at, inf_at = cupy.isnan(x), x == 1e30
    acc64 = a64 @ b64.T
    ref = acc64 * gelu_grad64(cupy.where(inf_at | nan_at, 0.0, x.astype(cupy.float64)), t.astype(cupy.float64))
    if out_format == "fp16":
        got = out.astype(cupy.float64) / alpha
    else:
        got = bf16_value(out[:, :n]).astype(cupy.float64)
    assert int(nan_at.sum()) > 0 and int(inf_at.sum()) > 0
    assert bool((cupy.isnan(got) == nan_at).all()), "NaN where g is not NaN, or a NaN g not stored as NaN"
    # gelu'(1e30, 0.5) overflows fp32 to +Inf, so g = sign(acc) Inf
    assert bool((got[inf_at] == cupy.sign(acc64[inf_at]) * cupy.inf).all()), "an infinite g not stored as such"
    finite = ~(nan_at | inf_at)
    assert bool(cupy.isfinite(got[finite]).all())
    err = float((cupy.abs(got - ref)[finite] / (2.0 ** -7 * cupy.abs(ref[finite]) + 1e-3)).max())
    assert err <= 1.0, err
    exact_max = float(cupy.abs(ref[finite]).max())
    got_max = float(amax.view(cupy.float32)[0])
    assert abs(got_max - exact_max) <= 1e-4 * exact_max, (got_max, exact_max)


# (4100, 3000, 256) bn128pp: 32 x 24 tiles on 132 CTAs, 5-6 tiles per CTA, so each consumer's slot ring
# is refilled across 3 tiles; N = 3000 ends inside a 16-column group; strides of 3004 / 3004 / 3006.
EQUAL_CASES = [pytest.param(4100, 3000, 256, config, fmt, memory, id=f"{cid}-{fmt}-{memory}",
                            marks=[QUICK] if (cid, memory) in (("bn128pp", False), ("bn256", True)) else [])
               for config, cid in zip(_sm90_gemm.CONFIGS, CONFIG_IDS) for fmt in ("bf16", "fp16")
               for memory in (False, True)]


@pytest.mark.parametrize("m,n,k,config,out_format,memory_mode", EQUAL_CASES)
def test_dgelu_epilogues_agree_bitwise(rng, m, n, k, config, out_format, memory_mode):
    """The staged and the direct epilogue do the same fp32 arithmetic on the same accumulators (the
    mainloop is the same code): out and amax must be bit-identical, and every stored element must be
    the float64 reference up to one rounding."""
    block_n, pingpong = config
    kind = "bf16" if out_format == "bf16" else "fp16"
    a, a64 = operand(rng, m, k, kind)
    b, b64 = operand(rng, n, k, kind)
    x, t = activations(rng, m, n)
    alpha = 1.0 if out_format == "bf16" else 2.0 ** -2
    results = {}
    for epilogue in _sm90_gemm.EPILOGUES:
        if out_format == "bf16":
            out, buf = padded(m, n, numpy.uint16, 2, 0x7FC0, extra_rows=1, extra_cols=6)
        else:
            out, buf = padded(m, n, numpy.float16, 2, numpy.nan, extra_rows=1, extra_cols=6)
        amax = cupy.zeros(1, cupy.uint32)
        _sm90_gemm.gemm_tn_dgelu(a, b, x, None if memory_mode else t, out, alpha=alpha, amax=amax, block_n=block_n,
                                 pingpong=pingpong, epilogue=epilogue)
        cupy.cuda.get_current_stream().synchronize()
        results[epilogue] = (out.view(cupy.uint16).copy(), buf.view(cupy.uint16).copy(), int(amax[0]))
    staged, direct = results["staged"], results["direct"]
    differ = int((staged[0] != direct[0]).sum())
    assert differ == 0, f"{differ} of {m * n} elements differ between the staged and the direct epilogue"
    assert (staged[1] == direct[1]).all(), "the margins differ (a store outside [M, N])"
    assert staged[2] == direct[2], (staged[2], direct[2])
    x64, t64 = x.astype(cupy.float64), t.astype(cupy.float64)
    if memory_mode:
        t64 = cupy.tanh(SQRT_2_OVER_PI * (x64 + 0.044715 * x64 ** 3))
    ref = (a64 @ b64.T) * gelu_grad64(x64, t64)
    codes = staged[0]
    if out_format == "bf16":
        got, unit = bf16_value(codes).astype(cupy.float64), 2.0 ** -8
    else:
        got, unit = codes.view(cupy.float16).astype(cupy.float64) / alpha, 2.0 ** -10
    scale = float(cupy.sqrt(cupy.mean(ref * ref)))
    worst = float((cupy.abs(got - ref) / (unit * cupy.abs(ref) + 1e-3 * scale)).max())
    assert worst <= 1.0, worst


def gelu_codes32(x, t, alpha):
    """fp16 codes of alpha * 0.5 * x * (1 + t), evaluated in float32 in that order (the forward's, the kernel's),
    and max |0.5 * x * (1 + t)| (its bits as a uint32)."""
    g = numpy.float32(0.5) * x * (numpy.float32(1.0) + t)
    return (g * numpy.float32(alpha)).astype(cupy.float16).view(cupy.uint16), int(cupy.abs(g).max().view(cupy.uint32))


# (4100, 3000, 256): several tiles per CTA, N ending inside a group, rows padded; (77, 302, 64): partial tiles;
# bn256 cooperative takes the direct epilogue only (GELU_NO_STAGED)
GELU_CASES = [pytest.param(m, n, k, config, memory, epilogue, id=f"{m}-{n}-{k}-{cid}-{memory}-{epilogue}",
                           marks=[QUICK] if (m, cid, epilogue) in ((4100, "bn128pp", "staged"), (77, "bn256", "direct"),
                                                                  (4100, "bn128", "staged")) else [])
              for m, n, k in ((77, 302, 64), (4100, 3000, 256))
              for config, cid in zip(_sm90_gemm.CONFIGS, CONFIG_IDS) for memory in (False, True)
              for epilogue in _sm90_gemm.EPILOGUES
              if not (epilogue == "staged" and (_sm90_gemm.EPI_DGELU_F16G,) + config == _sm90_gemm.GELU_NO_STAGED)]


@pytest.mark.parametrize("m,n,k,config,memory_mode,epilogue", GELU_CASES)
def test_dgelu_writes_gelu_out_too(rng, m, n, k, config, memory_mode, epilogue):
    """gelu_out beside the fp16 dgelu output (EPI_DGELU_F16G, the tf32 plan's GEMM1): grad_linear1 and its amax
    bit-identical to the plain fp16 epilogue's on the same inputs, gelu_out's codes those of alpha * 0.5 x (1 + t)
    rounded once from float32 (t given; memory mode recomputes t: within one fp16 step), its amax exact, and
    nothing stored outside either [M, N] (NaN-poisoned margins)."""
    block_n, pingpong = config
    a, _ = operand(rng, m, k, "fp16")
    b, _ = operand(rng, n, k, "fp16")
    x, t = activations(rng, m, n)
    x_before, t_before = x.copy(), t.copy()
    alpha, gelu_alpha = 2.0 ** -2, 2.0 ** 5
    tanh_inner = None if memory_mode else t
    ref_out, _ = padded(m, n, numpy.float16, 2, numpy.nan)
    ref_amax = cupy.zeros(1, cupy.uint32)
    _sm90_gemm.gemm_tn_dgelu(a, b, x, tanh_inner, ref_out, alpha=alpha, amax=ref_amax, block_n=block_n,
                             pingpong=pingpong, epilogue=epilogue)
    out, out_buf = padded(m, n, numpy.float16, 2, numpy.nan, extra_rows=1, extra_cols=6)
    gelu, gelu_buf = padded(m, n, numpy.float16, 2, numpy.nan, extra_rows=1, extra_cols=6)  # ldg == ldc: staged
    amax, gelu_amax = cupy.zeros(1, cupy.uint32), cupy.zeros(1, cupy.uint32)
    _sm90_gemm.gemm_tn_dgelu(a, b, x, tanh_inner, out, alpha=alpha, amax=amax, block_n=block_n, pingpong=pingpong,
                             epilogue=epilogue, gelu_out=gelu, gelu_alpha=gelu_alpha, gelu_amax=gelu_amax)
    cupy.cuda.get_current_stream().synchronize()
    assert int((out.view(cupy.uint16) != ref_out.view(cupy.uint16)).sum()) == 0, "grad_linear1 changed"
    assert int(amax[0]) == int(ref_amax[0])
    for buf in (out_buf, gelu_buf):
        assert bool(cupy.isnan(buf[:m, n:]).all()) and bool(cupy.isnan(buf[m:]).all()), "stores outside [M, N]"
    assert bool(cupy.isfinite(gelu).all()), "gelu_out not written everywhere"
    if memory_mode:
        x64 = x.astype(cupy.float64)
        t32 = cupy.tanh(SQRT_2_OVER_PI * (x64 + 0.044715 * x64 ** 3)).astype(cupy.float32)
        codes, bits = gelu_codes32(x, t32, gelu_alpha)
        got, want = gelu.astype(cupy.float64), codes.view(cupy.float16).astype(cupy.float64)
        # tanhf against a rounded float64 tanh: a few ulps of t, which 1 + t (cancelling where x << 0) turns into
        # large relative but tiny absolute differences: one fp16 step, or 2^-20 of the largest value
        step = 2.0 ** -10 * cupy.abs(want) + 2.0 ** -20 * float(cupy.abs(want).max())
        assert float((cupy.abs(got - want) / step).max()) <= 1.0
        assert float((gelu.view(cupy.uint16) == codes).mean()) >= 0.99
        ref_max = float(cupy.asarray(bits, dtype=cupy.uint32).view(cupy.float32))
        assert abs(float(gelu_amax.view(cupy.float32)[0]) - ref_max) <= 1e-6 * ref_max
    else:
        codes, bits = gelu_codes32(x, t, gelu_alpha)
        differ = int((gelu.view(cupy.uint16) != codes).sum())
        assert differ == 0, f"{differ} of {m * n} gelu_out codes differ from fp16(alpha * 0.5 x (1 + t))"
        assert int(gelu_amax[0]) == bits
    assert bool((x == x_before).all()) and bool((t == t_before).all())


@QUICK
def test_gelu_out_is_checked(rng):
    m, n, k = 64, 128, 64
    a, _ = operand(rng, m, k, "fp16")
    b, _ = operand(rng, n, k, "fp16")
    x, t = activations(rng, m, n)
    out = cupy.full((m, n), cupy.nan, cupy.float16)
    call = lambda **kw: _sm90_gemm.gemm_tn_dgelu(a, b, x, t, out, block_n=128, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="gelu_out must have shape"):
        call(gelu_out=cupy.zeros((m, n + 1), cupy.float16))
    with pytest.raises(ValueError, match="gelu_out must be float16"):
        call(gelu_out=cupy.zeros((m, n), cupy.float32))
    with pytest.raises(ValueError, match="gelu_out must not overlap out"):
        call(gelu_out=out)
    with pytest.raises(ValueError, match="gelu_alpha must be a power of two"):
        call(gelu_out=cupy.zeros((m, n), cupy.float16), gelu_alpha=3.0)
    with pytest.raises(ValueError, match="gelu_amax must be None or a 1-element uint32"):
        call(gelu_out=cupy.zeros((m, n), cupy.float16), gelu_amax=cupy.zeros(2, cupy.uint32))
    with pytest.raises(ValueError, match="apply only with a gelu_out"):
        call(gelu_alpha=2.0)
    with pytest.raises(ValueError, match="no staged epilogue"):
        _sm90_gemm.gemm_tn_dgelu(a, b, x, t, out, block_n=256, epilogue="staged",
                                 gelu_out=cupy.zeros((m, n), cupy.float16))
    wide = cupy.zeros((m, n + 8), cupy.float16)[:, :n]
    with pytest.raises(ValueError, match="row stride equal to out's"):
        call(epilogue="staged", gelu_out=wide)
    bf16_out = cupy.zeros((m, n), cupy.uint16)
    with pytest.raises(ValueError, match="only beside a float16 out"):
        _sm90_gemm.gemm_tn_dgelu(a.view(cupy.uint16), b.view(cupy.uint16), x, t, bf16_out, block_n=128,
                                 gelu_out=cupy.zeros((m, n), cupy.float16))
    assert bool(cupy.isnan(out).all()), "a refused call wrote out"


@QUICK
@pytest.mark.parametrize("memory_mode", [False, True])
def test_dgelu_rows_off_16_bytes_take_the_direct_epilogue(rng, memory_mode):
    """Rows of linear1_out / tanh_inner that do not start on 16-byte boundaries (row strides of 2 mod 4):
    epilogue=None runs the direct epilogue (bitwise its result), an explicit "staged" is refused."""
    m, n, k = 200, 258, 96
    a, _ = operand(rng, m, k, "fp16")
    b, _ = operand(rng, n, k, "fp16")
    x, t = activations(rng, m, n, ld_multiple=2)
    assert x.strides[0] // 4 % 4 == 2, x.strides  # linear1_out's rows off 16-byte boundaries (t's are on them)
    t_arg = None if memory_mode else t
    outs = {}
    for epilogue in (None, "direct"):
        out = cupy.full((m, n), cupy.nan, cupy.float16)
        amax = cupy.zeros(1, cupy.uint32)
        _sm90_gemm.gemm_tn_dgelu(a, b, x, t_arg, out, alpha=0.5, amax=amax, block_n=128, pingpong=True,
                                 epilogue=epilogue)
        cupy.cuda.get_current_stream().synchronize()
        assert bool(cupy.isfinite(out).all())
        outs[epilogue] = (out.view(cupy.uint16), int(amax[0]))
    assert bool((outs[None][0] == outs["direct"][0]).all()) and outs[None][1] == outs["direct"][1]
    with pytest.raises(ValueError, match="16-byte boundaries"):
        _sm90_gemm.gemm_tn_dgelu(a, b, x, t_arg, cupy.empty((m, n), cupy.float16), epilogue="staged")


@QUICK
def test_dgelu_bf16_truncates_finite_overflow():
    """A finite fp32 result above the largest bf16 is truncated to it, not rounded to infinity (the
    rule of common.cuh's bf16_bits, so grad_linear1 is what the engine's dgelu kernel writes)."""
    m, n, k = 64, 64, 16
    bf16_max = float(bf16_value(numpy.array([0x7F7F], numpy.uint16))[0])  # 3.3895e38
    a32 = numpy.zeros((m, k), numpy.float32)
    b32 = numpy.zeros((n, k), numpy.float32)
    a32[:, 0] = 1.0
    b32[:, 0] = bf16_max
    a, b = cupy.asarray(bf16_bits(a32)), cupy.asarray(bf16_bits(b32))
    # x = 0: gelu'(0, t) = 0.5 (1 + t). t = 1 gives exactly bf16_max; t = 1.005 gives 3.398e38, finite
    # in fp32 but past the midpoint 3.3961e38 where round-to-nearest would give inf.
    x = cupy.zeros((m, n), cupy.float32)
    t = cupy.ones((m, n), cupy.float32)
    t[:, n // 2:] = 1.005
    assert 3.3961e38 < bf16_max * 0.5 * (1 + 1.005) < 3.4028e38
    out = cupy.full((m, n), 0x7FC0, cupy.uint16)
    _sm90_gemm.gemm_tn_dgelu(a, b, x, t, out)
    cupy.cuda.get_current_stream().synchronize()
    assert bool((out == 0x7F7F).all()), cupy.unique(out)


# ---- clusters of two CTAs (cluster=2: the B tile multicast to two vertically adjacent tiles) ------------
# (77, 300, 64): one row of tiles, the second CTA's tile wholly past M; (300, 257, 200): three rows (the last
# pair half past M), N odd; (1536, 4096, 192) and (2048, 2056, 1000): several tile pairs per cluster with
# more k-steps than stages; (8192, 6144, 1536): GEMM1 at T = 8192, ~12 pairs per cluster.
CLUSTER_SHAPES = [(1, 64, 16), (77, 300, 64), (300, 257, 200), (1536, 4096, 192), (2048, 2056, 1000),
                  (8192, 6144, 1536)]
CLUSTER_QUICK = {"300-257-200-fp16-bn128pp-nk", "2048-2056-1000-bf16-bn256-kn", "77-300-64-fp16-bn256-kn",
                 "2048-2056-1000-fp16-bn128pp-kn", "8192-6144-1536-fp16-bn256-kn"}
CLUSTER_CASES = marked(((f"{m}-{n}-{k}-{kind}-{cid}-{bl}", (m, n, k, kind, config, bl)) for m, n, k in CLUSTER_SHAPES
                        for kind in ("fp16", "bf16") for config, cid in zip(_sm90_gemm.CONFIGS, CONFIG_IDS)
                        for bl in _sm90_gemm.B_LAYOUTS), CLUSTER_QUICK)


@pytest.mark.parametrize("m,n,k,kind,config,b_layout", CLUSTER_CASES)
def test_cluster2_fp32_out_is_the_single_cta_result(rng, m, n, k, kind, config, b_layout):
    """Each tile runs the same wgmma sequence with or without the cluster: out must be bit-identical to
    cluster=1's, every element written, nothing outside [M, N]; and both are the float64 product to
    tensor-core accuracy (checked where the float64 reference is cheap)."""
    block_n, pingpong = config
    a, a64 = operand(rng, m, k, kind)
    b, b64, _ = b_operand(rng, n, k, kind, b_layout)
    outs = []
    for cluster in (1, 2):
        out, buf = padded(m, n, numpy.float32, 2, numpy.nan, extra_rows=3, extra_cols=5)
        _sm90_gemm.gemm_tn(a, b, out, block_n=block_n, pingpong=pingpong, b_layout=b_layout, cluster=cluster)
        cupy.cuda.get_current_stream().synchronize()
        assert bool(cupy.isfinite(out).all()), f"cluster={cluster}: some outputs were not written"
        assert bool(cupy.isnan(buf[:m, n:]).all()) and bool(cupy.isnan(buf[m:]).all()), "stores outside [M, N]"
        outs.append(out)
    differ = int((outs[0].view(cupy.uint32) != outs[1].view(cupy.uint32)).sum())
    assert differ == 0, f"{differ} of {m * n} elements differ between cluster=1 and cluster=2"
    if m * n * k <= 2 ** 32:
        assert rel_l2(outs[1], a64 @ b64.T) <= 1e-4


CLUSTER_DGELU_CASES = [pytest.param(m, n, k, config, fmt, memory, epilogue, id=f"{m}-{n}-{k}-{cid}-{fmt}-{memory}-{epilogue}",
                                    marks=[QUICK] if (cid, fmt, epilogue) in (("bn128pp", "fp16", "staged"),
                                                                              ("bn256", "bf16x3", "staged"),
                                                                              ("bn128", "bf16", "direct")) else [])
                       for m, n, k in ((300, 302, 200), (4100, 3000, 256), (8192, 6144, 1536))
                       for config, cid in zip(_sm90_gemm.CONFIGS, CONFIG_IDS)
                       for fmt in ("fp16", "bf16", "bf16x3")
                       for memory, epilogue in ((False, "staged"), (True, "staged"), (False, "direct"))
                       if (m, n) != (8192, 6144) or not memory]


@pytest.mark.parametrize("m,n,k,config,out_format,memory_mode,epilogue", CLUSTER_DGELU_CASES)
def test_cluster2_dgelu_is_the_single_cta_result(rng, m, n, k, config, out_format, memory_mode, epilogue):
    """The fused GEMM1 + dgelu (fp16 scaled, bf16, bf16x3 planes) with cluster=2: out, amax and the poisoned
    margins bit-identical to cluster=1 (b as the engine passes it, [K, N]), and the result within one
    rounding of float64 where the reference is cheap."""
    block_n, pingpong = config
    kind = "fp16" if out_format == "fp16" else "bf16"
    planes = 3 if out_format == "bf16x3" else 1
    a, a64 = operand(rng, m, k, kind)
    b, b64, _ = b_operand(rng, n, k, kind, "kn")
    x, t = activations(rng, m, n)
    alpha = 2.0 ** -2 if out_format == "fp16" else 1.0
    results = []
    for cluster in (1, 2):
        if out_format == "fp16":
            out, buf = padded(m, n, numpy.float16, 2, numpy.nan, extra_rows=1, extra_cols=6)
        else:
            out, buf = padded(m, planes * n, numpy.uint16, 2, 0x7FC0, extra_rows=1, extra_cols=6)
        amax = cupy.zeros(1, cupy.uint32)
        _sm90_gemm.gemm_tn_dgelu(a, b, x, None if memory_mode else t, out, alpha=alpha, amax=amax, block_n=block_n,
                                 pingpong=pingpong, epilogue=epilogue, b_layout="kn", planes=planes, cluster=cluster)
        cupy.cuda.get_current_stream().synchronize()
        results.append((buf.view(cupy.uint16).copy(), int(amax[0]), out))
    (buf1, amax1, out1), (buf2, amax2, _) = results
    differ = int((buf1 != buf2).sum())
    assert differ == 0, f"{differ} elements of the output buffer differ between cluster=1 and cluster=2"
    assert amax1 == amax2 and amax1 > 0, (amax1, amax2)
    codes = out1[:, :n]
    got = (codes.astype(cupy.float64) / alpha) if out_format == "fp16" else bf16_value(codes).astype(cupy.float64)
    assert bool(cupy.isfinite(got).all()), "some outputs were not written"
    if m * n * k <= 2 ** 32:
        x64, t64 = x.astype(cupy.float64), t.astype(cupy.float64)
        if memory_mode:
            t64 = cupy.tanh(SQRT_2_OVER_PI * (x64 + 0.044715 * x64 ** 3))
        ref = (a64 @ b64.T) * gelu_grad64(x64, t64)
        assert rel_l2(got, ref) <= (2.0 ** -10 if out_format == "fp16" else 2.0 ** -8)


# ---- tile order (raster=R: bands of R tile rows, column by column) ---------------------------------------
# (1300, 3000, 256): 11 tile rows, so bands of 3 and 4 end with a shorter band, and with cluster=2 6 groups of
# two rows (the last half past M); raster 16 >= the rows: the column order again.
RASTER_CASES = [pytest.param(m, n, k, config, cluster, raster, id=f"{m}-{n}-{k}-{cid}-cl{cluster}-r{raster}",
                             marks=[QUICK] if (cid, raster) in (("bn128pp", 3), ("bn256", 4)) else [])
                for m, n, k in ((1300, 3000, 256), (2048, 2056, 1000))
                for config, cid in zip(_sm90_gemm.CONFIGS, CONFIG_IDS)
                for cluster in _sm90_gemm.CLUSTERS for raster in (3, 4, 16)]


@pytest.mark.parametrize("m,n,k,config,cluster,raster", RASTER_CASES)
def test_raster_changes_the_order_not_a_bit(rng, m, n, k, config, cluster, raster):
    """Each tile is computed the same way whatever the order: fp32 out and the fused dgelu (fp16, amax) are
    bit-identical to raster=0's, with every element written and nothing outside [M, N]."""
    block_n, pingpong = config
    a, a64 = operand(rng, m, k, "fp16")
    b, b64, _ = b_operand(rng, n, k, "fp16", "kn")
    x, t = activations(rng, m, n)
    kw = dict(block_n=block_n, pingpong=pingpong, b_layout="kn", cluster=cluster)
    got = {}
    for r in (0, raster):
        out, buf = padded(m, n, numpy.float32, 2, numpy.nan, extra_rows=2, extra_cols=3)
        _sm90_gemm.gemm_tn(a, b, out, raster=r, **kw)
        g16, gbuf = padded(m, n, numpy.float16, 2, numpy.nan, extra_rows=2, extra_cols=3)
        amax = cupy.zeros(1, cupy.uint32)
        _sm90_gemm.gemm_tn_dgelu(a, b, x, t, g16, alpha=0.5, amax=amax, raster=r, **kw)
        cupy.cuda.get_current_stream().synchronize()
        assert bool(cupy.isfinite(out).all()) and bool(cupy.isfinite(g16).all()), f"raster={r}: outputs not written"
        assert bool(cupy.isnan(buf[:m, n:]).all()) and bool(cupy.isnan(buf[m:]).all()), "stores outside [M, N]"
        assert bool(cupy.isnan(gbuf[:m, n:]).all()) and bool(cupy.isnan(gbuf[m:]).all()), "stores outside [M, N]"
        got[r] = (buf.view(cupy.uint32).copy(), gbuf.view(cupy.uint16).copy(), int(amax[0]))
    assert int((got[0][0] != got[raster][0]).sum()) == 0, "fp32 out differs from raster=0's"
    assert int((got[0][1] != got[raster][1]).sum()) == 0, "dgelu out differs from raster=0's"
    assert got[0][2] == got[raster][2] > 0
    assert rel_l2(got[raster][0][:m, :n].view(cupy.float32), a64 @ b64.T) <= 1e-4


# ---- input validation ---------------------------------------------------------------------------
def _ok_operands(m=64, n=64, k=64, dtype=numpy.float16):
    a = cupy.ones((m, k), dtype)
    b = cupy.ones((n, k), dtype)
    return a, b


@pytest.mark.parametrize("case,message", [
    ("k0", "K"),
    ("lda", "multiple of 8"),
    ("misaligned", "16-byte aligned"),
    ("noncontig", "contiguous"),
    ("dtype", "float16"),
    ("mixed", "dtype of a"),
    ("kmismatch", "K = a.shape"),
    ("outshape", "shape"),
    ("outdtype", "float32"),
    ("overlap", "overlap"),
    ("block_n", "block_n"),
    ("pingpong256", "pingpong"),
    ("numpy", "cupy.ndarray"),
    ("b_layout", "b_layout"),
    ("kn_kmismatch", r"b must be \[K, N\]"),
    ("kn_ldb", "multiple of 8"),
    ("cluster", "cluster must be one of"),
    ("raster", "raster must be an int >= 0"),
])
def test_gemm_tn_rejects_bad_input(case, message):
    a, b = _ok_operands()
    out = cupy.empty((64, 64), cupy.float32)
    if case == "k0":
        a, b = cupy.ones((64, 0), cupy.float16), cupy.ones((64, 0), cupy.float16)
    elif case == "lda":
        a, b = cupy.ones((64, 20), cupy.float16), cupy.ones((64, 20), cupy.float16)
    elif case == "misaligned":
        a = cupy.ones((64 * 64 + 8,), cupy.float16)[1:1 + 64 * 64].reshape(64, 64)
    elif case == "noncontig":
        a = cupy.ones((64, 128), cupy.float16)[:, ::2]
    elif case == "dtype":
        a, b = a.astype(cupy.float32), b.astype(cupy.float32)
    elif case == "mixed":
        b = b.view(cupy.uint16)
    elif case == "kmismatch":
        b = cupy.ones((64, 72), cupy.float16)
    elif case == "outshape":
        out = cupy.empty((64, 65), cupy.float32)
    elif case == "outdtype":
        out = cupy.empty((64, 64), cupy.float16)
    elif case == "overlap":
        buf = cupy.ones((64, 64), cupy.float32)
        a = buf.view(cupy.float16)[:, :64]
        out = buf
    elif case == "numpy":
        a = a.get()
    elif case == "kn_kmismatch":
        b = cupy.ones((72, 64), cupy.float16)  # [K, N] with K = 72, a has K = 64
    elif case == "kn_ldb":
        b = cupy.ones((64, 68), cupy.float16)[:, :64]  # [K, N] with a row stride of 68: not a multiple of 8
    layout = "tn" if case == "b_layout" else ("kn" if case.startswith("kn") else "nk")
    with pytest.raises(ValueError, match=message):
        _sm90_gemm.gemm_tn(a, b, out, block_n=192 if case == "block_n" else 256, pingpong=case == "pingpong256",
                           b_layout=layout, cluster=3 if case == "cluster" else 1, raster=-1 if case == "raster" else 0)


@pytest.mark.parametrize("case,message", [
    ("alpha_not_pow2", "power of two"),
    ("alpha_bf16", "alpha"),
    ("outdtype", "uint16"),
    ("xshape", "linear1_out"),
    ("tdtype", "tanh_inner"),
    ("overlap_x", "overlap"),
    ("amax_dtype", "amax"),
    ("epilogue", "epilogue"),
    ("planes_value", "planes"),
    ("planes_fp16_operands", "bf16 operands"),
    ("planes_out_shape", "out must have shape"),
    ("planes_odd_n", "even N"),
])
def test_gemm_tn_dgelu_rejects_bad_input(case, message):
    a, b = _ok_operands()
    x = cupy.zeros((64, 64), cupy.float32)
    t = cupy.zeros((64, 64), cupy.float32)
    out = cupy.empty((64, 64), cupy.float16)
    alpha = 1.0
    amax = None
    if case == "amax_dtype":
        amax = cupy.zeros(1, cupy.float32)
    elif case == "alpha_not_pow2":
        alpha = 3.0
    elif case == "alpha_bf16":
        out = cupy.empty((64, 64), cupy.uint16)
        alpha = 2.0
    elif case == "outdtype":
        out = cupy.empty((64, 64), cupy.float32)
    elif case == "xshape":
        x = cupy.zeros((64, 66), cupy.float32)
    elif case == "tdtype":
        t = cupy.zeros((64, 64), cupy.float16)
    elif case == "overlap_x":
        out = x.view(cupy.float16)[:, :64]
    planes = {"planes_value": 2, "planes_fp16_operands": 3, "planes_out_shape": 3, "planes_odd_n": 3}.get(case, 1)
    if case == "planes_odd_n":  # b [N = 63, K], x/t [64, 63], out [64, 189]
        a, b = a.view(cupy.uint16), b.view(cupy.uint16)[:63]
        x, t = x[:, :63], t[:, :63]
        out = cupy.empty((64, 189), cupy.uint16)
    if case == "planes_fp16_operands":
        out = cupy.empty((64, 192), cupy.uint16)
    elif case == "planes_out_shape":
        a, b = a.view(cupy.uint16), b.view(cupy.uint16)
        out = cupy.empty((64, 64), cupy.uint16)
    with pytest.raises(ValueError, match=message):
        _sm90_gemm.gemm_tn_dgelu(a, b, x, t, out, alpha=alpha, amax=amax, planes=planes,
                                 epilogue="tma" if case == "epilogue" else "staged")


@QUICK
def test_empty_output_is_a_no_op():
    a = cupy.ones((0, 64), cupy.float16)
    b = cupy.ones((64, 64), cupy.float16)
    out = cupy.empty((0, 64), cupy.float32)
    assert _sm90_gemm.gemm_tn(a, b, out) is out


@QUICK
def test_runs_on_the_given_stream(rng):
    """Launched on a non-default stream, the result is there once that stream synchronizes."""
    m, n, k = 512, 1024, 512
    a, a64 = operand(rng, m, k, "fp16")
    b, b64 = operand(rng, n, k, "fp16")
    out, _ = padded(m, n, numpy.float32, 2, numpy.nan)
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()  # the inputs were written on the default stream, which `stream` does not wait for
    _sm90_gemm.gemm_tn(a, b, out, stream=stream)
    stream.synchronize()
    assert rel_l2(out, a64 @ b64.T) <= 1e-4
