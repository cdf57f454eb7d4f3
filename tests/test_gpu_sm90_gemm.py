"""The sm_90a GEMM's fused GEMM1 + dgelu (kernels_cu/gemm_sm90.cu through cupyffn/gemm/sm90/ gemm_tn_dgelu) on a
Hopper GPU; the pair kernel: tests/test_gpu_sm90_pair.py, the epilogue warps: tests/test_gpu_sm90_epilogue_warps.py.

Every result is checked against a float64 product of the same 16-bit operands (and against cuBLAS
on the same operands); outputs are NaN-poisoned before the call, and the poisoned margins around
them (extra columns and rows of the buffer) and NaN padding of the operands' rows must survive:
that is what the predicated stores and the TMA bounds protect.

Quick subset (marker ``sm90_quick``: ~20 representative cases -- odd shapes, K not a multiple of 64,
more tiles than SMs with ping-pong and K > the pipeline depth, each epilogue and memory mode, both
operand types (fp16 out, bf16x3 planes), each schedule, the staged and the direct dgelu epilogue (and the two
bitwise equal);
~1 min on an H200 with a cold compile cache):

    PYTHONPATH=. python3 -m pytest -q -m sm90_quick tests/test_gpu_sm90_gemm.py

or in two processes, ping-pong last, so that a pipeline trap there (which ends the CUDA context and
fails every later test of its process) cannot hide the other verdicts:

    PYTHONPATH=. python3 -m pytest -v --tb=line -m sm90_quick -k "not pp" tests/test_gpu_sm90_gemm.py
    PYTHONPATH=. python3 -m pytest -v --tb=line -m sm90_quick -k pp tests/test_gpu_sm90_gemm.py

The whole file (~200 cases, 18 kernel variants to compile: a few minutes):
``PYTHONPATH=. python3 -m pytest -q tests/test_gpu_sm90_gemm.py`` (or, the same,
``-m "sm90_quick or not sm90_quick"``).
"""

import math

import numpy
import pytest

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
from cupyffn.gemm import cublas as _cublas  # noqa: E402
from cupyffn.gemm import sm90 as _sm90  # noqa: E402

SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


@pytest.fixture(autouse=True)
def hopper():
    if not _sm90.device_supported(cupy.cuda.Device().id):
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


def b_operand(rng, n, k, kind):
    """The B operand as the kernel takes it ([K, N], a weight as stored, NaN in its row padding), its value as
    float64 [N, K], and a K-contiguous [N, K] copy for cuBLAS."""
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


CONFIGS = _sm90.SCHEDULES
CONFIG_IDS = [f"bn{bn}{'pp' if pp else ''}" for bn, pp in CONFIGS]
QUICK = pytest.mark.sm90_quick

def marked(cases, quick):
    """pytest.param for each (id, values), marked sm90_quick where the id is in `quick` (all of which must exist)."""
    cases = list(cases)
    missing = set(quick) - {case_id for case_id, _ in cases}
    assert not missing, f"quick-subset ids that match no case: {sorted(missing)}"
    return [pytest.param(*values, id=case_id, marks=[QUICK] if case_id in quick else []) for case_id, values in cases]


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
# Every epilogue (staged: x and t through shared memory by cp.async; direct: global loads; warps: the cooperative
# 128 x 128 tile's epilogue warps) on every case.
DGELU_QUICK = {"130-257-40-bn128pp-16.0-True-staged", "256-6144-1536-bn256-0.125-False-staged",
               "1536-4096-192-bn128pp-16.0-False-staged", "2048-2056-1000-bn128pp-16.0-False-staged",
               "2048-2056-1000-bn256-16.0-False-staged", "1-64-16-bn128-0.125-True-staged",
               "130-257-40-bn256-16.0-False-direct", "2048-2056-1000-bn128pp-16.0-True-direct",
               "77-302-64-bn128-16.0-True-staged", "2048-2056-1000-bn128-0.125-False-warps"}


def epilogues_of(op, config, epi):
    """The epilogues sm90 has for (op, schedule, epi)."""
    return [e for e in _sm90.EPILOGUES if _sm90.can_implement(_sm90.Sm90Config(op, *config, epi, e))]


