"""The call graph (cupyffn/cuda/call_graph.py): an eager call as one CUDA graph launch, re-pointed at each call's arrays.

Every test compares the call-graph plan (the default) with the same plan built with
EngineOptions(call_graph=False) (each launch from the host) on fresh inputs at new addresses every call, outputs
NaN-poisoned: a graph that kept any address of an earlier call would read stale inputs or leave the new outputs
NaN. Both are also held to the
precision's contract against float64. (Other GPU tests run it too wherever it is the default: tf32, T <= 512.)
"""

import numpy
import pytest

import cupyffn
from cupyffn.api import routes
from cupyffn.gemm import cublas as _cublas
from cupyffn import workloads as W
from cupyffn.api.backward_plan import plan_with_options
from cupyffn.f32.options import EngineOptions

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
from gpu_inputs import make, poisoned  # noqa: E402  (tests/gpu_inputs.py)

#: Plans that can run a call graph (fp16+fp8 cannot: its cuBLASLt GEMMs take their output address on the host);
#: by default only tf32 at T <= 512 does (test_default_policy), the others are forced here (call_graph=True).
GRAPHED = ("tf32", "bf16", "bf16x3", "ieee")


def twin_plans(tokens, dim, hidden, precision, **kw):
    """(call-graph plan, launch-by-launch plan) of one shape (EngineOptions(call_graph=True) and False)."""
    eager = plan_with_options(tokens, dim, hidden, EngineOptions(call_graph=False), precision=precision, **kw)
    graphed = plan_with_options(tokens, dim, hidden, EngineOptions(call_graph=True), precision=precision, **kw)
    assert graphed.engine.call_graph and not eager.engine.call_graph
    return graphed, eager


def assert_close_to(got, want, what):
    """The two routes run the same kernels of ours; cuBLAS may choose another algorithm (e.g. another split of K)
    for the batched form of a GEMM: bit-identical for fp16 at the official shapes, 2e-5 apart for bf16x3's GEMM3 at
    T = 1024 (both within the contract, checked separately). A stale address gives differences of order 1."""
    for label, g, w in zip(W.OUTPUT_NAMES, got, want):
        if g is None:
            continue
        assert bool(cupy.isfinite(g).all()), f"{what} {label}: non-finite values (an output the graph did not write?)"
        assert W.relative_l2(g, w, xp=cupy) <= 1e-4, f"{what} {label}: differs from the launch-by-launch call"


def assert_contract(grads, inputs, precision, what):
    limit = cupyffn.PRECISIONS[precision].contract
    for label, g, r in zip(W.OUTPUT_NAMES, grads, W.reference(inputs, xp=cupy)):
        assert W.relative_l2(g, r, xp=cupy) <= limit, f"{what} {label}"


@pytest.mark.parametrize("precision", GRAPHED)
@pytest.mark.parametrize("tokens,dim,hidden", [(1, 64, 256), (300, 128, 520), (1024, 1536, 6144)])
def test_new_arrays_every_call(tokens, dim, hidden, precision):
    graphed, eager = twin_plans(tokens, dim, hidden, precision)
    for step in range(3):
        args, inputs = make(tokens, dim, hidden, seed=10 * step + tokens)  # new allocations: new addresses
        got = graphed(*args, out=poisoned(tokens, dim, hidden))
        want = eager(*args, out=poisoned(tokens, dim, hidden))
        assert_close_to(got, want, f"step {step}")
        assert_contract(got, inputs, precision, f"step {step}")
    engine = graphed.engine
    assert len(engine.runner.call_graphs) == 1  # captured once, re-pointed twice
    assert next(iter(engine.runner.call_graphs.values())).node_count >= 2  # the table and at least one kernel of ours
    graphed.close()
    assert engine.runner.call_graphs == {}


