"""The plan's choice of the fused GEMM1 + dgelu (Plan._fused_gemm1_ok, cupyffn/f32/plan.py) and of the other sm90
mechanisms without a GPU: the formats the kernel serves, the default windows (EngineOptions left at auto), the
options that override them (cupyffn/f32/options.py) and the shapes the kernel cannot take."""

import types

import pytest

from cupyffn.core import precision as P
from cupyffn.f32 import plan as E
from cupyffn.f32.options import EngineOptions
from cupyffn.gemm import ksplit as _ksplit

AUTO = EngineOptions()


def stand_in(fmt, tokens, dim, hidden, hopper, monkeypatch, options=AUTO):
    """A plan's fields the sm90 choices read, with Plan._sm90_fits, mnk and dims bound to them; `hopper`: what the
    plan's device question sm90_supported() answers."""
    engine = types.SimpleNamespace(fmt=fmt, T=tokens, D=dim, H=hidden, options=options, max_k=options.max_k,
                                   planes=3 if fmt == P.FMT_BF16X3 else 1, _sm90_supported=lambda: hopper,
                                   need_bias_grads=False)
    engine._sm90_fits = lambda: E.Plan._sm90_fits(engine)
    engine.mnk = lambda g: E.Plan.mnk(engine, g)
    engine.dims = lambda letters: E.Plan.dims(engine, letters)
    return engine


def ok(fmt, tokens, dim=1536, hidden=6144, hopper=True, monkeypatch=None, options=AUTO):
    return E.Plan._fused_gemm1_ok(stand_in(fmt, tokens, dim, hidden, hopper, monkeypatch, options))


def pair_gemms(tokens=8192, dim=1536, hidden=6144, hopper=True, monkeypatch=None, options=AUTO):
    return E.Plan._sm90_pair_gemms(stand_in(P.FMT_F16E4M3, tokens, dim, hidden, hopper, monkeypatch, options))