def _dgelu_cases():
    for m, n, k in DGELU_SHAPES:
        for config, cid in zip(CONFIGS, CONFIG_IDS):
            for alpha in (2.0 ** 4, 2.0 ** -3):
                for memory in (False, True):
                    for epi in epilogues_of(_sm90.OP_F16, config, _sm90.EPI_DGELU_F16):
                        yield f"{m}-{n}-{k}-{cid}-{alpha}-{memory}-{epi}", (m, n, k, config, alpha, memory, epi)


DGELU_CASES = marked(_dgelu_cases(), DGELU_QUICK)


@pytest.mark.parametrize("m,n,k,config,alpha,memory_mode,epilogue", DGELU_CASES)
def test_gemm_tn_dgelu(rng, m, n, k, config, alpha, memory_mode, epilogue):
    """The tf32 plan's fused GEMM1: fp16(alpha * (a @ b) * gelu'(x, t)) against the float64 reference and against
    cuBLAS + a separate pass, nothing stored outside [M, N], the inputs unchanged, amax max |g|."""
    block_n, pingpong = config
    a, a64 = operand(rng, m, k, "fp16")
    b, b64, b_nk = b_operand(rng, n, k, "fp16")
    x, t = activations(rng, m, n)
    x_before, t_before = x.copy(), t.copy()
    out, buf = padded(m, n, numpy.float16, 2, numpy.nan, extra_rows=2, extra_cols=3)
    amax = cupy.zeros(1, cupy.uint32)
    _sm90.gemm_tn_dgelu(a, b, x, None if memory_mode else t, out, alpha=alpha, amax=amax, block_n=block_n,
                             pingpong=pingpong, epilogue=epilogue)
    cupy.cuda.get_current_stream().synchronize()
    x64, t64 = x.astype(cupy.float64), t.astype(cupy.float64)
    if memory_mode:
        t64 = cupy.tanh(SQRT_2_OVER_PI * (x64 + 0.044715 * x64 ** 3))
    ref = (a64 @ b64.T) * gelu_grad64(x64, t64)
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
    sep = (g32 * numpy.float32(alpha)).astype(cupy.float16).astype(cupy.float64) / alpha
    # (at most 5% of the elements one step apart; a few where the output is small: 4 of 64 at m = 1, n = 64)
    differ = int((got != sep).sum())
    assert differ <= max(4, 0.05 * got.size), (differ, got.size)
    assert float((cupy.abs(got - sep) / (2 * unit * cupy.abs(sep) + 1e-3 * scale)).max()) <= 1.0
    assert bool((x == x_before).all()) and bool((t == t_before).all())
    # max |g| before rounding and scaling, from the fp32 values: within accumulation error of the exact one
    exact_max = float(cupy.abs(ref).max())
    assert abs(float(amax.view(cupy.float32)[0]) - exact_max) <= 1e-4 * exact_max, (amax.view(cupy.float32), exact_max)


PLANES_CASES = [pytest.param(m, n, k, config, memory, epilogue, id=f"{m}-{n}-{k}-{cid}-{memory}-{epilogue}",
                             marks=[QUICK] if (cid, epilogue) in (("bn256", "staged"), ("bn128pp", "direct")) else [])
                for m, n, k in ((77, 302, 64), (1000, 1032, 384))
                for config, cid in zip(CONFIGS, CONFIG_IDS)
                for memory, epilogue in ((False, "staged"), (True, "staged"), (False, "direct"))]


