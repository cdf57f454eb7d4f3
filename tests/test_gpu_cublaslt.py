"""The cuBLASLt binding (cupyffn/gemm/cublaslt.py) on the GPU.

    PYTHONPATH=. python3 -m pytest -q tests/test_gpu_cublaslt.py

Every result is checked against float64 of the decoded operands: e4m3 x e4m3 (and fp16/bf16) products are exact
in fp32, so only the fp32 accumulation differs. The binding's plumbing (layouts, alpha, a_scale/b_scale, beta,
ld, D = C in place) is checked with small-integer e4m3 values, whose sums are exact in any accumulator of 12+
bits (so the check is near-exact whatever Hopper's fp8 accumulation keeps); random e4m3 values then measure the
accumulation itself (the brief's 1e-5 rel. L2). Outputs and every operand's row padding are NaN-poisoned before
each call (padding must never be read, the output padding never written). All work runs on one non-blocking
stream, the handle's.
"""

import numpy
import pytest

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")
from cupyffn.gemm import cublas as _cublas, cublaslt as _cublaslt  # noqa: E402

E4M3, E5M2, F32, F16, BF16 = _cublas.R_8F_E4M3, _cublaslt.R_8F_E5M2, _cublas.R_32F, _cublas.R_16F, _cublas.R_16BF
NAN_BITS = {"e4m3": 0x7F, "e5m2": 0x7F, "bf16": 0x7FC0}  # a NaN code of each raw-bits format
DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "bf16": ml_dtypes.bfloat16,
          "fp16": numpy.float16}
RAW = {"e4m3": numpy.uint8, "e5m2": numpy.uint8, "bf16": numpy.uint16, "fp16": numpy.float16}
CODES = {"e4m3": E4M3, "e5m2": E5M2, "bf16": BF16, "fp16": F16}


@pytest.fixture(scope="module")
def bound():
    """A pooled handle bound to a private non-blocking stream (as the engine binds its handles)."""
    device = cupy.cuda.Device().id
    stream = cupy.cuda.Stream(non_blocking=True)
    handle = _cublas.acquire(device)
    handle.bind(stream.ptr)
    yield handle, stream
    stream.synchronize()
    _cublas.release(handle)


def rel_l2(got, ref):
    got = numpy.asarray(got, dtype=numpy.float64)
    return float(numpy.linalg.norm(got - ref) / numpy.linalg.norm(ref))


def rounded(rng, shape, kind, ints=None):
    """Random nonzero values of format `kind`: (raw storage array, float64 values). `ints`: integers in [-ints, ints]."""
    sign = rng.choice([-1.0, 1.0], shape)
    if ints:
        x = rng.integers(1, ints + 1, shape) * sign
    elif kind in ("e4m3", "e5m2"):
        x = rng.uniform(0.25, 24.0, shape) * sign
    else:
        x = rng.standard_normal(shape)
    q = x.astype(DTYPES[kind])
    return q.view(RAW[kind]), q.astype(numpy.float64)


def padded(raw, ld, kind):
    """Device copy of raw [rows, cols] in a [rows, ld] buffer whose padding columns hold NaN."""
    rows, cols = raw.shape
    buf = numpy.empty((rows, ld), dtype=raw.dtype)
    buf[...] = numpy.nan if kind == "fp16" else NAN_BITS[kind]
    buf[:, :cols] = raw
    return cupy.asarray(buf)


def scalar(value):
    return cupy.asarray([value], dtype=cupy.float32)


def output(m, n, ldc, prefill=None):
    """fp32 C [m, ldc], NaN everywhere but `prefill` (float32 [m, n]) when given."""
    c = cupy.full((m, ldc), numpy.nan, dtype=cupy.float32)
    if prefill is not None:
        c[:, :n] = cupy.asarray(prefill)
    return c


def call(g, handle, a, b, c, alpha, beta):
    g.a.value, g.b.value, g.c.value = a.data.ptr, b.data.ptr, c.data.ptr
    g.alpha.value, g.beta.value = alpha.data.ptr, beta.data.ptr
    g(handle)
    return c.get()  # current stream = the handle's: this waits for the GEMM


def check_padding(got, n, ldc):
    if ldc > n:
        assert numpy.isnan(got[:, n:]).all(), "the GEMM wrote into C's padding columns"


