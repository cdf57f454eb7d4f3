"""The engine's choice of the fused GEMM1 + dgelu (GpuEngine._fused_gemm1_ok) without a GPU: the formats the
kernel serves, the default windows, the CUPYFFN_SM90_GEMM1 override and the shapes it cannot take."""

import types

import pytest

from cupyffn import _gpu_engine as E
from cupyffn import _ksplit
from cupyffn import _precision as P


def stand_in(fmt, tokens, dim, hidden, hopper, monkeypatch):
    """An engine's fields the sm90 choices read, with GpuEngine._sm90_fits and _mnk bound to them."""
    monkeypatch.setattr(E._sm90_gemm, "device_supported", lambda device_id: hopper)
    engine = types.SimpleNamespace(fmt=fmt, T=tokens, D=dim, H=hidden, device_id=0, max_k=_ksplit.MAX_K,
                                   planes=3 if fmt == P.FMT_BF16X3 else 1)
    engine._sm90_fits = lambda: E.GpuEngine._sm90_fits(engine)
    engine._mnk = lambda g: E.GpuEngine._mnk(engine, g)
    engine._dims = lambda letters: E.GpuEngine._dims(engine, letters)
    return engine


def ok(fmt, tokens, dim=1536, hidden=6144, hopper=True, monkeypatch=None):
    return E.GpuEngine._fused_gemm1_ok(stand_in(fmt, tokens, dim, hidden, hopper, monkeypatch))


def pair_gemms(tokens=8192, dim=1536, hidden=6144, hopper=True, monkeypatch=None):
    return E.GpuEngine._sm90_pair_gemms(stand_in(P.FMT_F16E4M3, tokens, dim, hidden, hopper, monkeypatch))