@pytest.mark.parametrize("m,n,k,config,memory_mode,epilogue", PLANES_CASES)
def test_dgelu_bf16x3_planes(rng, m, n, k, config, memory_mode, epilogue):
    """planes=3 (the bf16x3 plan's grad_linear1): columns [0, N) and [2N, 3N) hold hi = bf16(g), within one bf16
    rounding of the float64 reference; [N, 2N) holds lo = bf16(g - hi), so hi + lo is g to ~2^-16 of the float64
    reference; nothing is stored outside [M, 3N]."""
    block_n, pingpong = config
    a, a64 = operand(rng, m, k, "bf16")
    b, b64, _ = b_operand(rng, n, k, "bf16")
    x, t = activations(rng, m, n)
    tt = None if memory_mode else t
    kw = dict(block_n=block_n, pingpong=pingpong, epilogue=epilogue)
    out, buf = padded(m, 3 * n, numpy.uint16, 2, 0x7FC0, extra_rows=2, extra_cols=5)
    amax = cupy.zeros(1, cupy.uint32)
    _sm90.gemm_tn_dgelu(a, b, x, tt, out, amax=amax, planes=3, **kw)
    cupy.cuda.get_current_stream().synchronize()
    hi, lo, hi2 = out[:, :n], out[:, n:2 * n], out[:, 2 * n:]
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
    assert hi_only <= 2.0 ** -8, hi_only  # one bf16 rounding
    both = rel_l2(got, ref)
    assert both <= 2.0 ** -15, both  # hi + lo: ~16 significant bits, plus fp32 accumulation (~1e-6)
    assert both * 20 <= hi_only, (both, hi_only)  # lo carries what hi dropped
    exact_max = float(cupy.abs(ref).max())
    assert abs(float(amax.view(cupy.float32)[0]) - exact_max) <= 1e-4 * exact_max


NONFINITE_CASES = [pytest.param(config, fmt, epilogue, id=f"{cid}-{fmt}-{epilogue}",
                                 marks=[QUICK] if (cid, epilogue) in (("bn256", "staged"), ("bn128pp", "direct")) else [])
                    for config, cid in zip(CONFIGS, CONFIG_IDS) for fmt in ("fp16", "bf16x3")
                    for epilogue in ("staged", "direct")]


@pytest.mark.parametrize("config,out_format,epilogue", NONFINITE_CASES)
def test_dgelu_amax_leaves_out_non_finite_values(rng, config, out_format, epilogue):
    """g = NaN (linear1_out NaN) and g = +-Inf (linear1_out 1e30 with tanh_inner 0.5: gelu' overflows) are
    stored as such and left out of amax, which is max |g| over the finite g: one Inf or NaN must not decide
    the scale of the whole tensor, nor hide the finite neighbour it shares a stored pair with."""
    block_n, pingpong = config
    m, n, k = 300, 520, 96  # 3 x 3-5 tiles, N ends inside a tile
    kind = "fp16" if out_format == "fp16" else "bf16"
    a, a64 = operand(rng, m, k, kind)
    b, b64, _ = b_operand(rng, n, k, kind)
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
    _sm90.gemm_tn_dgelu(a, b, x, t, out, alpha=alpha, amax=amax, block_n=block_n, pingpong=pingpong,
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
               for config, cid in zip(CONFIGS, CONFIG_IDS) for fmt in ("bf16x3", "fp16")
               for memory in (False, True)]


