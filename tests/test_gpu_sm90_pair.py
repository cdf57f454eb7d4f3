"""The fp16+fp8 pair in one sm90 kernel (gemm_sm90_pair_kernel in kernels_cu/gemm_sm90.cu through
cupyffn/gemm/sm90 gemm_pair) on a Hopper GPU.

out = alpha (pair_scale a8 @ b8^T + a @ b) (+ out): checked against float64 products of the same fp16 and e4m3
operands, and, on operands encoded as the fp16+fp8 plan encodes fp32 matrices, against float64 of the fp32
matrices themselves (the plan's accuracy, which depends on the e4m3 cross terms being summed before the fp16
product is added). Outputs are NaN-poisoned, with poisoned margins around them that must survive.

    PYTHONPATH=. python3 -m pytest -q tests/test_gpu_sm90_pair.py
"""

import re

import numpy
import pytest

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
from cupyffn.cpu import numpy_route as nb
from cupyffn.core import precision as P  # noqa: E402
from cupyffn.gemm import sm90 as G  # noqa: E402
from test_gpu_sm90_gemm import padded  # noqa: E402  (tests/ is on sys.path under pytest's rootdir conftest)
from test_numpy_backend import rel_l2  # noqa: E402

F64 = numpy.float64
BLOCK_NS = [pytest.param(bn, id=f"bn{bn}") for bn, _ in G.PAIR_SCHEDULES]


@pytest.fixture(autouse=True)
def hopper():
    if not G.device_supported(cupy.cuda.Device().id):
        pytest.skip("the sm_90a GEMM needs a compute capability 9.0 GPU")


def e4m3_table():
    """float64 value of each e4m3 ("fn") code; NaN for 0x7F and 0xFF."""
    codes = numpy.arange(256)
    sign = numpy.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 15, codes & 7
    mag = numpy.where(exp == 0, man * 2.0 ** -9, (1 + man / 8) * 2.0 ** (exp - 7))
    value = sign * mag
    value[(codes & 0x7F) == 0x7F] = numpy.nan
    return value


E4M3 = e4m3_table()


def e4m3_bits(values):
    """Codes of values that are e4m3 values already (nb.e4m3_round's), +0 for zeros."""
    positive = E4M3[:0x7F]  # codes 0 .. 0x7E, increasing
    v = numpy.asarray(values, dtype=F64)
    code = numpy.searchsorted(positive, numpy.abs(v)).astype(numpy.uint8)
    assert numpy.array_equal(positive[code], numpy.abs(v)), "not e4m3 values"
    return numpy.where((v < 0), code | 0x80, code).astype(numpy.uint8)


def device_copy(host, ld_multiple, fill):
    """host on the device as a view with margins right and below filled with `fill`."""
    view, buf = padded(*host.shape, host.dtype, ld_multiple, fill, extra_rows=1, extra_cols=8)
    view[...] = cupy.asarray(host)
    return view, buf


def random_codes(rng, shape):
    """e4m3 codes of magnitude 2^-3 .. 2^4 with random signs (no NaN codes, no zeros)."""
    code = rng.integers(0x20, 0x60, size=shape).astype(numpy.uint8)
    return code | (rng.integers(0, 2, size=shape).astype(numpy.uint8) << 7)


def operands(rng, m, n, k, k8, a_layout):
    """Random fp16 a (in its layout), b [K, N] and e4m3 a8 [m, k8], b8 [n, k8] on the device (NaN-padded rows), with
    the float64 values of the [m, k] / [k, n] products' operands."""
    a = rng.standard_normal((m, k)).astype(numpy.float16)
    b = rng.standard_normal((k, n)).astype(numpy.float16)
    a8, b8 = random_codes(rng, (m, k8)), random_codes(rng, (n, k8))
    da, _ = device_copy(a if a_layout == "mk" else numpy.ascontiguousarray(a.T), 8, numpy.nan)
    db, _ = device_copy(b, 8, numpy.nan)
    da8, _ = device_copy(a8, 16, 0x7F)  # NaN codes beyond k8: must never be read
    db8, _ = device_copy(b8, 16, 0x7F)
    return (da, db, da8, db8), (a.astype(F64), b.astype(F64), E4M3[a8], E4M3[b8])


# (M, N, K, k8): odd sizes, partial tiles, K not a multiple of 64, k8 not a multiple of 128, one row, K > the
# pipeline's depth in both parts, more tiles than SMs
SHAPES = [(200, 136, 200, 48), (1, 24, 8, 16), (300, 520, 1000, 2016), (1100, 2100, 64, 128)]