def test_sm90_pair_gemms(monkeypatch):
    """fp16+fp8: which pair GEMMs run as the sm90 pair kernel (EngineOptions.sm90_pair) and where the kernel cannot
    run."""
    assert pair_gemms(monkeypatch=monkeypatch) == {"gemm1", "gemm2", "gemm3", "gemm4"}  # T = 8192
    assert pair_gemms(tokens=3142, monkeypatch=monkeypatch) == {"gemm1"}
    assert pair_gemms(tokens=2048, monkeypatch=monkeypatch) == {"gemm1", "gemm2", "gemm3", "gemm4"}
    assert pair_gemms(tokens=1024, monkeypatch=monkeypatch) == {"gemm1", "gemm2", "gemm4"}
    assert pair_gemms(dim=1532, monkeypatch=monkeypatch) == set()     # rows not 16-byte multiples for TMA
    assert pair_gemms(hidden=6140, monkeypatch=monkeypatch) == set()
    assert pair_gemms(hopper=False, monkeypatch=monkeypatch) == set()  # sm_90a code runs on cc 9.0 only
    # the kernel sums its whole (doubled) K in one accumulator: not where that exceeds _ksplit.MAX_K
    # (at T = 3142, where GEMM1 alone runs it)
    assert pair_gemms(3142, dim=_ksplit.MAX_K // 2 - 16, monkeypatch=monkeypatch) == {"gemm1"}
    assert pair_gemms(3142, dim=_ksplit.MAX_K // 2 + 8, monkeypatch=monkeypatch) == set()
    every = EngineOptions(sm90_pair=True)
    assert pair_gemms(monkeypatch=monkeypatch, options=every) == set(P.GEMMS)
    assert pair_gemms(tokens=_ksplit.MAX_K, monkeypatch=monkeypatch, options=every) == {"gemm1", "gemm3"}  # K = T
    assert pair_gemms(hopper=False, monkeypatch=monkeypatch, options=every) == set()
    assert pair_gemms(monkeypatch=monkeypatch, options=EngineOptions(sm90_pair=False)) == set()
    # max_k=None (unbounded): the kernel takes any K
    assert pair_gemms(3142, dim=_ksplit.MAX_K, monkeypatch=monkeypatch, options=EngineOptions(max_k=None)) == {"gemm1"}


def test_default_windows(monkeypatch):
    first, last = E.FUSED_GEMM1_TOKENS[P.FMT_F16S]
    assert ok(P.FMT_F16S, first, monkeypatch=monkeypatch) and ok(P.FMT_F16S, last, monkeypatch=monkeypatch)
    assert not ok(P.FMT_F16S, first - 1, monkeypatch=monkeypatch)
    assert not ok(P.FMT_F16S, last + 1, monkeypatch=monkeypatch)
    assert P.FMT_BF16X3 in E.FUSABLE_FORMATS and P.FMT_BF16X3 not in E.FUSED_GEMM1_TOKENS  # measured slower
    assert not any(ok(P.FMT_BF16X3, t, monkeypatch=monkeypatch) for t in (1, 256, 1024, 8192))


@pytest.mark.parametrize("fmt", [P.FMT_F16S, P.FMT_BF16X3])
def test_override_and_what_the_kernel_cannot_take(fmt, monkeypatch):
    on = EngineOptions(fused_gemm1=True)
    assert ok(fmt, 8192, monkeypatch=monkeypatch, options=on) and ok(fmt, 1, monkeypatch=monkeypatch, options=on)
    assert not ok(fmt, 0, monkeypatch=monkeypatch, options=on)                    # nothing to compute
    assert not ok(fmt, 1024, dim=1532, monkeypatch=monkeypatch, options=on)       # rows not 16-byte multiples
    assert not ok(fmt, 1024, hidden=6140, monkeypatch=monkeypatch, options=on)
    assert not ok(fmt, 1024, hopper=False, monkeypatch=monkeypatch, options=on)   # sm_90a code runs on cc 9.0 only
    # one accumulator sums GEMM1's whole K (D, times the planes): not beyond _ksplit.MAX_K
    planes = 3 if fmt == P.FMT_BF16X3 else 1
    assert ok(fmt, 1024, dim=_ksplit.MAX_K // planes // 8 * 8, monkeypatch=monkeypatch, options=on)
    assert not ok(fmt, 1024, dim=(_ksplit.MAX_K // planes // 8 + 1) * 8, monkeypatch=monkeypatch, options=on)
    first, _ = E.FUSED_GEMM1_TOKENS[P.FMT_F16S]
    assert not ok(fmt, first, monkeypatch=monkeypatch, options=EngineOptions(fused_gemm1=False))


@pytest.mark.parametrize("fmt", [P.FMT_F32, P.FMT_BF16, P.FMT_F16E4M3])
def test_formats_the_kernel_does_not_serve_never_fuse(fmt, monkeypatch):
    assert not ok(fmt, 1024, monkeypatch=monkeypatch, options=EngineOptions(fused_gemm1=True))


@pytest.mark.parametrize("value", ["yes", "", "2", "auto ", 1, 0, None])
def test_a_bad_override_names_the_field(value, monkeypatch):
    """Only True, False or None (auto) is a switch's value; anything else is refused naming the field."""
    if value is None:
        assert EngineOptions(fused_gemm1=value).fused_gemm1 is None
        return
    with pytest.raises(TypeError, match="EngineOptions.fused_gemm1 must be None"):
        EngineOptions(fused_gemm1=value)


def gelu_ok(fmt=P.FMT_F16S, tokens=4096, fused=True, weight_grads=True, monkeypatch=None, options=AUTO):
    engine = stand_in(fmt, tokens, 1536, 6144, True, monkeypatch, options)
    engine.fused_gemm1, engine.need_weight_grads = fused, weight_grads
    return E.Plan._gelu_epilogue_ok(engine)


def test_gelu_out_from_gemm1s_epilogue(monkeypatch):
    """tf32's fused GEMM1 can write gelu_out's codes for GEMM2 in memory-mode calls (GELU_EPILOGUE_TOKENS,
    EngineOptions.gelu_epilogue), only where the fp16 fused GEMM1 runs and GEMM2 exists."""
    first, last = E.GELU_EPILOGUE_TOKENS[P.FMT_F16S]
    assert gelu_ok(tokens=first, monkeypatch=monkeypatch) and gelu_ok(tokens=last, monkeypatch=monkeypatch)
    assert first == 1 or not gelu_ok(tokens=first - 1, monkeypatch=monkeypatch)
    assert not gelu_ok(fused=False, monkeypatch=monkeypatch)          # the cuBLAS route converts gelu_out
    assert not gelu_ok(weight_grads=False, monkeypatch=monkeypatch)   # no GEMM2: nothing reads gelu_out
    on = EngineOptions(gelu_epilogue=True)
    assert not gelu_ok(fmt=P.FMT_BF16X3, monkeypatch=monkeypatch, options=on)  # bf16x3 planes: no such epilogue
    assert gelu_ok(tokens=1, monkeypatch=monkeypatch, options=on)
    assert not gelu_ok(monkeypatch=monkeypatch, options=EngineOptions(gelu_epilogue=False))


def warps_ok(fmt=P.FMT_F16S, tokens=4096, fused=True, monkeypatch=None, options=AUTO):
    engine = stand_in(fmt, tokens, 1536, 6144, True, monkeypatch, options)
    engine.fused_gemm1 = fused
    return E.Plan._epilogue_warps_ok(engine)


def test_epilogue_warps(monkeypatch):
    """The fused tf32 GEMM1's epilogue in warps of its own (EPILOGUE_WARPS_TOKENS, EngineOptions.epilogue_warps)."""
    first, last = E.EPILOGUE_WARPS_TOKENS[P.FMT_F16S]
    assert warps_ok(tokens=first, monkeypatch=monkeypatch) and warps_ok(tokens=last, monkeypatch=monkeypatch)
    assert not warps_ok(tokens=first - 1, monkeypatch=monkeypatch)
    assert not warps_ok(fused=False, monkeypatch=monkeypatch)
    on = EngineOptions(epilogue_warps=True)
    assert warps_ok(tokens=1, monkeypatch=monkeypatch, options=on)
    assert not warps_ok(fmt=P.FMT_BF16X3, monkeypatch=monkeypatch, options=on)
    assert not warps_ok(monkeypatch=monkeypatch, options=EngineOptions(epilogue_warps=False))


def _old_switch_wanted(choice, windows, fmt, tokens):
    """The rule the engine's environment switches followed before EngineOptions (values "auto", "1", "0")."""
    window = windows.get(fmt)
    return choice == "1" or (choice == "auto" and window is not None and window[0] <= tokens <= window[1])


TOKENS = (0, 1, 2, 255, 256, 257, 511, 512, 513, 1024, 2048, 3142, 4095, 4096, 4097, 8192, 2 ** 20, 2 ** 31 - 1)
FORMATS = (P.FMT_F16S, P.FMT_BF16X3, P.FMT_F32, P.FMT_BF16, P.FMT_F16E4M3)
WINDOWS = {"fused_gemm1": E.FUSED_GEMM1_TOKENS, "gelu_epilogue": E.GELU_EPILOGUE_TOKENS,
           "epilogue_warps": E.EPILOGUE_WARPS_TOKENS, "call_graph": E.CALL_GRAPH_TOKENS,
           "convert_ab": E.CONVERT_AB_TOKENS, "two_streams": E.TWO_STREAMS_TOKENS}


@pytest.mark.parametrize("field", sorted(WINDOWS))
@pytest.mark.parametrize("value,old", [(None, "auto"), (True, "1"), (False, "0")])
def test_options_make_the_choices_of_the_old_switches(field, value, old):
    """Each switch's value decides as the environment variable's auto / 1 / 0 did, at every format and T."""
    options = EngineOptions(**{field: value})
    for fmt in FORMATS:
        for tokens in TOKENS:
            got = E.option_wanted(getattr(options, field), WINDOWS[field], fmt, tokens)
            assert got is _old_switch_wanted(old, WINDOWS[field], fmt, tokens), (field, value, fmt, tokens)


def test_default_options_reproduce_the_measured_windows(monkeypatch):
    """EngineOptions() makes exactly the choices the plans made with no switch set: fused GEMM1 for tf32 at every
    T (never bf16x3), the sm90 pair for the GEMMs and T of SM90_PAIR_TOKENS, gelu_out in the epilogue from T = 4096,
    epilogue warps from T = 513."""
    assert AUTO == EngineOptions(None, None, None, None, None, None, None, _ksplit.MAX_K)
    for tokens in TOKENS[1:]:
        assert ok(P.FMT_F16S, tokens, monkeypatch=monkeypatch)
        assert not ok(P.FMT_BF16X3, tokens, monkeypatch=monkeypatch)
        assert gelu_ok(tokens=tokens, monkeypatch=monkeypatch) == (tokens >= 4096)
        assert warps_ok(tokens=tokens, monkeypatch=monkeypatch) == (tokens >= 513)
    for tokens in TOKENS:
        want = {g for g, windows in E.SM90_PAIR_TOKENS.items() if any(a <= tokens <= b for a, b in windows)}
        if 2 * ((tokens + 15) // 16 * 16) > _ksplit.MAX_K:  # GEMM2/GEMM4 (K = T) in K-chunks: cuBLAS's pair
            want -= {"gemm2", "gemm4"}
        assert pair_gemms(tokens, monkeypatch=monkeypatch) == want, tokens
    assert pair_gemms(3142, monkeypatch=monkeypatch) == {"gemm1"}
    # two streams everywhere but fp16+fp8 from T = 4096 on (one stream there: TWO_STREAMS_TOKENS)
    for tokens in TOKENS:
        for fmt in FORMATS:
            assert E.option_wanted(AUTO.two_streams, E.TWO_STREAMS_TOKENS, fmt, tokens) == (
                fmt != P.FMT_F16E4M3 or tokens < 4096), (fmt, tokens)
    for tokens in TOKENS:
        for fmt in FORMATS:
            small_tf32 = fmt == P.FMT_F16S and 1 <= tokens <= 512
            assert E.option_wanted(AUTO.call_graph, E.CALL_GRAPH_TOKENS, fmt, tokens) == small_tf32
            assert E.option_wanted(AUTO.convert_ab, E.CONVERT_AB_TOKENS, fmt, tokens) == small_tf32