@pytest.mark.parametrize("m,n,k,config,out_format,memory_mode", EQUAL_CASES)
def test_dgelu_epilogues_agree_bitwise(rng, m, n, k, config, out_format, memory_mode):
    """Every epilogue of the schedule (staged, direct, and on the cooperative 128 x 128 tile with an fp16 out the
    epilogue warps) does the same fp32 arithmetic on the same accumulators (the mainloop is the same code): out and
    amax must be bit-identical, and every stored element must be the float64 reference up to one rounding."""
    block_n, pingpong = config
    bf16x3 = out_format == "bf16x3"
    kind, planes = ("bf16", 3) if bf16x3 else ("fp16", 1)
    a, a64 = operand(rng, m, k, kind)
    b, b64, _ = b_operand(rng, n, k, kind)
    x, t = activations(rng, m, n)
    alpha = 1.0 if bf16x3 else 2.0 ** -2
    op, epi = (_sm90.OP_BF16, _sm90.EPI_DGELU_BF16X3) if bf16x3 else (_sm90.OP_F16, _sm90.EPI_DGELU_F16)
    results = {}
    for epilogue in epilogues_of(op, config, epi):
        if bf16x3:
            out, buf = padded(m, 3 * n, numpy.uint16, 2, 0x7FC0, extra_rows=1, extra_cols=6)
        else:
            out, buf = padded(m, n, numpy.float16, 2, numpy.nan, extra_rows=1, extra_cols=6)
        amax = cupy.zeros(1, cupy.uint32)
        _sm90.gemm_tn_dgelu(a, b, x, None if memory_mode else t, out, alpha=alpha, amax=amax, block_n=block_n,
                                 pingpong=pingpong, epilogue=epilogue, planes=planes)
        cupy.cuda.get_current_stream().synchronize()
        results[epilogue] = (out.view(cupy.uint16).copy(), buf.view(cupy.uint16).copy(), int(amax[0]))
    staged = results["staged"]
    for epilogue, other in results.items():
        differ = int((staged[0] != other[0]).sum())
        assert differ == 0, f"{differ} of {m * n * planes} elements differ between the staged and the {epilogue} epilogue"
        assert (staged[1] == other[1]).all(), f"the margins differ ({epilogue}: a store outside [M, N])"
        assert staged[2] == other[2], (epilogue, staged[2], other[2])
    x64, t64 = x.astype(cupy.float64), t.astype(cupy.float64)
    if memory_mode:
        t64 = cupy.tanh(SQRT_2_OVER_PI * (x64 + 0.044715 * x64 ** 3))
    ref = (a64 @ b64.T) * gelu_grad64(x64, t64)
    codes = staged[0]
    if bf16x3:
        got, unit = bf16_value(codes[:, :n]).astype(cupy.float64), 2.0 ** -8
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
# gelu_out has no 128 x 256 variant (its staged one spills); the 128 x 128 schedules with every epilogue
GELU_CASES = [pytest.param(m, n, k, config, memory, epilogue, id=f"{m}-{n}-{k}-{cid}-{memory}-{epilogue}",
                           marks=[QUICK] if (m, cid, epilogue) in ((4100, "bn128pp", "staged"), (77, "bn128pp", "direct"),
                                                                  (4100, "bn128", "staged")) else [])
              for m, n, k in ((77, 302, 64), (4100, 3000, 256))
              for config, cid in zip(CONFIGS, CONFIG_IDS) for memory in (False, True)
              for epilogue in epilogues_of(_sm90.OP_F16, config, _sm90.EPI_DGELU_F16G)]