@pytest.mark.parametrize("precision", GRAPHED)
def test_accumulate_alternating(precision):
    """accumulate=True adds onto the weight gradients (cuBLAS beta 1, baked into a graph of its own)."""
    tokens, dim, hidden = 200, 64, 256
    graphed, eager = twin_plans(tokens, dim, hidden, precision)
    rng = numpy.random.default_rng(3)
    start = [cupy.asarray(rng.standard_normal(s).astype(numpy.float32)) for s in ((tokens, dim), (hidden, dim),
                                                                              (dim, hidden))]
    out_g, out_e = [s.copy() for s in start], [s.copy() for s in start]
    for step, accumulate in enumerate((True, False, True, True)):
        args, _ = make(tokens, dim, hidden, seed=50 + step)
        got = graphed(*args, out=out_g, accumulate=accumulate)
        want = eager(*args, out=out_e, accumulate=accumulate)
        assert_close_to(got, want, f"step {step} accumulate={accumulate}")
    assert set(graphed.engine.runner.call_graphs) == {(True, False, False), (False, False, False)}


def test_memory_mode_and_unaligned_rows_switch_the_kernel_variant():
    """tf32 on an H100/H200: the fused GEMM1's function changes with tanh_inner given or not and with the rows of
    linear1_out on 16-byte boundaries or not; one graph follows all four (the node's function is re-set)."""
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the fused GEMM1 runs on compute capability 9.0 GPUs only")
    tokens, dim, hidden = 300, 64, 256
    graphed, eager = twin_plans(tokens, dim, hidden, "tf32")
    assert graphed.fused_gemm1
    for step, (memory_mode, offset) in enumerate([(False, 0), (True, 1), (False, 1), (True, 0), (False, 0)]):
        args, inputs = make(tokens, dim, hidden, seed=70 + step)
        if offset:
            wide = cupy.full((tokens, hidden + 5), numpy.nan, cupy.float32)
            wide[:, offset:offset + hidden] = args[4]
            args[4] = wide[:, offset:offset + hidden]
        if memory_mode:
            args[5] = None
        got = graphed(*args, out=poisoned(tokens, dim, hidden))
        assert graphed.engine.stage.fused.staged == (offset == 0)
        want = eager(*args, out=poisoned(tokens, dim, hidden))
        assert_close_to(got, want, f"step {step} memory_mode={memory_mode} offset={offset}")
        assert_contract(got, inputs, "tf32", f"step {step}")
    assert len(graphed.engine.runner.call_graphs) == 1


@pytest.mark.parametrize("precision", GRAPHED)
def test_memory_mode_alternating(precision):
    """tanh_inner / gelu_out given, then not (memory mode: recomputed), then given again. For ieee memory mode adds
    a launch (gelu_out recomputed into fp32 scratch for GEMM2), so it gets a graph of its own (graph_key)."""
    tokens, dim, hidden = 160, 64, 256
    graphed, eager = twin_plans(tokens, dim, hidden, precision)
    for step, memory_mode in enumerate((False, True, False, True)):
        args, inputs = make(tokens, dim, hidden, seed=170 + step)
        if memory_mode:
            args[5] = args[6] = None
        got = graphed(*args, out=poisoned(tokens, dim, hidden))
        want = eager(*args, out=poisoned(tokens, dim, hidden))
        assert_close_to(got, want, f"step {step} memory_mode={memory_mode}")
        assert_contract(got, inputs, precision, f"step {step}")
    assert len(graphed.engine.runner.call_graphs) == (2 if precision == "ieee" else 1)


@pytest.mark.parametrize("need", ["grad_hidden", "weight_grads"])
def test_partial_gradients(need):
    tokens, dim, hidden = 129, 64, 256
    kw = {"need_grad_hidden": need == "grad_hidden", "need_weight_grads": need == "weight_grads"}
    graphed, eager = twin_plans(tokens, dim, hidden, "tf32", **kw)
    for step in range(2):
        args, _ = make(tokens, dim, hidden, seed=90 + step)
        out = [None if not wanted else o for o, wanted in zip(poisoned(tokens, dim, hidden),
                                                              (kw["need_grad_hidden"],) + (kw["need_weight_grads"],) * 2)]
        got = graphed(*args, out=tuple(out))
        want = eager(*args, out=tuple(o if o is None else o.copy() for o in out))
        assert_close_to(got, want, f"{need} step {step}")