def test_sm90_pair_gemms(monkeypatch):
    """fp16+fp8: which pair GEMMs run as the sm90 pair kernel (CUPYFFN_SM90_PAIR) and where the kernel cannot run."""
    monkeypatch.delenv("CUPYFFN_SM90_PAIR", raising=False)
    assert pair_gemms(monkeypatch=monkeypatch) == {"gemm1"} == set(E.SM90_PAIR_GEMMS)
    assert pair_gemms(dim=1532, monkeypatch=monkeypatch) == set()     # rows not 16-byte multiples for TMA
    assert pair_gemms(hidden=6140, monkeypatch=monkeypatch) == set()
    assert pair_gemms(hopper=False, monkeypatch=monkeypatch) == set()  # sm_90a code runs on cc 9.0 only
    # the kernel sums its whole (doubled) K in one accumulator: not where that exceeds _ksplit.MAX_K
    assert pair_gemms(dim=_ksplit.MAX_K // 2 - 16, monkeypatch=monkeypatch) == {"gemm1"}
    assert pair_gemms(dim=_ksplit.MAX_K // 2 + 8, monkeypatch=monkeypatch) == set()
    monkeypatch.setenv("CUPYFFN_SM90_PAIR", "1")
    assert pair_gemms(monkeypatch=monkeypatch) == set(P.GEMMS)
    assert pair_gemms(tokens=_ksplit.MAX_K, monkeypatch=monkeypatch) == {"gemm1", "gemm3"}  # GEMM2/4: K = T
    assert pair_gemms(hopper=False, monkeypatch=monkeypatch) == set()
    monkeypatch.setenv("CUPYFFN_SM90_PAIR", "0")
    assert pair_gemms(monkeypatch=monkeypatch) == set()
    monkeypatch.setenv("CUPYFFN_SM90_PAIR", "yes")
    with pytest.raises(ValueError, match="CUPYFFN_SM90_PAIR must be 0, 1 or auto"):
        pair_gemms(monkeypatch=monkeypatch)


def test_default_windows(monkeypatch):
    monkeypatch.delenv("CUPYFFN_SM90_GEMM1", raising=False)
    first, last = E.FUSED_GEMM1_TOKENS[P.FMT_F16S]
    assert ok(P.FMT_F16S, first, monkeypatch=monkeypatch) and ok(P.FMT_F16S, last, monkeypatch=monkeypatch)
    assert not ok(P.FMT_F16S, first - 1, monkeypatch=monkeypatch)
    assert not ok(P.FMT_F16S, last + 1, monkeypatch=monkeypatch)
    assert P.FMT_BF16X3 in E.FUSABLE_FORMATS and P.FMT_BF16X3 not in E.FUSED_GEMM1_TOKENS  # measured slower
    assert not any(ok(P.FMT_BF16X3, t, monkeypatch=monkeypatch) for t in (1, 256, 1024, 8192))


@pytest.mark.parametrize("fmt", [P.FMT_F16S, P.FMT_BF16X3])
def test_override_and_what_the_kernel_cannot_take(fmt, monkeypatch):
    monkeypatch.setenv("CUPYFFN_SM90_GEMM1", "1")
    assert ok(fmt, 8192, monkeypatch=monkeypatch) and ok(fmt, 1, monkeypatch=monkeypatch)
    assert not ok(fmt, 0, monkeypatch=monkeypatch)                    # nothing to compute
    assert not ok(fmt, 1024, dim=1532, monkeypatch=monkeypatch)       # rows not 16-byte multiples for TMA
    assert not ok(fmt, 1024, hidden=6140, monkeypatch=monkeypatch)
    assert not ok(fmt, 1024, hopper=False, monkeypatch=monkeypatch)   # sm_90a code runs on cc 9.0 only
    # one accumulator sums GEMM1's whole K (D, times the planes): not beyond _ksplit.MAX_K
    planes = 3 if fmt == P.FMT_BF16X3 else 1
    assert ok(fmt, 1024, dim=_ksplit.MAX_K // planes // 8 * 8, monkeypatch=monkeypatch)
    assert not ok(fmt, 1024, dim=(_ksplit.MAX_K // planes // 8 + 1) * 8, monkeypatch=monkeypatch)
    monkeypatch.setenv("CUPYFFN_SM90_GEMM1", "0")
    first, _ = E.FUSED_GEMM1_TOKENS[P.FMT_F16S]
    assert not ok(fmt, first, monkeypatch=monkeypatch)


@pytest.mark.parametrize("fmt", [P.FMT_F32, P.FMT_BF16, P.FMT_F16E4M3])
def test_formats_the_kernel_does_not_serve_never_fuse(fmt, monkeypatch):
    monkeypatch.setenv("CUPYFFN_SM90_GEMM1", "1")
    assert not ok(fmt, 1024, monkeypatch=monkeypatch)


@pytest.mark.parametrize("value", ["yes", "", "2", "auto "])
def test_a_bad_override_names_the_variable(value, monkeypatch):
    monkeypatch.setenv("CUPYFFN_SM90_GEMM1", value)
    with pytest.raises(ValueError, match="CUPYFFN_SM90_GEMM1 must be 0, 1 or auto"):
        ok(P.FMT_F16S, 1024, monkeypatch=monkeypatch)


def gelu_ok(fmt=P.FMT_F16S, tokens=4096, fused=True, weight_grads=True, monkeypatch=None):
    engine = stand_in(fmt, tokens, 1536, 6144, True, monkeypatch)
    engine.fused_gemm1, engine.need_weight_grads = fused, weight_grads
    return E.GpuEngine._gelu_epilogue_ok(engine)


def test_gelu_out_from_gemm1s_epilogue(monkeypatch):
    """tf32's fused GEMM1 can write gelu_out's codes for GEMM2 in memory-mode calls (GELU_EPILOGUE_TOKENS,
    CUPYFFN_GELU_EPILOGUE), only where the fp16 fused GEMM1 runs and GEMM2 exists."""
    monkeypatch.delenv("CUPYFFN_GELU_EPILOGUE", raising=False)
    first, last = E.GELU_EPILOGUE_TOKENS[P.FMT_F16S]
    assert gelu_ok(tokens=first, monkeypatch=monkeypatch) and gelu_ok(tokens=last, monkeypatch=monkeypatch)
    assert first == 1 or not gelu_ok(tokens=first - 1, monkeypatch=monkeypatch)
    assert not gelu_ok(fused=False, monkeypatch=monkeypatch)          # the cuBLAS route converts gelu_out
    assert not gelu_ok(weight_grads=False, monkeypatch=monkeypatch)   # no GEMM2: nothing reads gelu_out
    monkeypatch.setenv("CUPYFFN_GELU_EPILOGUE", "1")
    assert not gelu_ok(fmt=P.FMT_BF16X3, monkeypatch=monkeypatch)     # bf16x3 planes: no such epilogue
    assert gelu_ok(tokens=1, monkeypatch=monkeypatch)
    monkeypatch.setenv("CUPYFFN_GELU_EPILOGUE", "0")
    assert not gelu_ok(monkeypatch=monkeypatch)
    monkeypatch.setenv("CUPYFFN_GELU_EPILOGUE", "on")
    with pytest.raises(ValueError, match="CUPYFFN_GELU_EPILOGUE must be 0, 1 or auto"):
        gelu_ok(monkeypatch=monkeypatch)