@pytest.mark.parametrize("block_n", BLOCK_NS)
@pytest.mark.parametrize("a_layout", G.A_LAYOUTS)
@pytest.mark.parametrize("m,n,k,k8", SHAPES)
def test_pair_against_float64(m, n, k, k8, a_layout, block_n):
    rng = numpy.random.default_rng([m, n, k, k8, block_n, len(a_layout)])
    (a, b, a8, b8), (a64, b64, a864, b864) = operands(rng, m, n, k, k8, a_layout)
    out, buf = padded(m, n, numpy.float32, 4, numpy.nan, extra_rows=1, extra_cols=8)
    got = G.gemm_pair(a, b, a8, b8, out, alpha=0.5, pair_scale=8.0, a_layout=a_layout, block_n=block_n)
    assert got is out
    host = cupy.asnumpy(buf)
    assert numpy.isnan(host[:m, n:]).all() and numpy.isnan(host[m:]).all(), "a store outside out"
    want = 0.5 * (8.0 * (a864 @ b864.T) + a64 @ b64)
    # Hopper's e4m3 MMA keeps fewer bits of its running sum than fp32 (~14,
    # docs/decisions/024-sm90-pair-kernel-gemm1.md): on these operands, where the e4m3 product is the larger one,
    # that is the error (printed: measured, not assumed)
    err = rel_l2(host[:m, :n], want)
    print(f"pair rel. L2 {err:.2e} at M={m} N={n} K={k} k8={k8}")
    assert err <= 5e-3
    # each part is there with its weight: leaving either out, or pair_scale, costs far more than that
    assert rel_l2(host[:m, :n], 0.5 * (a864 @ b864.T + a64 @ b64)) > 0.1


@pytest.mark.parametrize("a_layout", G.A_LAYOUTS)
def test_every_schedule_gives_the_same_bits(a_layout):
    """The tile shape changes which CTA computes an element, not its sum's order (k-steps in the same order)."""
    m, n, k, k8 = 700, 1040, 520, 560
    rng = numpy.random.default_rng(7)
    (a, b, a8, b8), _ = operands(rng, m, n, k, k8, a_layout)
    outs = []
    for block_n, _ in G.PAIR_SCHEDULES:
        out = cupy.full((m, n), cupy.nan, dtype=cupy.float32)
        G.gemm_pair(a, b, a8, b8, out, a_layout=a_layout, block_n=block_n)
        outs.append(cupy.asnumpy(out))
    assert numpy.isfinite(outs[0]).all()
    for other in outs[1:]:
        assert numpy.array_equal(other.view(numpy.uint32), outs[0].view(numpy.uint32))


@pytest.mark.parametrize("block_n", BLOCK_NS)
def test_accumulate_adds_to_out(block_n):
    m, n, k, k8 = 260, 264, 136, 288
    rng = numpy.random.default_rng(11)
    (a, b, a8, b8), (a64, b64, a864, b864) = operands(rng, m, n, k, k8, "km")
    c0 = rng.standard_normal((m, n)).astype(numpy.float32) * 1e4  # larger than the product: its sum shows
    out = cupy.asarray(c0)
    G.gemm_pair(a, b, a8, b8, out, alpha=0.25, accumulate=True, a_layout="km", block_n=block_n)
    want = c0 + 0.25 * (8.0 * (a864 @ b864.T) + a64 @ b64)
    assert rel_l2(cupy.asnumpy(out), want) <= 5e-3
    assert rel_l2(cupy.asnumpy(out), want - c0) > 1  # c0 was added