# ------------------------------------------------------------------ fp8 e4m3, TN, fp32 out
FP8_SHAPES = [  # m, n, k, lda, ldb, ldc, ints (|value| <= ints keeps every partial sum an exact integer < 2^12)
    (48, 80, 96, 112, 96, 96, 4),
    (272, 1536, 512, 512, 528, 1536, 2),
]


@pytest.mark.parametrize("m,n,k,lda,ldb,ldc,ints", FP8_SHAPES)
@pytest.mark.parametrize("beta_value", [0.0, 1.0])
@pytest.mark.parametrize("b_scale_value", [None, 0.5])
def test_e4m3_exact_plumbing(bound, rng, m, n, k, lda, ldb, ldc, ints, beta_value, b_scale_value):
    handle, stream = bound
    with stream:
        a_raw, a64 = rounded(rng, (m, k), "e4m3", ints)
        bt_raw, bt64 = rounded(rng, (n, k), "e4m3", ints)  # B stored [N, K]
        a, bt = padded(a_raw, lda, "e4m3"), padded(bt_raw, ldb, "e4m3")
        a_scale = scalar(8.0)
        b_scale = scalar(b_scale_value) if b_scale_value is not None else None
        g = _cublaslt.LtMatmul(m, n, k, E4M3, E4M3, F32, b_trans=True, lda=lda, ldb=ldb, ldc=ldc, name="e4m3 test",
                               a_scale=a_scale.data.ptr, b_scale=None if b_scale is None else b_scale.data.ptr)
        c0 = (rng.standard_normal((m, n)) * 100).astype(numpy.float32) if beta_value else None
        c = output(m, n, ldc, c0)  # beta = 0: all NaN, and C must not be read
        alpha = 0.25
        got = call(g, handle, a, bt, c, scalar(alpha), scalar(beta_value))
    scale = alpha * 8.0 * (b_scale_value or 1.0)
    ref = scale * (a64 @ bt64.T) + (beta_value * c0.astype(numpy.float64) if beta_value else 0.0)
    check_padding(got, n, ldc)
    err = rel_l2(got[:, :n], ref)
    assert err <= 1e-6, (err, g.description, float(numpy.abs(got[:, :n] - ref).max()))
    g.close()


@pytest.mark.parametrize("m,n,k", [(48, 80, 96), (272, 1536, 512), (256, 512, 3072)])
@pytest.mark.parametrize("beta_value", [0.0, 1.0])
def test_e4m3_random_accuracy(bound, rng, m, n, k, beta_value):
    """Random e4m3 values: exact products, so the error is the accumulation's. Measured on the H200 with
    FAST_ACCUM off: rel. L2 7.6e-5 at K=96, i.e. Hopper's fp8 MMA accumulates with ~14 significant bits, not
    fp32's 24 (the fp16+fp8 plan puts only its 2^-11-sized cross terms through it: ~2^-25 of the result)."""
    handle, stream = bound
    with stream:
        a_raw, a64 = rounded(rng, (m, k), "e4m3")
        bt_raw, bt64 = rounded(rng, (n, k), "e4m3")
        a_scale = scalar(8.0)
        g = _cublaslt.LtMatmul(m, n, k, E4M3, E4M3, F32, b_trans=True, name="e4m3 random", a_scale=a_scale.data.ptr)
        product = a64 @ bt64.T
        c0 = (rng.standard_normal((m, n)) * numpy.abs(product).mean() * 6).astype(numpy.float32) if beta_value else None
        alpha = 0.75
        got = call(g, handle, padded(a_raw, k, "e4m3"), padded(bt_raw, k, "e4m3"), output(m, n, n, c0),
                   scalar(alpha), scalar(beta_value))
    ref = alpha * 8.0 * product + (c0.astype(numpy.float64) if beta_value else 0.0)
    err = rel_l2(got, ref)
    assert numpy.isfinite(got).all()
    assert err <= 3e-4, (f"rel. L2 {err:.3g} vs float64 at K={k}: coarser than Hopper's fp8 accumulation", g.description)
    g.close()