@pytest.mark.parametrize("m,n,k,config,memory_mode,epilogue", GELU_CASES)
def test_dgelu_writes_gelu_out_too(rng, m, n, k, config, memory_mode, epilogue):
    """gelu_out beside the fp16 dgelu output (EPI_DGELU_F16G, the tf32 plan's GEMM1): grad_linear1 and its amax
    bit-identical to the plain fp16 epilogue's on the same inputs, gelu_out's codes those of alpha * 0.5 x (1 + t)
    rounded once from float32 (t given; memory mode recomputes t: within one fp16 step), its amax exact, and
    nothing stored outside either [M, N] (NaN-poisoned margins)."""
    block_n, pingpong = config
    a, _ = operand(rng, m, k, "fp16")
    b, _, _ = b_operand(rng, n, k, "fp16")
    x, t = activations(rng, m, n)
    x_before, t_before = x.copy(), t.copy()
    alpha, gelu_alpha = 2.0 ** -2, 2.0 ** 5
    tanh_inner = None if memory_mode else t
    ref_out, _ = padded(m, n, numpy.float16, 2, numpy.nan)
    ref_amax = cupy.zeros(1, cupy.uint32)
    _sm90.gemm_tn_dgelu(a, b, x, tanh_inner, ref_out, alpha=alpha, amax=ref_amax, block_n=block_n,
                             pingpong=pingpong, epilogue=epilogue)
    out, out_buf = padded(m, n, numpy.float16, 2, numpy.nan, extra_rows=1, extra_cols=6)
    gelu, gelu_buf = padded(m, n, numpy.float16, 2, numpy.nan, extra_rows=1, extra_cols=6)  # ldg == ldc: staged
    amax, gelu_amax = cupy.zeros(1, cupy.uint32), cupy.zeros(1, cupy.uint32)
    _sm90.gemm_tn_dgelu(a, b, x, tanh_inner, out, alpha=alpha, amax=amax, block_n=block_n, pingpong=pingpong,
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
    b, _, _ = b_operand(rng, n, k, "fp16")
    x, t = activations(rng, m, n)
    out = cupy.full((m, n), cupy.nan, cupy.float16)
    call = lambda **kw: _sm90.gemm_tn_dgelu(a, b, x, t, out, block_n=128, **kw)  # noqa: E731
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
    with pytest.raises(ValueError, match="no 128 x 256 variant"):
        _sm90.gemm_tn_dgelu(a, b, x, t, out, block_n=256, gelu_out=cupy.zeros((m, n), cupy.float16))
    wide = cupy.zeros((m, n + 8), cupy.float16)[:, :n]
    with pytest.raises(ValueError, match="row stride equal to out's"):
        call(epilogue="staged", gelu_out=wide)
    planes_out = cupy.zeros((m, 3 * n), cupy.uint16)
    with pytest.raises(ValueError, match="dgelu epilogues"):  # gelu_out only beside a float16 out
        _sm90.gemm_tn_dgelu(a.view(cupy.uint16), b.view(cupy.uint16), x, t, planes_out, block_n=128, planes=3,
                                 gelu_out=cupy.zeros((m, n), cupy.float16))
    assert bool(cupy.isnan(out).all()), "a refused call wrote out"


@QUICK
@pytest.mark.parametrize("memory_mode", [False, True])
def test_dgelu_rows_off_16_bytes_take_the_direct_epilogue(rng, memory_mode):
    """Rows of linear1_out / tanh_inner that do not start on 16-byte boundaries (row strides of 2 mod 4):
    epilogue=None runs the direct epilogue (bitwise its result), an explicit "staged" is refused."""
    m, n, k = 200, 258, 96
    a, _ = operand(rng, m, k, "fp16")
    b, _, _ = b_operand(rng, n, k, "fp16")
    x, t = activations(rng, m, n, ld_multiple=2)
    assert x.strides[0] // 4 % 4 == 2, x.strides  # linear1_out's rows off 16-byte boundaries (t's are on them)
    t_arg = None if memory_mode else t
    outs = {}
    for epilogue in (None, "direct"):
        out = cupy.full((m, n), cupy.nan, cupy.float16)
        amax = cupy.zeros(1, cupy.uint32)
        _sm90.gemm_tn_dgelu(a, b, x, t_arg, out, alpha=0.5, amax=amax, block_n=128, pingpong=True,
                                 epilogue=epilogue)
        cupy.cuda.get_current_stream().synchronize()
        assert bool(cupy.isfinite(out).all())
        outs[epilogue] = (out.view(cupy.uint16), int(amax[0]))
    assert bool((outs[None][0] == outs["direct"][0]).all()) and outs[None][1] == outs["direct"][1]
    with pytest.raises(ValueError, match="16-byte boundaries"):
        _sm90.gemm_tn_dgelu(a, b, x, t_arg, cupy.empty((m, n), cupy.float16), epilogue="staged")


@QUICK
def test_dgelu_bf16x3_truncates_finite_overflow():
    """A finite fp32 result above the largest bf16 is truncated to it in the hi planes, not rounded to infinity (the
    rule of common.cuh's split_bf16, so grad_linear1 is what the engine's conversion writes)."""
    m, n, k = 64, 64, 16
    bf16_max = float(bf16_value(numpy.array([0x7F7F], numpy.uint16))[0])  # 3.3895e38
    a32 = numpy.zeros((m, k), numpy.float32)
    b32 = numpy.zeros((k, n), numpy.float32)  # [K, N]
    a32[:, 0] = 1.0
    b32[0, :] = bf16_max
    a, b = cupy.asarray(bf16_bits(a32)), cupy.asarray(bf16_bits(b32))
    # x = 0: gelu'(0, t) = 0.5 (1 + t). t = 1 gives exactly bf16_max; t = 1.005 gives 3.398e38, finite
    # in fp32 but past the midpoint 3.3961e38 where round-to-nearest would give inf.
    x = cupy.zeros((m, n), cupy.float32)
    t = cupy.ones((m, n), cupy.float32)
    t[:, n // 2:] = 1.005
    assert 3.3961e38 < bf16_max * 0.5 * (1 + 1.005) < 3.4028e38
    out = cupy.full((m, 3 * n), 0x7FC0, cupy.uint16)
    _sm90.gemm_tn_dgelu(a, b, x, t, out, planes=3)
    cupy.cuda.get_current_stream().synchronize()
    assert bool((out[:, :n] == 0x7F7F).all()) and bool((out[:, 2 * n:] == 0x7F7F).all()), cupy.unique(out)


# ---- tile order (raster=R: bands of R tile rows, column by column) ---------------------------------------
# (1300, 3000, 256): 11 tile rows, so bands of 3 and 4 end with a shorter band; raster 16 >= the rows: the column
# order again.
RASTER_CASES = [pytest.param(m, n, k, config, raster, id=f"{m}-{n}-{k}-{cid}-r{raster}",
                             marks=[QUICK] if (cid, raster) in (("bn128pp", 3), ("bn256", 4)) else [])
                for m, n, k in ((1300, 3000, 256), (2048, 2056, 1000))
                for config, cid in zip(CONFIGS, CONFIG_IDS) for raster in (3, 4, 16)]


@pytest.mark.parametrize("m,n,k,config,raster", RASTER_CASES)
def test_raster_changes_the_order_not_a_bit(rng, m, n, k, config, raster):
    """Each tile is computed the same way whatever the order: the fused dgelu (fp16, amax; and the epilogue warps
    on their tile) is bit-identical to raster=0's, with every element written and nothing outside [M, N]."""
    block_n, pingpong = config
    a, a64 = operand(rng, m, k, "fp16")
    b, b64, _ = b_operand(rng, n, k, "fp16")
    x, t = activations(rng, m, n)
    for epilogue in epilogues_of(_sm90.OP_F16, config, _sm90.EPI_DGELU_F16):
        kw = dict(block_n=block_n, pingpong=pingpong, epilogue=epilogue)
        got = {}
        for r in (0, raster):
            g16, gbuf = padded(m, n, numpy.float16, 2, numpy.nan, extra_rows=2, extra_cols=3)
            amax = cupy.zeros(1, cupy.uint32)
            _sm90.gemm_tn_dgelu(a, b, x, t, g16, alpha=0.5, amax=amax, raster=r, **kw)
            cupy.cuda.get_current_stream().synchronize()
            assert bool(cupy.isfinite(g16).all()), f"raster={r}: outputs not written"
            assert bool(cupy.isnan(gbuf[:m, n:]).all()) and bool(cupy.isnan(gbuf[m:]).all()), "stores outside [M, N]"
            got[r] = (gbuf.view(cupy.uint16).copy(), int(amax[0]))
        assert int((got[0][0] != got[raster][0]).sum()) == 0, f"{epilogue}: out differs from raster=0's"
        assert got[0][1] == got[raster][1] > 0


# ---- input validation ---------------------------------------------------------------------------
def _ok_operands(m=64, n=64, k=64, dtype=numpy.float16):
    a = cupy.ones((m, k), dtype)
    b = cupy.ones((k, n), dtype)  # [K, N]
    return a, b


@pytest.mark.parametrize("case,message", [
    ("k0", "K"),
    ("lda", "multiple of 8"),
    ("misaligned", "16-byte aligned"),
    ("noncontig", "contiguous"),
    ("dtype", "float16"),
    ("mixed", "dtype of a"),
    ("kmismatch", r"b must be \[K, N\]"),
    ("ldb", "multiple of 8"),
    ("numpy", "cupy.ndarray"),
    ("block_n", "block_n"),
    ("pingpong256", "block_n, pingpong"),
    ("raster", "raster must be an int >= 0"),
    ("alpha_not_pow2", "power of two"),
    ("alpha_bf16", "alpha"),
    ("outdtype", "uint16"),
    ("xshape", "linear1_out"),
    ("tdtype", "tanh_inner"),
    ("overlap_x", "overlap"),
    ("overlap_a", "overlap"),
    ("amax_dtype", "amax"),
    ("epilogue", "epilogue"),
    ("warps_schedule", "epilogue 'warps'"),
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
    alpha, amax, kw = 1.0, None, {}
    if case == "k0":
        a, b = cupy.ones((64, 0), cupy.float16), cupy.ones((0, 64), cupy.float16)
    elif case == "lda":
        a, b = cupy.ones((64, 20), cupy.float16), cupy.ones((20, 64), cupy.float16)
    elif case == "misaligned":
        a = cupy.ones((64 * 64 + 8,), cupy.float16)[1:1 + 64 * 64].reshape(64, 64)
    elif case == "noncontig":
        a = cupy.ones((64, 128), cupy.float16)[:, ::2]
    elif case == "dtype":
        a, b = a.astype(cupy.float32), b.astype(cupy.float32)
    elif case == "mixed":
        b = b.view(cupy.uint16)
    elif case == "kmismatch":
        b = cupy.ones((72, 64), cupy.float16)  # [K, N] with K = 72, a has K = 64
    elif case == "ldb":
        b = cupy.ones((64, 68), cupy.float16)[:, :64]  # [K, N] with a row stride of 68: not a multiple of 8
    elif case == "numpy":
        a = a.get()
    elif case == "block_n":
        kw = dict(block_n=192)
    elif case == "pingpong256":
        kw = dict(block_n=256, pingpong=True)
    elif case == "raster":
        kw = dict(raster=-1)
    elif case == "amax_dtype":
        amax = cupy.zeros(1, cupy.float32)
    elif case == "alpha_not_pow2":
        alpha = 3.0
    elif case == "alpha_bf16":
        a, b = a.view(cupy.uint16), b.view(cupy.uint16)
        out = cupy.empty((64, 192), cupy.uint16)
        kw = dict(planes=3)
        alpha = 2.0
    elif case == "outdtype":
        out = cupy.empty((64, 64), cupy.float32)
    elif case == "xshape":
        x = cupy.zeros((64, 66), cupy.float32)
    elif case == "tdtype":
        t = cupy.zeros((64, 64), cupy.float16)
    elif case == "overlap_x":
        out = x.view(cupy.float16)[:, :64]
    elif case == "overlap_a":
        out = a
    elif case == "epilogue":
        kw = dict(epilogue="tma")
    elif case == "warps_schedule":
        kw = dict(epilogue="warps", block_n=256)
    elif case == "planes_value":
        kw = dict(planes=2)
    elif case == "planes_odd_n":  # b [K, N = 63], x/t [64, 63], out [64, 189]
        a, b = a.view(cupy.uint16), cupy.ones((64, 72), cupy.uint16)[:, :63]
        x, t = x[:, :63], t[:, :63]
        out = cupy.empty((64, 189), cupy.uint16)
        kw = dict(planes=3)
    elif case == "planes_fp16_operands":
        out = cupy.empty((64, 192), cupy.uint16)
        kw = dict(planes=3)
    elif case == "planes_out_shape":
        a, b = a.view(cupy.uint16), b.view(cupy.uint16)
        out = cupy.empty((64, 64), cupy.uint16)
        kw = dict(planes=3)
    with pytest.raises(ValueError, match=message):
        _sm90.gemm_tn_dgelu(a, b, x, t, out, alpha=alpha, amax=amax, **kw)


@QUICK
def test_empty_output_is_a_no_op():
    a = cupy.ones((0, 64), cupy.float16)
    b = cupy.ones((64, 64), cupy.float16)
    x = cupy.zeros((0, 64), cupy.float32)
    out = cupy.empty((0, 64), cupy.float16)
    assert _sm90.gemm_tn_dgelu(a, b, x, x, out) is out


@QUICK
def test_runs_on_the_given_stream(rng):
    """Launched on a non-default stream, the result is there once that stream synchronizes."""
    m, n, k = 512, 1024, 512
    a, _ = operand(rng, m, k, "fp16")
    b, _, _ = b_operand(rng, n, k, "fp16")
    x, t = activations(rng, m, n)
    ref, _ = padded(m, n, numpy.float16, 2, numpy.nan)
    _sm90.gemm_tn_dgelu(a, b, x, t, ref, alpha=0.5)
    out, _ = padded(m, n, numpy.float16, 2, numpy.nan)
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()  # the inputs were written on the default stream, which `stream` does not wait for
    _sm90.gemm_tn_dgelu(a, b, x, t, out, alpha=0.5, stream=stream)
    stream.synchronize()
    assert bool((out.view(cupy.uint16) == ref.view(cupy.uint16)).all())