def plan_operands(x, w, ex, ew, a_layout):
    """The fp16+fp8 plan's encodings of fp32 x [M, K] and w [K, N] (nb.f16e4m3_split: hi, H8, L8 at exponents
    ex, ew), as the engine lays them out: fp16 hi of x in a_layout, of w [K, N]; e4m3 pairs [L8_x | H8_x] and
    [H8_w | L8_w] (K padded to 16, zero padding) as K-major rows."""
    k = x.shape[1]
    kpad = -(-k // 16) * 16
    (xh, xh8, xl8), (wh, wh8, wl8) = nb.f16e4m3_split(x, ex), nb.f16e4m3_split(w, ew)
    a8 = numpy.zeros((x.shape[0], 2 * kpad), dtype=numpy.uint8)
    a8[:, :k], a8[:, kpad:kpad + k] = e4m3_bits(xl8), e4m3_bits(xh8)
    b8 = numpy.zeros((w.shape[1], 2 * kpad), dtype=numpy.uint8)
    b8[:, :k], b8[:, kpad:kpad + k] = e4m3_bits(wh8.T), e4m3_bits(wl8.T)
    a16 = xh.astype(numpy.float16)
    a16 = a16 if a_layout == "mk" else numpy.ascontiguousarray(a16.T)
    return [cupy.asarray(v) for v in (a16, wh.astype(numpy.float16), a8, b8)]


@pytest.mark.parametrize("a_layout", G.A_LAYOUTS)
@pytest.mark.parametrize("block_n", BLOCK_NS)
def test_plan_encodings_give_the_plan_accuracy(a_layout, block_n):
    """On the plan's encodings of fp32 matrices the kernel must reach the plan's accuracy (nb.pair_matmul's:
    ~1e-5 rel. L2, where fp16 alone gives ~3e-4): the e4m3 sum carries the operands' low bits."""
    rng = numpy.random.default_rng(3)
    m, n, k = 384, 520, 1536
    x = rng.standard_normal((m, k)).astype(numpy.float32)
    w = (0.02 * rng.standard_normal((k, n))).astype(numpy.float32)
    ex, ew = nb.f16_exponent(x), nb.f16_exponent(w)
    a, b, a8, b8 = plan_operands(x, w, ex, ew, a_layout)
    out = cupy.full((m, n), cupy.nan, dtype=cupy.float32)
    G.gemm_pair(a, b, a8, b8, out, alpha=2.0 ** -(ex + ew), pair_scale=P.E4M3_PAIR_SCALE, a_layout=a_layout,
                block_n=block_n)
    got = cupy.asnumpy(out)
    exact = x.astype(F64) @ w.astype(F64)
    model = nb.pair_matmul(x, w, ex, ew)  # the plan's product in fp32 on the host
    f16_only = numpy.ldexp(nb.f16_round_scaled(x, ex).astype(F64) @ nb.f16_round_scaled(w, ew).astype(F64), -(ex + ew))
    err, err_model, err_f16 = rel_l2(got, exact), rel_l2(model, exact), rel_l2(f16_only, exact)
    assert err <= 1.5 * err_model and err <= 3e-5, (err, err_model)
    assert err * 10 <= err_f16, (err, err_f16)
    assert rel_l2(got, model) <= 3e-6


def test_rejects_bad_arguments():
    a = cupy.ones((64, 32), dtype=cupy.float16)
    b = cupy.ones((32, 48), dtype=cupy.float16)
    a8 = cupy.zeros((64, 32), dtype=cupy.uint8)
    b8 = cupy.zeros((48, 32), dtype=cupy.uint8)
    out = cupy.zeros((64, 48), dtype=cupy.float32)
    snapshot = [cupy.asnumpy(v) for v in (a, b, a8, b8, out)]
    cases = [
        (dict(a8=a8.astype(cupy.int8)), "a8 must be uint8"),
        (dict(b8=cupy.zeros((48, 48), dtype=cupy.uint8)), "b8 must have the k8 = 32 columns"),
        (dict(a8=cupy.zeros((64, 24), dtype=cupy.uint8)), "positive multiple of 16"),
        (dict(b8=cupy.zeros((40, 32), dtype=cupy.uint8)), "b8 must have shape (48, 32)"),
        (dict(a=a.astype(cupy.float32)), "a must be a 2-D float16"),
        (dict(b=cupy.ones((48, 32), dtype=cupy.float16)), "b must be [K, N] with K"),
        (dict(out=cupy.zeros((64, 48), dtype=cupy.float64)), "out must be float32"),
        (dict(pair_scale=3.0), "pair_scale must be a power of two"),
        (dict(alpha=float("nan")), "alpha must be a finite float"),
        (dict(a_layout="km"), "b must be [K, N] with K"),  # a [64, 32] read as [K, M]: K = 64
        (dict(a_layout="x"), "a_layout one of"),
        (dict(block_n=64), "the pair kernel runs the schedules"),
    ]
    for change, message in cases:
        kw = dict(a=a, b=b, a8=a8, b8=b8, out=out)
        kw.update(change)
        extra = {key: kw.pop(key) for key in list(kw) if key not in ("a", "b", "a8", "b8", "out")}
        with pytest.raises(ValueError, match=re.escape(message)):
            G.gemm_pair(kw["a"], kw["b"], kw["a8"], kw["b8"], kw["out"], **extra)
    for before, after in zip(snapshot, (a, b, a8, b8, out)):
        assert numpy.array_equal(before, cupy.asnumpy(after))