# ------------------------------------------------------------------ 16-bit operands, every layout
def _ld(cols):
    return -(-cols // 8) * 8 + 8  # a multiple of 8 elements (16-byte rows), with NaN padding


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("a_trans", [False, True])
@pytest.mark.parametrize("b_trans", [False, True])
@pytest.mark.parametrize("m,n,k", [(72, 88, 104), (50, 88, 104)])
def test_16bit_all_layouts(bound, rng, kind, a_trans, b_trans, m, n, k):
    handle, stream = bound
    code = CODES[kind]
    a_raw, a64 = rounded(rng, (m, k), kind)
    b_raw, b64 = rounded(rng, (k, n), kind)
    a_st = numpy.ascontiguousarray(a_raw.T) if a_trans else a_raw
    b_st = numpy.ascontiguousarray(b_raw.T) if b_trans else b_raw
    lda, ldb, ldc = _ld(a_st.shape[1]), _ld(b_st.shape[1]), _ld(n)
    with stream:
        a, b = padded(a_st, lda, kind), padded(b_st, ldb, kind)
        g = _cublaslt.LtMatmul(m, n, k, code, code, F32, a_trans=a_trans, b_trans=b_trans, lda=lda, ldb=ldb,
                               ldc=ldc, name=f"{kind} test")
        alpha = 0.5
        got0 = call(g, handle, a, b, output(m, n, ldc), scalar(alpha), scalar(0.0))
        c0 = rng.standard_normal((m, n)).astype(numpy.float32)
        got1 = call(g, handle, a, b, output(m, n, ldc, c0), scalar(alpha), scalar(1.0))
    for got, ref in ((got0, alpha * (a64 @ b64)), (got1, alpha * (a64 @ b64) + c0)):
        check_padding(got, n, ldc)
        err = rel_l2(got[:, :n], ref)
        assert err <= 1e-5, (err, g.description)
    g.close()


# ------------------------------------------------------------------ the fp16 + e4m3 pair, as the engine issues it
def test_e4m3_then_fp16_gemm_accumulate_on_one_handle(bound, rng):
    """fp8 LtMatmul with beta 0, then cublasGemmEx (fp16, natural layouts) with beta 1 onto the same output, both
    on the handle's stream and workspace."""
    handle, stream = bound
    m, n, k = 96, 160, 128
    k8 = 2 * k
    with stream:
        a8_raw, a8 = rounded(rng, (m, k8), "e4m3")
        b8_raw, b8 = rounded(rng, (n, k8), "e4m3")
        a16_raw, a16 = rounded(rng, (m, k), "fp16")
        b16_raw, b16 = rounded(rng, (k, n), "fp16")
        a_scale = scalar(8.0)
        fp8 = _cublaslt.LtMatmul(m, n, k8, E4M3, E4M3, F32, b_trans=True, a_scale=a_scale.data.ptr, name="fp8 part")
        fp16 = _cublas.Gemm(m, n, k, F16, F16, F32, name="fp16 part")
        c = output(m, n, n)
        alpha8, alpha16 = scalar(2.0 ** -9), scalar(2.0 ** -3)
        zero, one = scalar(0.0), scalar(1.0)
        a8_d, b8_d = padded(a8_raw, k8, "e4m3"), padded(b8_raw, k8, "e4m3")  # kept alive until the results are read
        fp8.a.value, fp8.b.value, fp8.c.value = a8_d.data.ptr, b8_d.data.ptr, c.data.ptr
        fp8.alpha.value, fp8.beta.value = alpha8.data.ptr, zero.data.ptr
        a16_d, b16_d = cupy.asarray(a16_raw), cupy.asarray(b16_raw)
        fp16.a.value, fp16.b.value, fp16.c.value = a16_d.data.ptr, b16_d.data.ptr, c.data.ptr
        fp16.alpha.value, fp16.beta.value = alpha16.data.ptr, one.data.ptr
        fp8(handle)
        fp16(handle)
        got = c.get()
    part8 = 2.0 ** -9 * 8.0 * (a8 @ b8.T)
    ref = part8 + 2.0 ** -3 * (a16 @ b16)
    err = rel_l2(got, ref)
    # Hopper's fp8 accumulation (3e-4 bound, test_e4m3_random_accuracy) on the fp8 part, fp32's on the rest; a
    # missing or doubled part would be off by the part's whole size (here comparable to the fp16 part's)
    tolerance = 3e-4 * float(numpy.linalg.norm(part8) / numpy.linalg.norm(ref)) + 1e-5
    assert err <= tolerance, (err, tolerance)
    fp8.close()


# ------------------------------------------------------------------ CUDA graph capture
def test_capture_and_replay_with_changed_inputs(bound, rng):
    handle, stream = bound
    m, n, k = 64, 96, 128
    with stream:
        a_raw, a64 = rounded(rng, (m, k), "e4m3", 4)
        bt_raw, bt64 = rounded(rng, (n, k), "e4m3", 4)
        a, bt = padded(a_raw, k, "e4m3"), padded(bt_raw, k, "e4m3")
        a_scale, alpha, beta = scalar(8.0), scalar(0.5), scalar(0.0)
        c = output(m, n, n)
        g = _cublaslt.LtMatmul(m, n, k, E4M3, E4M3, F32, b_trans=True, a_scale=a_scale.data.ptr, name="captured")
        eager = call(g, handle, a, bt, c, alpha, beta)  # warm: the first call may load kernels
        assert rel_l2(eager, 4.0 * (a64 @ bt64.T)) <= 1e-6
        c.fill(numpy.nan)
        stream.begin_capture()
        try:
            g(handle)
        finally:
            graph = stream.end_capture()
        assert numpy.isnan(c.get()).all(), "the captured call ran at capture time"
        for replay in range(3):
            alpha_value = 0.5 * 2.0 ** replay
            if replay:  # new operand values and a new alpha, in place: the graph reads them at replay
                a_raw, a64 = rounded(rng, (m, k), "e4m3", 4)
                a[...] = cupy.asarray(a_raw)
                alpha.fill(alpha_value)
            c.fill(numpy.nan)
            graph.launch(stream)
            got = c.get()
            err = rel_l2(got, alpha_value * 8.0 * (a64 @ bt64.T))
            assert err <= 1e-6, (replay, err)
    g.close()


# ------------------------------------------------------------------ unsupported, lifetime
def test_unsupported_shape_is_refused_with_the_reason():
    ok, reason = _cublaslt.supports(48, 40, 96, E4M3, E4M3, F32, b_trans=True)
    assert not ok and "N=40" in reason
    with pytest.raises(_cublaslt.LtUnsupported, match="M=48 N=40 K=96.*multiples of 16"):
        _cublaslt.LtMatmul(48, 40, 96, E4M3, E4M3, F32, b_trans=True)


def test_heuristic_refusal_or_a_correct_result(bound, rng):
    """e5m2 x e5m2 meets supports() but Hopper's cuBLASLt has no such kernel: LtUnsupported naming the GEMM and
    the heuristic's answer. Should this cuBLASLt run it after all, its result must be right."""
    handle, stream = bound
    m, n, k = 64, 64, 64
    try:
        g = _cublaslt.LtMatmul(m, n, k, E5M2, E5M2, F32, b_trans=True, name="e5m2 x e5m2")
    except _cublaslt.LtUnsupported as e:
        text = str(e)
        assert "no algorithm for e5m2 x e5m2: M=64 N=64 K=64, A e5m2" in text, text
        assert "cublasLtMatmulAlgoGetHeuristic" in text, text
        return
    with stream:
        a_raw, a64 = rounded(rng, (m, k), "e5m2", 4)
        bt_raw, bt64 = rounded(rng, (n, k), "e5m2", 4)
        got = call(g, handle, padded(a_raw, k, "e5m2"), padded(bt_raw, k, "e5m2"), output(m, n, n), scalar(1.0),
                   scalar(0.0))
    assert rel_l2(got, a64 @ bt64.T) <= 1e-6
    g.close()


def test_close_is_idempotent_and_a_closed_gemm_refuses_calls(bound):
    handle, _ = bound
    g = _cublaslt.LtMatmul(64, 64, 64, F16, F16, F32, name="closing")
    assert g.workspace_size <= _cublas.WORKSPACE_BYTES
    lt = _cublaslt.lt_handle(handle)
    assert isinstance(lt, int) and lt and _cublaslt.lt_handle(handle) == lt  # created once, then kept
    g.close()
    g.close()
    with pytest.raises(RuntimeError, match="'closing' was closed"):
        g(handle)
