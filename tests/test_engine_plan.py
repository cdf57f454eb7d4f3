"""The backward plan's decisions on the CPU (cupyffn/f32/plan.py, layout.py, schedule.py's stage graph): for the 16
official workloads (cupyffn/workloads.json) and every precision, on a Hopper GPU and elsewhere, what runs: the form of
each GEMM and its fallbacks, the fused GEMM1 and its epilogue options, convert A+B in one launch, the call graph, the
K-chunks, the lean layout and the scratch layout. No CuPy, no GPU: the plan's two device questions are answered by
the test."""

import pytest

from benchmarks.stages import stage_bytes
from cupyffn.cuda import kernels as _kernels
from cupyffn.core import precision as P
from cupyffn import workloads as W
from cupyffn.f32 import layout as L
from cupyffn.f32 import plan as E
from cupyffn.f32 import schedule as S
from cupyffn.f32.options import EngineOptions
from cupyffn.gemm import ksplit

TOKENS = sorted({w.tokens for w in W.WORKLOADS})
D, H = W.DIM, W.HIDDEN_DIM


def build(precision, tokens, hopper=True, refuse=(), dim=D, hidden=H, **kw):
    """A plan of `precision` at `tokens`; `hopper`: a compute capability 9.0 GPU; `refuse`: the GEMMs whose e4m3
    product cuBLASLt refuses."""
    asked = []

    def build_fp8(plan, g):
        asked.append(g)
        desc = plan.fp8_desc(g)
        assert desc.k == 2 * L.pad16(plan.mnk(g)[2]) and desc.b_trans and desc.lda == desc.ldb == desc.k
        return f"no cuBLASLt algorithm for {g}" if g in refuse else None

    plan = E.Plan(tokens, dim, hidden, P.lookup(precision), sm90_supported=lambda: hopper, build_fp8=build_fp8, **kw)
    plan.asked_fp8 = asked
    return plan


def test_the_workloads_are_the_sixteen_official_ones():
    assert len(W.WORKLOADS) == 16 and (D, H) == (1536, 6144)
    assert TOKENS == [256, 512, 1024, 2048, 3142, 4096, 4904, 8192]


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hopper", [True, False])
def test_tf32(tokens, hopper):
    plan = build("tf32", tokens, hopper)
    assert plan.gemm_forms == dict.fromkeys(P.GEMMS, "f16s") and (plan.fmt, plan.planes) == (P.FMT_F16S, 1)
    assert plan.fused_gemm1 is hopper  # every T on cc 9.0 (FUSED_GEMM1_TOKENS)
    assert plan.gelu_epilogue_ok == (hopper and tokens >= 4096)
    assert plan.epilogue_warps == (hopper and tokens >= 513)
    assert plan.convert_ab == (tokens <= 512) and plan.call_graph == (tokens <= 512)
    assert plan.k_chunked == {} and not plan.layout.lean and plan.sm90_pair == set() and plan.form_notes == {}
    assert plan.layout.gg_bytes == (0 if hopper else 4 * tokens * H)  # the fused GEMM1 writes no grad_gelu
    five = ["grad_output", "weight2", "gelu_out", "hidden_states", "weight1"]
    modes = {False: (five, [])} if tokens <= 512 else {False: (five[:2], five[2:])}
    if plan.gelu_epilogue_ok:  # memory mode: gelu_out from GEMM1's epilogue, not convert B
        modes[True] = (five[:2], ["hidden_states", "weight1"])
    assert plan.convert_modes == modes
    assert plan.asked_fp8 == []


