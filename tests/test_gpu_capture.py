"""GPU: calls captured into the caller's CUDA graphs (CuPy stream capture, torch.cuda.graph) after a
warm-up on another stream; replays with new input contents into poisoned outputs, after clear_cache()
and after churning more plans than the cache holds; the errors for a call without a warm plan or
without out= during capture; pinned and closed plans; one thread checking a fixed shape while another
churns shapes. Small shapes: the file runs in well under a minute."""

import threading
import warnings

import numpy
import pytest

import cupyffn
from cupyffn.api import execute, routes
from cupyffn.core import plans as _plans, views as _views
from cupyffn import workloads as W
from cupyffn.gemm import sm90

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

PRECISIONS = list(cupyffn.PRECISIONS)
T, D, H = 384, 128, 512
CHURN = [(64 * (i + 1), 64 + 32 * (i % 3), 256 + 128 * (i % 4)) for i in range(9)]  # 9 shapes, none (T, D, H)
assert (T, D, H) not in CHURN and len(set(CHURN)) == len(CHURN)


@pytest.fixture(autouse=True)
def clean_plans():
    cupy.cuda.Device().synchronize()
    cupyffn.release_captured_plans()
    cupyffn.clear_cache()
    yield
    cupy.cuda.Device().synchronize()  # every replay has finished; the tests' graphs are gone with their frames
    cupyffn.release_captured_plans()
    cupyffn.clear_cache()


def make(seed, tokens=T, dim=D, hidden=H):
    inputs = W.make_inputs((tokens,), dim, hidden, xp=cupy, seed=seed)
    return [inputs[n] for n in W.INPUT_NAMES], inputs


def nan_outputs(args):
    return tuple(cupy.full(a.shape, numpy.nan, dtype=cupy.float32) for a in (args[1], args[2], args[3]))


def refill(args, seed):
    """New random contents in the arrays a graph captured (same addresses); returns their float64 reference."""
    new, inputs = make(seed, *_shape(args))
    for a, n in zip(args, new):
        if a is not None:
            a[...] = n
    return W.reference(inputs, xp=cupy)


def _shape(args):
    return args[0].shape[0], args[0].shape[1], args[2].shape[0]


def poison(outputs, stream):
    with stream:
        for o in outputs:
            o.fill(numpy.nan)


def assert_contract(grads, ref64, precision, what):
    limit = cupyffn.PRECISIONS[precision].contract
    for label, g, r in zip(W.OUTPUT_NAMES, grads, ref64):
        assert bool(cupy.isfinite(g).all()), f"{what} {precision} {label}: non-finite values (not written?)"
        err = W.relative_l2(g, r, xp=cupy)
        assert err <= limit, f"{what} {precision} {label}: rel L2 {err:.3g} > {limit:g}"


def capture(stream, fn):
    """fn() captured on `stream` (CuPy, relaxed mode); the capture is always ended."""
    stream.begin_capture()
    try:
        fn()
    finally:
        graph = stream.end_capture()
    return graph


def replay_and_check(graph, stream, args, out, precision, seeds, what):
    """Replay `graph` on `stream` once per seed: new contents in the captured arrays `args`, `out`
    poisoned first; every replay's results within the contract."""
    for seed in seeds:
        ref = refill(args, seed)
        cupy.cuda.Device().synchronize()
        poison(out, stream)
        graph.launch(stream=stream)
        stream.synchronize()
        assert_contract(out, ref, precision, f"{what} (inputs of seed {seed})")


def pinned_backward_plans():
    """The backward engines a caller's capture pinned (the functions' cached ones)."""
    from cupyffn.f32.engine import GpuEngine

    return [p for p in _plans._pinned.values() if isinstance(p, GpuEngine)]


