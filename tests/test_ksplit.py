"""The K-chunk plan (cupyffn/gemm/ksplit.py) and the chunked GEMM's calls (cupyffn/gemm/desc.py KChunked), on the CPU:
chunk sizes and remainders, the edges of the threshold, and the pointers, betas and leading dimensions each
chunk's plan receives."""

import ctypes

import pytest

from cupyffn.gemm import cublas as _cublas
from cupyffn.gemm import desc as _desc
from cupyffn.gemm import ksplit as _ksplit

MAX = _ksplit.MAX_K


def covers(pieces, k):
    """The chunks are in order, contiguous, non-empty and cover range(k)."""
    at = 0
    for k0, length in pieces:
        assert k0 == at and length > 0
        at += length
    return at == k


@pytest.mark.parametrize("k", [0, 1, 63, 64, MAX - 1, MAX])
def test_up_to_the_threshold_one_chunk(k):
    assert _ksplit.chunks(k) == (((0, k),) if k else ())
    assert not _ksplit.chunked(k)


@pytest.mark.parametrize("k", [MAX + 1, MAX + 64, 2 * MAX, 2 * MAX + 1, 3 * 352_000, 352_000, 1_000_003])
def test_above_the_threshold_the_fewest_equal_chunks(k):
    pieces = _ksplit.chunks(k)
    assert covers(pieces, k)
    count = -(-k // MAX)
    assert len(pieces) == count and _ksplit.chunked(k)
    lengths = [length for _, length in pieces]
    assert max(lengths) <= MAX
    assert all(length % _ksplit.ALIGN == 0 for length in lengths[:-1])   # every chunk but the last aligned
    assert lengths[-1] <= lengths[0] and lengths[:-1] == [lengths[0]] * (count - 1)


def test_just_above_the_threshold_two_halves():
    assert _ksplit.chunks(MAX + 1) == ((0, MAX // 2 + 64), (MAX // 2 + 64, MAX + 1 - (MAX // 2 + 64)))
    assert _ksplit.chunks(2 * MAX) == ((0, MAX), (MAX, MAX))


def test_the_tokens_of_a_large_batch():
    """T = 352,000 tokens, fp16 (K = T): 15 chunks of 23488, the last 23168; bf16x3 (K = 3 T): 43 chunks."""
    pieces = _ksplit.chunks(352_000)
    assert len(pieces) == 15 and pieces[0] == (0, 23488) and pieces[-1] == (14 * 23488, 352_000 - 14 * 23488)
    assert len(_ksplit.chunks(3 * 352_000)) == 43


def test_chunking_off_and_bad_arguments():
    assert _ksplit.chunks(10 ** 7, None) == ((0, 10 ** 7),) and _ksplit.chunks(10 ** 7, 0) == ((0, 10 ** 7),)
    assert not _ksplit.chunked(10 ** 7, None)
    for k in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="k must be an integer"):
            _ksplit.chunks(k)
    for max_k in (100, -64, 64.0):
        with pytest.raises(ValueError, match="max_k must be None or a non-negative multiple"):
            _ksplit.chunks(1000, max_k)


class FakeGemm:
    """Stands in for a built cuBLAS plan of one chunk length: records what each call sees."""

    def __init__(self, desc, calls):
        vp, i32 = ctypes.c_void_p, ctypes.c_int
        self.k = desc.k
        self.a, self.b, self.c, self.alpha, self.beta = vp(), vp(), vp(), vp(), vp()
        self.lda, self.ldb, self.ldc = i32(desc.lda or 0), i32(desc.ldb or 0), i32(desc.ldc or 0)
        self.calls = calls

    def __call__(self, handle):
        self.calls.append((self.k, self.a.value, self.b.value, self.c.value, self.alpha.value, self.beta.value,
                           self.lda.value, self.ldb.value, self.ldc.value))


class FakeBackend:
    name = "fake"

    def __init__(self):
        self.calls, self.built = [], []

    def supports(self, desc):
        return True, ""

    def build(self, desc, device_id):
        self.built.append(desc.k)
        return FakeGemm(desc, self.calls)


@pytest.mark.parametrize("a_trans,b_trans", [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("beta", [0x100, 0x104])
def test_chunked_gemm_offsets_each_chunk_along_k(a_trans, b_trans, beta):
    """Each chunk's A and B start at its K index: a row stride per index where K runs down the rows (A stored
    [K, M], B stored [K, N]), one element where K runs along them; the caller's beta for the first chunk, 1.0
    after it; alpha, C and the leading dimensions as the engine set them on the wrapper."""
    k, item = 3 * 20_000 + 5, 2
    desc = _desc.GemmDesc("g", 96, 128, k, _cublas.R_16BF, _cublas.R_16BF, a_trans=a_trans, b_trans=b_trans,
                          lda=111, ldb=222, ldc=128)
    backend = FakeBackend()
    plan, name = _desc.build(desc, 0, backends=(backend,), max_k=MAX, one_ptr=0xABC)
    assert name == "fake" and isinstance(plan, _desc.KChunked) and _desc.chunk_count(plan) == 3
    assert sorted(backend.built) == sorted({length for _, length in _ksplit.chunks(k)})
    plan.a.value, plan.b.value, plan.c.value = 0x10000000, 0x20000000, 0x30000000
    plan.alpha.value, plan.beta.value = 0x200, beta
    plan.lda.value, plan.ldb.value = 333, 444  # as set_io rewrites them per call
    plan(None)
    assert [c[0] for c in backend.calls] == [length for _, length in _ksplit.chunks(k)]
    for (k0, length), call in zip(_ksplit.chunks(k), backend.calls):
        _, a, b, c, alpha, beta_seen, lda, ldb, ldc = call
        assert a == 0x10000000 + k0 * item * (333 if a_trans else 1)
        assert b == 0x20000000 + k0 * item * (1 if b_trans else 444)
        assert (c, alpha, lda, ldb, ldc) == (0x30000000, 0x200, 333, 444, 128)
        assert beta_seen == (beta if k0 == 0 else 0xABC)


def test_short_k_builds_the_plain_plan_and_a_chunked_one_needs_one_ptr():
    backend = FakeBackend()
    desc = _desc.GemmDesc("g", 8, 8, MAX, _cublas.R_16F, _cublas.R_16F)
    plan, _ = _desc.build(desc, 0, backends=(backend,), max_k=MAX, one_ptr=0xABC)
    assert isinstance(plan, FakeGemm) and _desc.chunk_count(plan) == 1
    with pytest.raises(ValueError, match="needs one_ptr"):
        _desc.build(_desc.GemmDesc("g", 8, 8, MAX + 1, _cublas.R_16F, _cublas.R_16F), 0, backends=(backend,),
                    max_k=MAX)


def test_pair_gemm_chunks_both_products_and_keeps_the_callers_beta_first():
    """The f16+e4m3 pair: its e4m3 product's first chunk takes the caller's beta, every later chunk of both
    products adds (beta 1), so the whole pair is one sum into C."""
    backend = FakeBackend()
    fp8 = _desc.build(_desc.GemmDesc("e4m3", 16, 16, 2 * 30_016, _cublas.R_8F_E4M3, _cublas.R_8F_E4M3,
                                     b_trans=True, lda=2 * 30_016, ldb=2 * 30_016), 0, backends=(backend,),
                      max_k=MAX, one_ptr=0xABC)[0]
    f16 = _desc.build(_desc.GemmDesc("f16", 16, 16, 30_000, _cublas.R_16F, _cublas.R_16F, a_trans=True), 0,
                      backends=(backend,), max_k=MAX, one_ptr=0xABC)[0]
    pair = _desc.PairGemm(fp8, f16, 0xABC, "pair")
    fp8.a.value, fp8.b.value, f16.a.value, f16.b.value = 0x8000000, 0x9000000, 0x1000000, 0x2000000
    assert _desc.chunk_count(pair) == 3
    _desc.set_output(pair, 0x5000)
    _desc.set_beta(pair, 0x100, False)
    pair(None)
    betas = [c[5] for c in backend.calls]
    assert betas == [0x100] + [0xABC] * (len(betas) - 1) and len(betas) == 3 + 2
    assert {c[3] for c in backend.calls} == {0x5000}
    # e4m3 operands: one byte per K index, both K-contiguous (TN)
    assert [c[1] for c in backend.calls[:3]] == [0x8000000 + k0 for k0, _ in _ksplit.chunks(2 * 30_016)]


def test_chunks_keep_the_whole_gemms_leading_dimensions():
    """Without explicit leading dimensions the chunks' rows are the whole GEMM's (K for a K-contiguous A, N for B
    stored [K, N]), not the chunk's."""
    backend = FakeBackend()
    k = 2 * MAX + 128
    plan, _ = _desc.build(_desc.GemmDesc("g", 8, 24, k, _cublas.R_16F, _cublas.R_16F), 0, backends=(backend,),
                          max_k=MAX, one_ptr=0xABC)
    assert (plan.lda.value, plan.ldb.value, plan.ldc.value) == (k, 24, 24)
    plan.a.value, plan.b.value, plan.c.value = 0x1000, 0x2000, 0x3000
    plan(None)
    assert {c[6:] for c in backend.calls} == {(k, 24, 24)}
    assert [c[2] for c in backend.calls] == [0x2000 + k0 * 2 * 24 for k0, _ in _ksplit.chunks(k)]