def test_two_streams():
    """Calls alternating between two streams are ordered (they share the scratch) and each is re-pointed."""
    tokens, dim, hidden = 256, 128, 512
    graphed, eager = twin_plans(tokens, dim, hidden, "tf32")
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    results = []
    for step in range(4):
        args, _ = make(tokens, dim, hidden, seed=110 + step)
        cupy.cuda.Device().synchronize()  # made on the legacy stream, which the streams do not follow
        out = poisoned(tokens, dim, hidden)
        cupy.cuda.Device().synchronize()
        graphed(*args, out=out, stream=streams[step % 2])  # not synchronized: the next call must wait for it
        results.append((out, args))
    cupy.cuda.Device().synchronize()
    for step, (out, args) in enumerate(results):
        assert_close_to(out, eager(*args, out=poisoned(tokens, dim, hidden)), f"step {step}")


def test_grad_hidden_ready_calls_launch_by_launch():
    """grad_hidden_ready= records an event after GEMM3, which a graph cannot re-point: those calls launch as
    before, and give the same results."""
    tokens, dim, hidden = 256, 64, 256
    graphed, eager = twin_plans(tokens, dim, hidden, "tf32")
    ready = cupy.cuda.Event(disable_timing=True)
    args, _ = make(tokens, dim, hidden, seed=130)
    got = graphed(*args, out=poisoned(tokens, dim, hidden), grad_hidden_ready=ready)
    ready.synchronize()
    assert graphed.engine.runner.call_graphs == {}
    assert_close_to(got, eager(*args, out=poisoned(tokens, dim, hidden)), "grad_hidden_ready")


def test_failure_while_capturing_leaves_nan_and_a_usable_plan(monkeypatch):
    """A cuBLAS error during the capture: out= is NaN-filled, the stream leaves capture mode, and the next call
    captures again and is right."""
    tokens, dim, hidden = 64, 64, 256
    graphed, eager = twin_plans(tokens, dim, hidden, "bf16x3")
    original = _cublas.Gemm.indirect

    def failing(self, handle, table):
        raise _cublas.CublasError("cublasGemmBatchedEx (injected)", 13)

    monkeypatch.setattr(_cublas.Gemm, "indirect", failing)
    args, _ = make(tokens, dim, hidden, seed=140)
    out = tuple(o.fill(2.0) or o for o in poisoned(tokens, dim, hidden))
    with pytest.raises(cupyffn.CublasError, match="injected"):
        graphed(*args, out=out)
    for o in out:
        assert bool(cupy.isnan(o).all())
    assert graphed.engine.runner.call_graphs == {}
    monkeypatch.setattr(_cublas.Gemm, "indirect", original)
    got = graphed(*args, out=poisoned(tokens, dim, hidden))
    assert_close_to(got, eager(*args, out=poisoned(tokens, dim, hidden)), "after the failed capture")


def test_default_policy():
    """auto: the tf32 plan at T <= 512 (cupyffn/f32/plan.py CALL_GRAPH_TOKENS), nothing else; True: every plan it can."""
    for tokens, precision, graphed in ((1, "tf32", True), (512, "tf32", True), (513, "tf32", False),
                                       (256, "bf16x3", False), (256, "ieee", False), (256, "bf16", False)):
        plan = cupyffn.GeluFFNBackward(tokens, 64, 256, precision=precision)
        assert plan.engine.call_graph == graphed, (tokens, precision)
        args, inputs = make(tokens, 64, 256, seed=160)
        assert_contract(plan(*args, out=poisoned(tokens, 64, 256)), inputs, precision, f"{precision} T={tokens}")
        assert bool(plan.engine.runner.call_graphs) == graphed
    assert plan_with_options(4096, 64, 256, EngineOptions(call_graph=True), precision="ieee").engine.call_graph