def backward_cache():
    return execute.engine_cache("float32", "backward")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_cupy_capture_after_warmup_on_another_stream(precision):
    args, inputs = make(1)
    out = nan_outputs(args)
    warm, cap = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()  # inputs were made on the legacy stream, which these do not follow
    cupyffn.gelu_ffn_backward(*args, precision=precision, out=out, stream=warm)
    warm.synchronize()
    assert_contract(out, W.reference(inputs, xp=cupy), precision, "warm-up")
    graph = capture(cap, lambda: cupyffn.gelu_ffn_backward(*args, precision=precision, out=out, stream=cap))
    assert len(pinned_backward_plans()) == 1
    replay_and_check(graph, cap, args, out, precision, range(10, 13), "replay")


def test_cupy_capture_memory_mode_and_accumulate():
    """ieee memory mode (a buffer allocated on first use, so the warm-up must come first) with accumulate=True."""
    args, inputs = make(2)
    args[5] = args[6] = None
    gx = cupy.full(args[1].shape, numpy.nan, dtype=cupy.float32)
    cap = cupy.cuda.Stream(non_blocking=True)
    first = W.reference(inputs, xp=cupy)  # gradients to accumulate into, of the new ones' magnitude
    base1, base2 = (0.5 * first[1]).astype(cupy.float32), (-0.7 * first[2]).astype(cupy.float32)
    gw1, gw2 = base1.copy(), base2.copy()
    out = (gx, gw1, gw2)
    cupyffn.gelu_ffn_backward(*args, precision="ieee", out=out, accumulate=True)  # warm-up, legacy stream
    cupy.cuda.Device().synchronize()
    graph = capture(cap, lambda: cupyffn.gelu_ffn_backward(*args, precision="ieee", out=out, accumulate=True,
                                                          stream=cap))
    for step in range(2):
        ref = refill(args, seed=20 + step)
        gx.fill(numpy.nan)
        gw1[...] = base1
        gw2[...] = base2
        cupy.cuda.Device().synchronize()
        graph.launch(stream=cap)
        cap.synchronize()
        want = (ref[0], ref[1] + base1.astype(cupy.float64), ref[2] + base2.astype(cupy.float64))
        assert_contract(out, want, "ieee", f"memory mode, accumulate, replay {step}")


def test_eager_call_while_a_capture_holds_the_side_stream():
    """Between a captured call and the end of that capture, the plan's side stream is part of the
    capture; an eager call of the same plan on another stream (relaxed mode allows it) must neither
    break the capture nor lose its own work."""
    args, inputs = make(14)
    args2, inputs2 = make(15)
    out, out2 = nan_outputs(args), nan_outputs(args2)
    cap, other = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    cupyffn.gelu_ffn_backward(*args, out=out)  # warm-up, legacy stream
    cupy.cuda.Device().synchronize()

    def captured_then_eager():
        cupyffn.gelu_ffn_backward(*args, out=out, stream=cap)
        cupyffn.gelu_ffn_backward(*args2, out=out2, stream=other)  # same plan (same shape), eager

    poison(out, cap)
    cap.synchronize()
    graph = capture(cap, captured_then_eager)
    other.synchronize()
    assert_contract(out2, W.reference(inputs2, xp=cupy), "bf16x3", "eager call during the capture")
    assert bool(cupy.isnan(out[1]).all())  # the captured call did not run eagerly
    ref = refill(args, seed=16)
    cupy.cuda.Device().synchronize()
    graph.launch(stream=cap)
    cap.synchronize()
    assert_contract(out, ref, "bf16x3", "replay")
    poison(out2, other)
    cupyffn.gelu_ffn_backward(*args2, out=out2, stream=other)  # after the capture: the side stream again
    other.synchronize()
    assert_contract(out2, W.reference(inputs2, xp=cupy), "bf16x3", "eager call after the capture")


