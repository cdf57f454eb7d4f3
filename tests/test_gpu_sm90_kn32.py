"""b_layout "kn32" of the sm_90a GEMM: a float32 b [K, N] (a weight as the caller holds it) converted to fp16 inside
the kernel (kernels_cu/gemm_sm90.cu, BT = 2) on a Hopper GPU.

The kernel must give bit for bit what b_layout "kn" gives on the fp16 codes fp16(b * b_scale) that convert.cu writes
(both round to nearest even after the same fp32 product), and max |b| over the finite b in b_amax. Each result is
also checked against a float64 product (relative L2); outputs are NaN-poisoned, with poisoned margins that must
survive, and the float32 b (with NaN in its row padding) must come back unchanged.

    PYTHONPATH=. python3 -m pytest -q tests/test_gpu_sm90_kn32.py
"""

import numpy
import pytest

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
from cupyffn import _sm90_gemm as G  # noqa: E402
from test_gpu_sm90_gemm import activations, gelu_grad64, padded, rel_l2  # noqa: E402


@pytest.fixture(autouse=True)
def hopper():
    if not G.device_supported(cupy.cuda.Device().id):
        pytest.skip("the sm_90a GEMM needs a compute capability 9.0 GPU")


# odd N (b's rows padded to a multiple of 4 floats), K not a multiple of 64, one row; GEMM1 at T = 256 (H = 6144,
# K = D = 1536) and GEMM3's shape (N = D = 1536, K = H = 6144); more tiles than SMs with K over the stages.
SHAPES = [(1, 64, 16), (77, 302, 64), (130, 257, 40), (256, 6144, 1536), (256, 1536, 6144), (2048, 2056, 1000)]
CONFIG_IDS = {(128, False): "bn128", (128, True): "bn128pp"}


def weight(rng, k, n, scale=0.02):
    """b: float32 [K, N] (scale * N(0, 1)) in a buffer whose row padding is NaN, which the kernel must not read."""
    b32 = (scale * rng.standard_normal((k, n))).astype(numpy.float32)
    b, _ = padded(k, n, numpy.float32, 4, numpy.nan, extra_cols=4)
    b[...] = cupy.asarray(b32)
    return b


def codes_of(b, b_scale):
    """fp16(b * b_scale), the product in fp32, then round to nearest even (CuPy's astype: __float2half_rn, the
    rounding of convert.cu's f16_bits and of the kernel's cvt.rn.f16x2.f32), as a 16-byte aligned fp16 [K, N] for
    b_layout "kn" (row stride a multiple of 8). dev/kn32_cost.py checks against convert.cu's own codes too."""
    k, n = b.shape
    b16, _ = padded(k, n, numpy.float16, 8, numpy.nan)
    b16[...] = (b * numpy.float32(b_scale)).astype(cupy.float16)
    return b16


def fp16_a(rng, m, k):
    a, _ = padded(m, k, numpy.float16, 8, numpy.nan, extra_cols=8)
    a[...] = cupy.asarray(rng.standard_normal((m, k), dtype=numpy.float32).astype(numpy.float16))
    return a


def amax_bits(b):
    finite = cupy.where(cupy.isfinite(b), cupy.abs(b), 0).astype(cupy.float32)
    return int(finite.max().view(cupy.uint32))


def same_bits(x, y):
    return bool((x.view(cupy.uint32 if x.dtype == cupy.float32 else cupy.uint16)
                 == y.view(cupy.uint32 if y.dtype == cupy.float32 else cupy.uint16)).all())