@pytest.mark.parametrize("tokens", TOKENS)
def test_bf16x3_and_its_lean_layout(tokens):
    plan = build("bf16x3", tokens)
    assert plan.gemm_forms == dict.fromkeys(P.GEMMS, "bf16x3") and (plan.fmt, plan.planes) == (P.FMT_BF16X3, 3)
    assert not plan.fused_gemm1 and not plan.call_graph and not plan.convert_ab  # measured slower: not listed
    assert plan.k_chunked == {}  # the longest K, 3 T = 24576 at T = 8192, is ksplit.MAX_K
    # lean once grad_gelu (fp32, T x H) holds weight1's and hidden_states' planes
    assert plan.layout.lean == (tokens >= 4096)
    lay = plan.layout
    if lay.lean:
        assert lay.ops["grad_linear1"].offset == lay.ops["gelu_out"].offset and lay.cvt_late == ["weight1", "hidden_states"]
        assert plan.convert_modes == {False: (["grad_output", "weight2"], ["gelu_out"])}
    assert build("bf16x3", tokens, options=EngineOptions(fused_gemm1=True)).fused_gemm1  # on request only


def _in(windows, tokens):
    return any(first <= tokens <= last for first, last in windows)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hopper", [True, False])
def test_fp16_fp8_forms_and_fallbacks(tokens, hopper):
    """Per GEMM: the pair as the sm90 kernel inside its SM90_PAIR_TOKENS windows (on a cc 9.0 GPU), else cuBLAS's
    pair inside CUBLAS_PAIR_TOKENS (asked of cuBLASLt once), else bf16x3 with a note saying why."""
    plan = build("fp16+fp8", tokens, hopper)
    if tokens < 1024:  # every GEMM bf16x3 (FORM_TABLE): the bf16x3 plan, bit for bit
        assert plan.gemm_forms == dict.fromkeys(P.GEMMS, "bf16x3") and (plan.fmt, plan.planes) == (P.FMT_BF16X3, 3)
        assert plan.asked_fp8 == [] and plan.layout.lean == (tokens >= 4096)
        return
    assert plan.fmt == P.FMT_F16E4M3 and not plan.fused_gemm1 and not plan.call_graph and not plan.convert_ab
    on_sm90 = {g for g, windows in E.SM90_PAIR_TOKENS.items() if _in(windows, tokens)} if hopper else set()
    assert plan.sm90_pair == on_sm90
    on_cublas = [g for g in P.GEMMS if g not in on_sm90 and E.CUBLAS_PAIR_TOKENS[g] is not None
                 and _in((E.CUBLAS_PAIR_TOKENS[g],), tokens)]
    want = {g: "f16+e4m3" if g in on_sm90 or g in on_cublas else "bf16x3" for g in P.GEMMS}
    for g in P.GEMMS:
        if want[g] == "bf16x3":
            assert "runs only as the sm90 pair kernel" in plan.form_notes[g]
    assert plan.gemm_forms == want
    assert plan.asked_fp8 == on_cublas  # the cuBLASLt pairs, asked once each
    if on_cublas:
        refused = build("fp16+fp8", tokens, hopper, refuse=(on_cublas[-1],))
        assert refused.gemm_forms[on_cublas[-1]] == "bf16x3"
        assert refused.form_notes[on_cublas[-1]] == f"no cuBLASLt algorithm for {on_cublas[-1]}"
    # the layout holds every encoding the forms read; each pair's K padded to 16, nothing overlaps
    ops = plan.layout.ops
    if want["gemm2"] == "f16+e4m3":
        assert {"grad_output", "grad_output.e4t", "gelu_out.e4t"} <= set(ops)
    if want["gemm4"] == "f16+e4m3":
        assert {"grad_linear1.e4t", "hidden_states.e4t"} <= set(ops)
    assert ("grad_output.x3" in ops) == (want["gemm1"] == "bf16x3" or want["gemm2"] == "bf16x3")
    spans = sorted((op.offset, op.offset + op.nbytes) for op in ops.values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= plan.layout.scratch_bytes


@pytest.mark.parametrize("precision,form,fmt", [("ieee", "f32", P.FMT_F32), ("bf16", "bf16", P.FMT_BF16)])
@pytest.mark.parametrize("tokens", TOKENS)
def test_ieee_and_bf16(precision, form, fmt, tokens):
    plan = build(precision, tokens)
    assert plan.gemm_forms == dict.fromkeys(P.GEMMS, form) and plan.fmt == fmt
    assert not (plan.fused_gemm1 or plan.call_graph or plan.convert_ab or plan.layout.lean or plan.k_chunked)
    assert (plan.layout.ops == {}) == (precision == "ieee")  # ieee reads its fp32 inputs as given


@pytest.mark.parametrize("precision", list(P.PRECISIONS))
@pytest.mark.parametrize("tokens", TOKENS)
def test_scratch_layout_is_aligned_and_inside_the_scratch(precision, tokens):
    for flags in ((True, True), (False, True), (True, False)):
        plan = build(precision, tokens, need_grad_hidden=flags[0], need_weight_grads=flags[1])
        lay = plan.layout
        assert set(plan.forms) == {"gemm1"} | ({"gemm3"} if flags[0] else set()) | \
            ({"gemm2", "gemm4"} if flags[1] else set())
        for name, op in lay.ops.items():
            assert op.offset % L.ALIGN == 0 and op.offset + op.nbytes <= lay.scratch_bytes, (name, op.offset)
            assert lay.lean or op.offset >= lay.gg_bytes  # grad_gelu first
        for a, b in plan.convert_modes.values():
            assert len(a) <= _kernels.MAX_JOBS and len(b) <= _kernels.MAX_JOBS


def test_k_chunks_follow_max_k():
    """k_chunked is what gemm.desc.build makes of the descriptions (ksplit.chunks of each GEMM's K); a chunked GEMM
    turns the call graph off, and the fused GEMM1 needs its whole K in one accumulator."""
    plan = build("bf16x3", 8192, options=EngineOptions(max_k=8192))
    assert plan.k_chunked == {"gemm2": 3, "gemm3": 3, "gemm4": 3}  # K = 3 T, 3 H; GEMM1: 3 D = 4608
    plan = build("tf32", 256, options=EngineOptions(max_k=128))
    assert not plan.fused_gemm1 and not plan.call_graph
    assert plan.k_chunked == {g: len(ksplit.chunks(k, 128)) for g, k in
                              (("gemm1", D), ("gemm2", 256), ("gemm3", H), ("gemm4", 256))}
    assert build("tf32", 256, options=EngineOptions(max_k=None)).call_graph
    assert build("fp16+fp8", 8192, options=EngineOptions(max_k=4096)).sm90_pair == {"gemm1"}  # 2 D = 3072 fits
    plan = build("fp16+fp8", 8192, options=EngineOptions(max_k=2048))
    assert plan.sm90_pair == set() and plan.gemm_forms["gemm1"] == "bf16x3"  # the pair's 2 D does not: bf16x3
    assert plan.k_chunked == {"gemm1": len(ksplit.chunks(3 * D, 2048)),
                              "gemm2": len(ksplit.chunks(2 * 8192, 2048)),  # the e4m3 product's doubled K
                              "gemm3": len(ksplit.chunks(2 * H, 2048)), "gemm4": len(ksplit.chunks(2 * 8192, 2048))}


def test_plans_of_t_zero_and_bad_options():
    plan = build("tf32", 0)
    assert not plan.fused_gemm1 and plan.k_chunked == {} and not plan.call_graph
    with pytest.raises(TypeError, match="options must be a cupyffn.f32.options.EngineOptions"):
        E.Plan(8, 8, 8, P.lookup("tf32"), options={"max_k": None})


def stage_context(plan, memory_mode=False, ieee_gelu=None):
    """The StageContext of `plan` in one mode, built as GpuEngine.stage_context builds it, its launches named by
    strings (`ieee_gelu`: ieee memory mode's recomputation of gelu_out)."""
    gelu_in_gemm1 = memory_mode and plan.gelu_epilogue_ok
    cvt_a, cvt_b = plan.convert_modes[gelu_in_gemm1]
    f16 = plan.fmt in (P.FMT_F16S, P.FMT_F16E4M3)
    fused = plan.fused_gemm1
    convert = {stage: (names, stage, f"{stage} rescue" if f16 else None) for stage, names in
               (("convert A", cvt_a), ("convert B", cvt_b), ("convert late", plan.layout.cvt_late)) if names}
    bias1, bias2 = ("bias1", ("bias2 bands", "bias2 rows")) if plan.need_bias_grads else (None, None)
    gemms = tuple(g if g in plan.forms and not (g == "gemm1" and fused) else None
                  for g in ("gemm1", "gemm2", "gemm3", "gemm4"))
    return S.StageContext(
        fmt=plan.fmt, cvt_a=cvt_a, cvt_b=cvt_b, fused_gemm1=fused, gelu_in_gemm1=gelu_in_gemm1, lean=plan.layout.lean,
        convert=convert, ieee_gelu=ieee_gelu, fused="fused" if fused else None,
        fused_rescue="fused rescue" if fused and f16 else None, decide="decide" if fused and f16 else None,
        dgelu=None if fused else "dgelu", dgelu_rescue="dgelu rescue" if f16 and not fused else None, bias1=bias1,
        bias2=bias2, gemms=gemms)


def _streams(steps):
    return [(s.stream, s.stage, s.waits, s.records) for s in steps if s.stage or s.waits or s.records]


def test_stage_graph_tf32_fused_memory_mode():
    """tf32 at T = 8192 on cc 9.0, memory mode: GEMM1's epilogue forms gelu_out, so GEMM2 waits for (D)."""
    steps = S.stages(stage_context(build("tf32", 8192), memory_mode=True))
    assert _streams(steps) == [
        ("S", "convert A", (), ()), ("S", "f16 rescue", (), ()), ("S", None, (), ("A",)),
        ("S2", None, ("A",), ()), ("S2", "convert B", (), ()), ("S2", "f16 rescue", (), ()), ("S2", None, (), ("B",)),
        ("S", "GEMM1 + dgelu (sm90 fused)", (), ()), ("S", None, ("B",), ()), ("S", "f16 rescue", (), ()),
        ("S", None, (), ("D",)), ("S2", "GEMM2 grad_weight2", ("D",), ()), ("S", "GEMM3 grad_hidden", (), ()),
        ("S2", "GEMM4 grad_weight1", ("D",), ())]
    assert [s.run for s in steps if s.stage == "f16 rescue"][-1] == ("decide", "fused rescue")
    assert [s.ready for s in steps if s.stage == "GEMM3 grad_hidden"] == [True]


def test_stage_graph_bf16x3_lean():
    """bf16x3 at T = 8192 (lean): S waits for GEMM2 before dgelu, converts late, and runs GEMM4 itself."""
    steps = S.stages(stage_context(build("bf16x3", 8192)))
    assert [(s.stream, s.stage) for s in steps if s.stage] == [
        ("S", "convert A"), ("S2", "convert B"), ("S", "GEMM1 grad_gelu"), ("S2", "GEMM2 grad_weight2"),
        ("S", "dgelu"), ("S", "convert late"), ("S", "GEMM3 grad_hidden"), ("S", "GEMM4 grad_weight1")]
    gemm2 = next(s for s in steps if s.stage == "GEMM2 grad_weight2")
    assert gemm2.waits == ("A",) and gemm2.run == (S.StepGemm(1),)
    assert S.FORK[0].records == ("start",) and S.JOIN[-1].waits == ("side",)


def test_stage_context_steps_and_bytes():
    """A StageContext carries its steps (stages of itself, built once per mode); ieee memory mode's recomputed
    gelu_out runs on S2 before (B); stage_bytes reads the context's conversions and the plan (the fused tf32 plan has
    no dgelu pass)."""
    fused = build("tf32", 8192)
    stage = stage_context(fused)
    assert stage.steps == S.stages(stage)
    assert set(stage_bytes(stage, fused)) == {"convert A", "convert B"}
    plan = build("bf16x3", 8192)
    got = stage_bytes(stage_context(plan), plan)
    assert set(got) == {"convert A", "convert B", "convert late", "dgelu"}
    assert got["dgelu"] == 12 * 8192 * H + plan.layout.written("grad_linear1")
    ieee = stage_context(build("ieee", 256), memory_mode=True, ieee_gelu="ieee gelu").steps
    i = next(i for i, s in enumerate(ieee) if s.stage == "gelu_out (recomputed)")
    assert ieee[i].stream == "S2" and ieee[i].run == ("ieee gelu",) and ieee[i + 1].records == ("B",)


@pytest.mark.parametrize("precision, tokens", [("tf32", 8192), ("bf16x3", 8192), ("fp16+fp8", 8192),
                                               ("fp16+fp8", 256)])
def test_stage_graph_with_bias_gradients(precision, tokens):
    """need_bias_grads: GEMM1 and the GELU derivative are two launches (the dgelu pass forms grad_bias1's column
    sums; tf32 would fuse them otherwise); both bias gradients are summed on S2 once dgelu is done (D), beside GEMM3
    and before GEMM4 where S2 runs it."""
    plan = build(precision, tokens, need_bias_grads=True)
    assert not plan.fused_gemm1 and build(precision, tokens).need_bias_grads is False
    steps = S.stages(stage_context(plan))
    staged = [(s.stream, s.stage) for s in steps if s.stage]
    assert ("S", "dgelu") in staged and ("S", "GEMM1 grad_gelu") in staged
    i = staged.index(("S2", "grad_bias2"))
    assert staged[i + 1] == ("S2", "grad_bias1")
    bias2 = next(s for s in steps if s.stage == "grad_bias2")
    bias1 = next(s for s in steps if s.stage == "grad_bias1")
    assert bias2.waits == ("D",) and bias2.run == ("bias2 bands", "bias2 rows") and bias1.run == ("bias1",)
    d = next(i for i, s in enumerate(steps) if "D" in s.records)
    assert d < steps.index(bias2) and staged.index(("S", "dgelu")) < i
    if ("S2", "GEMM4 grad_weight1") in staged:
        assert i < staged.index(("S2", "GEMM4 grad_weight1"))


@pytest.mark.parametrize("precision", ["ieee", "tf32", "bf16x3", "bf16", "fp16+fp8"])
@pytest.mark.parametrize("tokens", [256, 8192])
def test_bias_gradients_alone(precision, tokens):
    """need_bias_grads without grad_hidden_states or weight gradients (frozen weights and input): GEMM1, the dgelu
    pass (its column sums are grad_bias1's) and the two sums; no other GEMM and no convert B. Where no GEMM reads
    grad_linear1, fp16+fp8's dgelu pass still writes one encoding of it (fp16, the cheapest): split_e4m3 needs one."""
    plan = build(precision, tokens, need_grad_hidden=False, need_weight_grads=False, need_bias_grads=True)
    assert sorted(plan.forms) == ["gemm1"] and not plan.fused_gemm1
    stage = stage_context(plan)
    assert not stage.cvt_b and not plan.layout.cvt_late
    staged = [s.stage for s in S.stages(stage) if s.stage]
    assert [s for s in staged if s.startswith("GEMM")] == ["GEMM1 grad_gelu"]
    assert "dgelu" in staged and "grad_bias1" in staged and "grad_bias2" in staged
    if plan.fmt == P.FMT_F16E4M3:
        assert [k for k in plan.layout.ops if k.startswith("grad_linear1")] == ["grad_linear1"]


def test_a_recipe_the_engine_cannot_convert_for_is_refused():
    """A recipe mixing forms other than fp16+fp8's (f16+e4m3 with its bf16x3 fallback) has no operand format of the
    float32 engine: refused, where its format was taken for fp16+fp8's before; the NumPy backend still runs it (it
    rounds each GEMM by its own form)."""
    import dataclasses

    mixed = dataclasses.replace(P.PRECISIONS["bf16x3"], name="test-mix",
                                steps=(("gemm1", ((0, "f16s"),)), ("gemm2", ((0, "bf16"),)),
                                       ("gemm3", ((0, "f16s"),)), ("gemm4", ((0, "f16s"),))))
    with pytest.raises(ValueError, match=r"^precision 'test-mix' mixes the forms bf16, f16s: the float32 engine"):
        mixed.fmt
    assert P.PRECISIONS["fp16+fp8"].fmt == P.FMT_F16E4M3 and P.PRECISIONS["tf32"].fmt == P.FMT_F16S
    forms = P.effective_forms(mixed, 256, 64, 256)
    assert forms["gemm2"].name == "bf16" and forms["gemm1"].name == "f16s"