def test_two_captures_of_one_plan_open_at_once():
    """Two captures open at the same time (relaxed mode, one thread) both call the same cached plan: the
    first capture's call takes the plan's side stream, the second's must stay on its own stream (joining
    the side stream, still in the first capture, would invalidate both). Both graphs replay correctly."""
    args, _ = make(21)
    out_a, out_b = nan_outputs(args), nan_outputs(args)
    cap_a, cap_b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    cupyffn.gelu_ffn_backward(*args, out=out_a)  # warm-up (builds the plan)
    cupy.cuda.Device().synchronize()
    cap_a.begin_capture()
    try:
        cupyffn.gelu_ffn_backward(*args, out=out_a, stream=cap_a)
        graph_b = capture(cap_b, lambda: cupyffn.gelu_ffn_backward(*args, out=out_b, stream=cap_b))
        cupyffn.gelu_ffn_backward(*args, out=out_a, stream=cap_a)  # the first capture again: its side stream
    finally:
        graph_a = cap_a.end_capture()
    replay_and_check(graph_a, cap_a, args, out_a, "bf16x3", (22, 23), "first capture")
    replay_and_check(graph_b, cap_b, args, out_b, "bf16x3", (24,), "second capture")


def test_replay_survives_clear_cache_and_churn():
    args, inputs = make(3)
    out = nan_outputs(args)
    cap = cupy.cuda.Stream(non_blocking=True)
    cupyffn.gelu_ffn_backward(*args, out=out)  # warm-up on the legacy stream
    cupy.cuda.Device().synchronize()
    graph = capture(cap, lambda: cupyffn.gelu_ffn_backward(*args, out=out, stream=cap))
    (plan,) = pinned_backward_plans()
    lo = plan.scratch.ptr
    hi = lo + plan.scratch_bytes
    cupyffn.clear_cache()
    assert not plan.closed and plan.scratch is not None
    seen = 0
    for i, (t, d, h) in enumerate(CHURN):  # more plans than the cache holds: every unpinned one is evicted
        churn_args, _ = make(100 + i, t, d, h)
        cupyffn.gelu_ffn_backward(*churn_args)
        for other in backward_cache().plans():
            if other is plan:
                continue
            seen += 1
            o_lo = other.scratch.ptr
            o_hi = o_lo + other.scratch_bytes
            assert o_hi <= lo or hi <= o_lo, "a new plan was given the captured plan's scratch"
    assert seen >= len(CHURN)
    assert not plan.closed
    # still the cached plan for its shape: an eager call of that shape takes it (and makes it the most recently used,
    # so that release_captured_plans below, evicting the least recently used beyond the cache's size, keeps it)
    assert plan in backward_cache().plans()
    cupyffn.gelu_ffn_backward(*args, out=nan_outputs(args))
    cupy.cuda.Device().synchronize()
    assert backward_cache().plans()[-1] is plan  # the most recently used: the eager call took it
    replay_and_check(graph, cap, args, out, "bf16x3", range(30, 33), "replay after clear_cache and churn")
    del graph
    cupy.cuda.Device().synchronize()
    assert cupyffn.release_captured_plans() == 1
    assert not _plans.is_pinned(plan) and not plan.closed
    cupyffn.clear_cache()  # no longer skipped
    assert plan.closed


def test_torch_cuda_graph_after_warmup_on_a_side_stream():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    args, inputs = make(4)
    out = nan_outputs(args)
    cupy.cuda.Device().synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm up on a side stream, as torch's capture recipe does
        cupyffn.gelu_ffn_backward(*args, out=out, stream=_views.external_stream(int(side.cuda_stream), 0))
    side.synchronize()
    assert_contract(out, W.reference(inputs, xp=cupy), "bf16x3", "warm-up")
    g = torch.cuda.CUDAGraph()
    capture_stream = torch.cuda.Stream()
    cap = _views.external_stream(int(capture_stream.cuda_stream), 0)  # wrapped before the capture begins
    with torch.cuda.graph(g, stream=capture_stream):  # torch's default: global capture mode
        assert int(torch.cuda.current_stream().cuda_stream) == cap.ptr
        cupyffn.gelu_ffn_backward(*args, out=out, stream=cap)
    assert len(pinned_backward_plans()) == 1
    for step in range(3):
        ref = refill(args, seed=40 + step)
        for o in out:
            o.fill(numpy.nan)
        cupy.cuda.Device().synchronize()
        g.replay()
        torch.cuda.synchronize()
        assert_contract(out, ref, "bf16x3", f"torch replay {step}")
    cupyffn.clear_cache()
    for t, d, h in CHURN:
        cupyffn.gelu_ffn_backward(*make(5, t, d, h)[0])
    ref = refill(args, seed=49)
    for o in out:
        o.fill(numpy.nan)
    cupy.cuda.Device().synchronize()
    g.replay()
    torch.cuda.synchronize()
    assert_contract(out, ref, "bf16x3", "torch replay after clear_cache and churn")
    del g