@pytest.mark.parametrize("config", list(CONFIG_IDS), ids=list(CONFIG_IDS.values()))
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}-{n}-{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize("b_scale", [1.0, 2.0 ** 10], ids=["x1", "x1024"])
def test_kn32_fp32_out_is_kn_on_the_converted_codes(rng, m, n, k, config, b_scale):
    block_n, pingpong = config
    a, b = fp16_a(rng, m, k), weight(rng, k, n)
    b_before = b.copy()
    out, buf = padded(m, n, numpy.float32, 2, numpy.nan, extra_rows=3, extra_cols=5)
    b_amax = cupy.zeros(1, cupy.uint32)
    got = G.gemm_tn(a, b, out, block_n=block_n, pingpong=pingpong, b_layout=G.KN32, b_scale=b_scale, b_amax=b_amax)
    assert got is out
    b16 = codes_of(b, b_scale)
    want, _ = padded(m, n, numpy.float32, 2, numpy.nan)
    G.gemm_tn(a, b16, want, block_n=block_n, pingpong=pingpong, b_layout="kn")
    cupy.cuda.get_current_stream().synchronize()
    assert bool(cupy.isfinite(out).all()), "some outputs were not written"
    assert same_bits(out, want), float(cupy.abs(out - want).max())
    assert int(b_amax[0]) == amax_bits(b)
    # float64: against the same fp16 codes (the GEMM), and against b itself (the codes' rounding, 2^-12 relative)
    a64 = a.astype(cupy.float64)
    assert rel_l2(out, a64 @ b16.astype(cupy.float64)) <= 1e-5
    assert rel_l2(out, b_scale * (a64 @ b.astype(cupy.float64))) <= 1e-3
    assert bool(cupy.isnan(buf[:m, n:]).all()) and bool(cupy.isnan(buf[m:]).all())
    assert same_bits(b, b_before) and bool(cupy.isnan(b.base[:, n:]).all())


@pytest.mark.parametrize("config", list(CONFIG_IDS), ids=list(CONFIG_IDS.values()))
@pytest.mark.parametrize("m,n,k", [(77, 302, 64), (256, 6144, 1536), (2048, 2056, 1000)],
                         ids=["77-302-64", "256-6144-1536", "2048-2056-1000"])
@pytest.mark.parametrize("memory_mode", [False, True], ids=["t", "memory"])
@pytest.mark.parametrize("epilogue", G.EPILOGUES)
def test_kn32_dgelu_is_kn_on_the_converted_codes(rng, m, n, k, config, memory_mode, epilogue):
    """The tf32 plan's GEMM1 (fp16 dgelu epilogue at 2^-3, amax gathered) with weight2 converted in the kernel."""
    block_n, pingpong = config
    b_scale, alpha = 2.0 ** 6, 2.0 ** -3
    a, b = fp16_a(rng, m, k), weight(rng, k, n)
    x, t = activations(rng, m, n)
    t_in = None if memory_mode else t
    outs, amaxes = [], []
    for layout, bb, extra in ((G.KN32, b, {"b_scale": b_scale, "b_amax": cupy.zeros(1, cupy.uint32)}),
                              ("kn", codes_of(b, b_scale), {})):
        out, buf = padded(m, n, numpy.float16, 8, numpy.nan, extra_rows=2, extra_cols=8)
        amax = cupy.zeros(1, cupy.uint32)
        G.gemm_tn_dgelu(a, bb, x, t_in, out, alpha=alpha, amax=amax, block_n=block_n, pingpong=pingpong,
                        epilogue=epilogue, b_layout=layout, **extra)
        cupy.cuda.get_current_stream().synchronize()
        assert bool(cupy.isfinite(out).all()), "some outputs were not written"
        assert bool(cupy.isnan(buf[:m, n:]).all()) and bool(cupy.isnan(buf[m:]).all())
        outs.append(out)
        amaxes.append(int(amax[0]))
        if layout == G.KN32:
            assert int(extra["b_amax"][0]) == amax_bits(b)
    assert same_bits(outs[0], outs[1]) and amaxes[0] == amaxes[1]
    a64, x64, t64 = a.astype(cupy.float64), x.astype(cupy.float64), t.astype(cupy.float64)
    ref = alpha * b_scale * (a64 @ b.astype(cupy.float64)) * gelu_grad64(x64, t64)
    assert rel_l2(outs[0], ref) <= 2e-3


def test_kn32_non_finite_weights_propagate_and_stay_out_of_b_amax(rng):
    m, n, k = 130, 257, 200
    a, b = fp16_a(rng, m, k), weight(rng, k, n)
    b[3, 5], b[150, 256], b[7, 100] = numpy.inf, numpy.nan, -numpy.inf
    b_amax = cupy.zeros(1, cupy.uint32)
    out, _ = padded(m, n, numpy.float32, 2, numpy.nan)
    want, _ = padded(m, n, numpy.float32, 2, numpy.nan)
    G.gemm_tn(a, b, out, block_n=128, b_layout=G.KN32, b_amax=b_amax)
    G.gemm_tn(a, codes_of(b, 1.0), want, block_n=128, b_layout="kn")
    cupy.cuda.get_current_stream().synchronize()
    assert int(b_amax[0]) == amax_bits(b) and numpy.isfinite(b_amax.view(cupy.float32).get()[0])
    assert same_bits(out, want)
    bad_cols = {5, 256, 100}
    assert all(not bool(cupy.isfinite(out[:, c]).any()) for c in bad_cols)
    good = [c for c in range(n) if c not in bad_cols]
    assert bool(cupy.isfinite(out[:, good]).all())


def test_kn32_scale_overflow_gives_inf_codes_as_convert_does(rng):
    """b * b_scale beyond fp16's range: the codes are inf as convert.cu's would be (the engine's rescue protects
    against that by deciding b_scale from b_amax), and b_amax still reports max |b|."""
    m, n, k = 64, 128, 64
    a, b = fp16_a(rng, m, k), weight(rng, k, n, scale=1.0)
    b[0, 0] = 70000.0
    b_amax = cupy.zeros(1, cupy.uint32)
    out = G.gemm_tn(a, b, cupy.zeros((m, n), cupy.float32), block_n=128, b_layout=G.KN32, b_amax=b_amax)
    want = G.gemm_tn(a, codes_of(b, 1.0), cupy.zeros((m, n), cupy.float32), block_n=128, b_layout="kn")
    cupy.cuda.get_current_stream().synchronize()
    assert same_bits(out, want) and not bool(cupy.isfinite(out[:, 0]).all())
    assert b_amax.view(cupy.float32).get()[0] == numpy.float32(70000.0)


def _bad(case):
    a = cupy.zeros((64, 32), cupy.float16)
    b = cupy.zeros((32, 128), cupy.float32)
    out = cupy.zeros((64, 128), cupy.float32)
    x = cupy.zeros((64, 128), cupy.float32)
    o16 = cupy.zeros((64, 128), cupy.float16)
    kw = dict(block_n=128, b_layout=G.KN32)
    if case == "bf16-a":
        return lambda: G.gemm_tn(a.view(cupy.uint16), b, out, **kw)
    if case == "fp16-b":
        return lambda: G.gemm_tn(a, b.astype(cupy.float16), out, **kw)
    if case == "block-n-256":
        return lambda: G.gemm_tn(a, b, out, block_n=256, b_layout=G.KN32)
    if case == "cluster-2":
        return lambda: G.gemm_tn(a, b, out, cluster=2, **kw)
    if case == "scale-not-pow2":
        return lambda: G.gemm_tn(a, b, out, b_scale=3.0, **kw)
    if case == "scale-with-kn":
        return lambda: G.gemm_tn(a, b.astype(cupy.float16), out, block_n=128, b_layout="kn", b_scale=2.0)
    if case == "amax-dtype":
        return lambda: G.gemm_tn(a, b, out, b_amax=cupy.zeros(1, cupy.float32), **kw)
    if case == "row-stride":
        return lambda: G.gemm_tn(a, cupy.zeros((32, 130), cupy.float32)[:, :129], cupy.zeros((64, 129), cupy.float32),
                                 **kw)
    if case == "fp32-b-kn":
        return lambda: G.gemm_tn(a, b, out, block_n=128, b_layout="kn")
    if case == "bf16-out":
        return lambda: G.gemm_tn_dgelu(a, b, x, x, o16.view(cupy.uint16), **kw)
    if case == "dgelu-cluster-2":
        return lambda: G.gemm_tn_dgelu(a, b, x, x, o16, cluster=2, **kw)
    if case == "gelu-out":
        return lambda: G.gemm_tn_dgelu(a, b, x, x, o16, gelu_out=cupy.zeros_like(o16), **kw)
    raise AssertionError(case)


@pytest.mark.parametrize("case,message", [
    ("bf16-a", "needs a float16 a and a float32 b"), ("fp16-b", "needs a float16 a and a float32 b"),
    ("block-n-256", "b_layout='kn32' runs the schedules"), ("cluster-2", "without clusters"),
    ("scale-not-pow2", "b_scale must be a power of two"), ("scale-with-kn", "apply only with b_layout='kn32'"),
    ("amax-dtype", "b_amax must be None or a 1-element uint32"), ("row-stride", "multiple of 4 elements"),
    ("fp32-b-kn", "b_layout='kn32'"), ("bf16-out", "float16 dgelu epilogue"), ("gelu-out", "float16 dgelu epilogue"),
    ("dgelu-cluster-2", "without clusters")])
def test_kn32_rejects_bad_input(case, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _bad(case)()