def test_fp16_fp8_launches_by_launch():
    """fp16+fp8 where it runs e4m3 GEMMs (T >= 2048) launches by launch; below, it is the bf16x3 plan, graphed."""
    for tokens, graphed in ((2048, False), (256, True)):
        plan = plan_with_options(tokens, 64, 256, EngineOptions(call_graph=True), precision="fp16+fp8")
        assert ("f16+e4m3" in plan.gemm_forms.values()) != graphed
        assert plan.engine.call_graph == graphed
        args, inputs = make(tokens, 64, 256, seed=150)
        assert_contract(plan(*args, out=poisoned(tokens, 64, 256)), inputs, "fp16+fp8", f"T={tokens}")
        assert bool(plan.engine.runner.call_graphs) == graphed


def test_a_dropped_plan_frees_its_engine_at_once():
    """A plan's engine (streams, events, scratch, call graphs) is freed when the plan is, not left in a reference
    cycle for the garbage collector: a collection can run at any allocation, e.g. inside another plan's capture of
    its call graph, where destroying a stream or an event invalidates that capture (seen as
    cudaErrorStreamCaptureInvalidated in the next plan's first call)."""
    import gc
    import weakref

    tokens, dim, hidden = 1, 64, 256
    enabled, threshold = gc.isenabled(), gc.get_threshold()
    gc.collect()
    try:
        gc.disable()
        dropped = cupyffn.GeluFFNBackward(tokens, dim, hidden, precision="tf32")
        args, _ = make(tokens, dim, hidden, seed=180)
        dropped(*args, out=poisoned(tokens, dim, hidden))
        engine = weakref.ref(dropped.engine)
        del dropped
        assert engine() is None, "the engine outlived its plan (a reference cycle)"
        gc.enable()
        gc.set_threshold(1)  # collect at nearly every allocation, the capture below included
        plan = cupyffn.GeluFFNBackward(tokens, dim, hidden, precision="tf32")
        assert plan.engine.call_graph
        args, inputs = make(tokens, dim, hidden, seed=181)
        assert_contract(plan(*args, out=poisoned(tokens, dim, hidden)), inputs, "tf32", "after a dropped plan")
    finally:
        gc.set_threshold(*threshold)
        (gc.enable if enabled else gc.disable)()


def test_repeated_arrays_replay_a_graph_of_their_own():
    """Three input sets rotated, as the benchmark rotates them: the first round re-points the call graph, the second
    captures a graph per set of arrays, the third launches those without re-pointing anything; new contents in the
    same arrays (grad_output doubled in place) are read by the replays; every result within the contract and close
    to the launch-by-launch plan's."""
    tokens, dim, hidden = 256, 128, 512
    graphed, eager = twin_plans(tokens, dim, hidden, "tf32")
    sets = [make(tokens, dim, hidden, seed=170 + k) for k in range(3)]
    outs = [poisoned(tokens, dim, hidden) for _ in sets]
    replays = graphed.engine.graph_cache(routes.REPEATED)
    for round_ in range(3):
        for k, ((args, inputs), out) in enumerate(zip(sets, outs)):
            if round_ == 2:
                args[0] *= 2  # inputs[...] is the same array
            for o in out:
                o.fill(numpy.nan)
            got = graphed(*args, out=out)
            assert_contract(got, inputs, "tf32", f"round {round_} set {k}")
            assert_close_to(got, eager(*args, out=poisoned(tokens, dim, hidden)), f"round {round_} set {k}")
        assert (replays.captures, replays.launches) == [(0, 0), (3, 3), (3, 6)][round_]
    graphed.close()
    assert replays._graphs == {}