def test_torch_capture_without_a_plan_raises():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    args, _ = make(6, 200, 64, 256)  # a shape no plan exists for
    out = nan_outputs(args)
    cupy.cuda.Device().synchronize()
    g = torch.cuda.CUDAGraph()
    capture_stream = torch.cuda.Stream()
    cap = _views.external_stream(int(capture_stream.cuda_stream), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the graph is empty
        with pytest.raises(RuntimeError, match="no plan exists for this shape/precision; call it once outside"):
            with torch.cuda.graph(g, stream=capture_stream):
                cupyffn.gelu_ffn_backward(*args, out=out, stream=cap)
    assert not torch.cuda.is_current_stream_capturing()
    assert not cap.is_capturing()
    assert not pinned_backward_plans()
    cupyffn.gelu_ffn_backward(*args, out=out)  # the device and the shape work afterwards
    cupy.cuda.Device().synchronize()
    assert_contract(out, W.reference(make(6, 200, 64, 256)[1], xp=cupy), "bf16x3", "after the failed capture")


def test_capture_without_a_plan_raises_and_the_stream_stays_usable():
    args, inputs = make(7, 200, 64, 256)  # a shape no plan exists for
    out = nan_outputs(args)
    cap = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    with pytest.raises(RuntimeError, match="during CUDA stream capture but no plan exists for this shape/precision; "
                                           "call it once outside the capture first"):
        capture(cap, lambda: cupyffn.gelu_ffn_backward(*args, out=out, stream=cap))
    assert not cap.is_capturing()
    assert not pinned_backward_plans()
    x, w1, w2 = args[1], args[2], args[3]
    fout = [cupy.full(s, numpy.nan, dtype=cupy.float32) for s in (x.shape, args[4].shape, args[4].shape,
                                                                    args[4].shape)]
    with pytest.raises(RuntimeError, match="gelu_ffn_forward was called during CUDA stream capture but no plan"):
        capture(cap, lambda: cupyffn.gelu_ffn_forward(x, w1, w2, out=fout, stream=cap))
    assert not cap.is_capturing()
    cupyffn.gelu_ffn_backward(*args, out=out, stream=cap)  # the stream works eagerly, and builds the plan
    cap.synchronize()
    assert_contract(out, W.reference(inputs, xp=cupy), "bf16x3", "eager after the failed capture")


def test_plan_built_while_the_current_stream_captures_raises():
    """A plan's build enqueues zero fills on CuPy's current stream: while that stream captures, the
    build is refused (it would land in the caller's graph), even when the call names another stream."""
    args, inputs = make(9, 96, 64, 256)  # a shape no plan exists for
    out = nan_outputs(args)
    cap, other = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()

    def build_inside():
        with cap:
            cupyffn.GeluFFNBackward(96, 64, 256)

    with pytest.raises(RuntimeError, match="cannot build a backward plan while CuPy's current stream is being captured"):
        capture(cap, build_inside)

    def call_inside():
        with cap:
            cupyffn.gelu_ffn_backward(*args, out=out, stream=other)

    with pytest.raises(RuntimeError, match="cannot build a backward plan while CuPy's current stream is being captured"):
        capture(cap, call_inside)
    assert not cap.is_capturing()
    assert bool(cupy.isnan(out[0]).all()), "the refused call wrote into out="
    cupyffn.gelu_ffn_backward(*args, out=out, stream=other)  # outside the capture it builds and runs
    other.synchronize()
    assert_contract(out, W.reference(inputs, xp=cupy), "bf16x3", "after the refused builds")


def test_capture_without_out_raises():
    args, _ = make(8)
    cupyffn.gelu_ffn_backward(*args)  # a warm plan, outputs allocated
    x, w1, w2 = args[1], args[2], args[3]
    cupyffn.gelu_ffn_forward(x, w1, w2)
    cupy.cuda.Device().synchronize()
    cap = cupy.cuda.Stream(non_blocking=True)
    gx = cupy.full(args[1].shape, numpy.nan, dtype=cupy.float32)

    def calls():
        with pytest.raises(RuntimeError, match=r"without out= for grad_weight1, grad_weight2: allocating from CuPy"):
            cupyffn.gelu_ffn_backward(*args, out=(gx, None, None), stream=cap)
        with pytest.raises(RuntimeError, match="without out= for grad_hidden_states, grad_weight1, grad_weight2"):
            cupyffn.gelu_ffn_backward(*args, stream=cap)
        with pytest.raises(RuntimeError, match="gelu_ffn_forward was called during CUDA stream capture without out="):
            cupyffn.gelu_ffn_forward(x, w1, w2, stream=cap)

    capture(cap, calls)
    assert not cap.is_capturing()
    assert not _plans._pinned
    assert bool(cupy.isnan(gx).all())  # nothing ran


def test_forward_capture_after_warmup_on_another_stream():
    inputs = W.make_inputs((T,), D, H, xp=cupy, seed=9)
    x, w1, w2 = inputs["hidden_states"], inputs["weight1"], inputs["weight2"]
    out = [cupy.full(s, numpy.nan, dtype=cupy.float32) for s in ((T, D), (T, H), (T, H), (T, H))]
    warm, cap = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    cupyffn.gelu_ffn_forward(x, w1, w2, precision="tf32", out=out, stream=warm)
    warm.synchronize()
    graph = capture(cap, lambda: cupyffn.gelu_ffn_forward(x, w1, w2, precision="tf32", out=out, stream=cap))
    assert len(_plans._pinned) == 1
    cupyffn.clear_cache()
    limit = cupyffn.PRECISIONS["tf32"].contract
    for step in range(2):
        new = W.make_inputs((T,), D, H, xp=cupy, seed=50 + step)
        for a, n in ((x, "hidden_states"), (w1, "weight1"), (w2, "weight2")):
            a[...] = new[n]
        cupy.cuda.Device().synchronize()
        poison(out, cap)
        graph.launch(stream=cap)
        cap.synchronize()
        for name, g, r in zip(cupyffn.FFNForward._fields, out, W.forward_reference(x, w1, w2, xp=cupy)):
            assert bool(cupy.isfinite(g).all()), (step, name)
            assert W.relative_l2(g, r, xp=cupy) <= limit, (step, name)


def test_graph_plan_inside_an_external_capture():
    """A graph=True plan captured by the caller runs its ordinary path into the caller's graph."""
    args, inputs = make(10)
    plan = cupyffn.GeluFFNBackward(T, D, H, graph=True)
    out = nan_outputs(args)
    plan(*args, out=out)  # captures its own graph, eagerly
    cupy.cuda.Device().synchronize()
    cap = cupy.cuda.Stream(non_blocking=True)
    graph = capture(cap, lambda: plan(*args, out=out, stream=cap))
    replay_and_check(graph, cap, args, out, "bf16x3", range(60, 62), "graph=True plan, external replay")
    assert len(plan.engine.graph_cache(routes.GRAPH_PLAN)._graphs) == 1  # its own graph, from the eager call


def test_user_plan_pinned_by_capture_then_closed():
    args, inputs = make(11)
    plan = cupyffn.GeluFFNBackward(T, D, H, precision="bf16")
    out = nan_outputs(args)
    plan(*args, out=out)
    cupy.cuda.Device().synchronize()
    cap = cupy.cuda.Stream(non_blocking=True)
    graph = capture(cap, lambda: plan(*args, out=out, stream=cap))
    with pytest.raises(RuntimeError, match="captured into a CUDA graph and is pinned"):
        plan.close()
    replay_and_check(graph, cap, args, out, "bf16", [70], "replay of a user plan")
    del graph
    assert cupyffn.release_captured_plans() == 1
    plan.close()
    with pytest.raises(RuntimeError, match="this GeluFFNBackward plan was closed"):
        plan(*args, out=out)


def test_closed_plan_raises():
    args, _ = make(12)
    plan = cupyffn.GeluFFNBackward(T, D, H)
    plan(*args)
    plan.close()
    plan.close()
    out = nan_outputs(args)
    with pytest.raises(RuntimeError, match="this GeluFFNBackward plan was closed"):
        plan(*args, out=out)
    assert bool(cupy.isnan(out[1]).all())  # nothing was written


def test_fixed_shape_stays_correct_while_another_thread_churns():
    args, inputs = make(13)
    expected = cupyffn.gelu_ffn_backward(*args)
    assert_contract(expected, W.reference(inputs, xp=cupy), "bf16x3", "reference run")
    churn_args = [make(200 + i, t, d, h)[0] for i, (t, d, h) in enumerate(CHURN)]
    cupy.cuda.Device().synchronize()
    done = threading.Event()
    errors, checked = [], [0]

    def fixed():
        try:
            with cupy.cuda.Device(0):
                s = cupy.cuda.Stream(non_blocking=True)
                out = nan_outputs(args)
                cupy.cuda.Device().synchronize()  # made on the legacy stream, which `s` does not follow
                while not done.is_set() or checked[0] < 20:
                    poison(out, s)
                    cupyffn.gelu_ffn_backward(*args, out=out, stream=s)
                    s.synchronize()
                    for label, g, e in zip(W.OUTPUT_NAMES, out, expected):
                        if not bool((g.view(cupy.uint32) == e.view(cupy.uint32)).all()):
                            errors.append(f"call {checked[0]}: {label} differs from the single-threaded result")
                            return
                    checked[0] += 1
        except Exception as e:  # surface in the main thread
            errors.append(f"fixed-shape thread: {type(e).__name__}: {e}")

    def churn():
        try:
            with cupy.cuda.Device(0):
                s = cupy.cuda.Stream(non_blocking=True)
                for round_ in range(15):
                    for a in churn_args:
                        cupyffn.gelu_ffn_backward(*a, stream=s)
                    if round_ % 5 == 4:
                        cupyffn.clear_cache()  # also while the other thread is inside a call
                s.synchronize()
        except Exception as e:
            errors.append(f"churn thread: {type(e).__name__}: {e}")
        finally:
            done.set()

    threads = [threading.Thread(target=fixed), threading.Thread(target=churn)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert checked[0] >= 20


@pytest.mark.parametrize("tokens", [3142, 4096])
def test_cupy_capture_of_the_fp16fp8_pair(tokens):
    """fp16+fp8 where it runs the e4m3 pair on GEMM2-4, as cuBLAS's two products (cuBLASLt's e4m3 GEMM: T = 3142,
    two streams) or as the sm90 pair kernel (T = 4096, one stream; on an H100/H200): capture after a warm-up, replays
    with new inputs (the fp16 scales re-decided on the device in every replay), accumulate into weight gradients."""
    args, inputs = make(3, tokens=tokens, dim=64, hidden=256)
    out = nan_outputs(args)
    cap = cupy.cuda.Stream(non_blocking=True)
    plan = cupyffn.GeluFFNBackward(tokens, 64, 256, precision="fp16+fp8")
    assert plan.gemm_forms["gemm2"] == "f16+e4m3", plan.gemm_forms
    assert ("gemm2" in plan.engine.plan.sm90_pair) == (tokens == 4096 and sm90.device_supported(cupy.cuda.Device().id))
    assert plan.engine.plan.two_streams == (tokens < 4096)
    cupyffn.gelu_ffn_backward(*args, precision="fp16+fp8", out=out)  # warm-up, legacy stream
    cupy.cuda.Device().synchronize()
    graph = capture(cap, lambda: cupyffn.gelu_ffn_backward(*args, precision="fp16+fp8", out=out, stream=cap))
    replay_and_check(graph, cap, args, out, "fp16+fp8", range(30, 33), "fp16+fp8 replay")
