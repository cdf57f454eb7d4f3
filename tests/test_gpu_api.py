"""GPU behaviour of the API: odd shapes, layouts, out=, streams, plans, graphs, accumulation,
partial gradients, threads, failures, robustness to extreme magnitudes and non-finite inputs."""

import threading

import numpy
import pytest

import cupyffn
from cupyffn.api import routes
from cupyffn.gemm import cublas as _cublas
from cupyffn import workloads as W

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

PRECISIONS = list(cupyffn.PRECISIONS)


def make(lead, dim, hidden, seed):
    inputs = W.make_inputs(lead, dim, hidden, xp=cupy, seed=seed)
    return [inputs[n] for n in W.INPUT_NAMES], inputs


def poisoned(args):
    return (cupy.full(args[1].shape, numpy.nan, dtype=cupy.float32),
            cupy.full(args[2].shape, numpy.nan, dtype=cupy.float32),
            cupy.full(args[3].shape, numpy.nan, dtype=cupy.float32))


def rel_errors(grads, ref64):
    return [W.relative_l2(g, r, xp=cupy) for g, r in zip(grads, ref64)]


def assert_contract(grads, ref64, precision, what=""):
    errs = rel_errors(grads, ref64)
    limit = cupyffn.PRECISIONS[precision].contract
    for label, g, e in zip(W.OUTPUT_NAMES, grads, errs):
        assert bool(cupy.isfinite(g).all()), f"{what} {precision} {label}: non-finite values"
        assert e <= limit, f"{what} {precision} {label}: rel L2 {e:.3g} > {limit:g}"


@pytest.mark.parametrize("tokens", [0, 1, 7, 613])
@pytest.mark.parametrize("dim,hidden", [(77, 301), (64, 256), (1536, 6144)])
def test_shapes(tokens, dim, hidden):
    if dim == 1536 and tokens == 613:
        pytest.skip("covered by the official workloads")
    lead = (tokens,)
    args, inputs = make(lead, dim, hidden, seed=tokens * 7 + dim)
    ref64 = W.reference(inputs, xp=cupy)
    for p in PRECISIONS:
        out = poisoned(args)
        grads = cupyffn.gelu_ffn_backward(*args, precision=p, out=out)
        if tokens == 0:
            assert grads[0].shape == (0, dim)
            assert bool((grads[1] == 0).all()) and bool((grads[2] == 0).all())
            continue
        assert_contract(grads, ref64, p, f"T={tokens} D={dim} H={hidden}")


def test_leading_dims_and_fresh_outputs():
    args, inputs = make((2, 3, 5), 64, 128, seed=3)
    grads = cupyffn.gelu_ffn_backward(*args)
    assert isinstance(grads, cupyffn.FFNGrads)
    assert grads.grad_hidden_states.shape == (2, 3, 5, 64)
    assert grads.grad_weight1.shape == (128, 64) and grads.grad_weight2.shape == (64, 128)
    assert_contract(grads, W.reference(inputs, xp=cupy), "bf16x3")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_row_strided_inputs_match_contiguous(precision):
    """Column slices of wider arrays (row stride > cols) and a misaligned start take the scalar path."""
    args, inputs = make((300,), 64, 256, seed=11)
    ref = cupyffn.gelu_ffn_backward(*args, precision=precision)
    wide = []
    for a in args:
        big = cupy.full((a.shape[0], a.shape[1] + 5), 7.0, dtype=cupy.float32)
        big[:, 1:1 + a.shape[1]] = a  # start 4 bytes in: not 16-byte aligned
        wide.append(big[:, 1:1 + a.shape[1]])
    got = cupyffn.gelu_ffn_backward(*wide, precision=precision)
    for g, r in zip(got, ref):
        assert W.relative_l2(g, r.astype(cupy.float64), xp=cupy) <= cupyffn.PRECISIONS[precision].contract / 4


def test_transposed_input_rejected():
    args, _ = make((16,), 32, 64, seed=1)
    args[4] = cupy.asfortranarray(args[4])
    with pytest.raises(ValueError, match="linear1_out has strides .* ascontiguousarray"):
        cupyffn.gelu_ffn_backward(*args)


def test_mixing_numpy_and_cupy_rejected():
    args, _ = make((16,), 32, 64, seed=1)
    args[2] = cupy.asnumpy(args[2])
    with pytest.raises(ValueError, match="cannot mix NumPy .*weight1"):
        cupyffn.gelu_ffn_backward(*args)


def test_different_devices_rejected():
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    args, _ = make((16,), 32, 64, seed=1)
    with cupy.cuda.Device(1):
        args[3] = cupy.asarray(args[3])
    with pytest.raises(ValueError, match="one device"):
        cupyffn.gelu_ffn_backward(*args)


def test_side_stream_join_read_immediately():
    """grad_weight1 (GEMM4, the last work on the side stream, which the final join guards) and
    grad_weight2 (GEMM2) come from the side stream; reading them on the caller's stream right away must
    see their final values."""
    args, inputs = make((8192,), 1536, 6144, seed=5)
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()  # inputs were made on the legacy stream, which `stream` does not follow
    with stream:
        out = poisoned(args)
        cupyffn.gelu_ffn_backward(*args, precision="ieee", out=out, stream=stream)
        # enqueued behind the call, no host synchronization in between; grad_weight1 first
        snapshots = (out[1].copy(), out[2].copy())
    stream.synchronize()
    for label, snapshot, final in zip(("grad_weight1", "grad_weight2"), snapshots, out[1:]):
        assert not bool(cupy.isnan(snapshot).any()), f"{label} read before the side stream wrote it"
        assert bool((snapshot == final).all()), f"{label} read before the side stream finished it"


def test_inputs_unchanged_and_outputs_not_aliased():
    args, _ = make((64,), 64, 256, seed=2)
    copies = [a.copy() for a in args]
    for p in PRECISIONS:
        cupyffn.gelu_ffn_backward(*args, precision=p)
    for a, c in zip(args, copies):
        assert bool((a.view(cupy.uint32) == c.view(cupy.uint32)).all())
    with pytest.raises(ValueError, match="overlaps the memory of weight1"):
        cupyffn.gelu_ffn_backward(*args, out=(None, args[2], None))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_accumulate(precision):
    args, inputs = make((257,), 64, 256, seed=9)
    fresh = cupyffn.gelu_ffn_backward(*args, precision=precision)
    rng = cupy.random.default_rng(4)
    start1 = rng.standard_normal(args[2].shape, dtype=cupy.float32)
    start2 = rng.standard_normal(args[3].shape, dtype=cupy.float32)
    out = (cupy.full(args[1].shape, numpy.nan, dtype=cupy.float32), start1.copy(), start2.copy())
    got = cupyffn.gelu_ffn_backward(*args, precision=precision, out=out, accumulate=True)
    assert bool(cupy.allclose(got[0], fresh[0], rtol=0, atol=0))  # overwritten, not accumulated
    for g, s, f in ((got[1], start1, fresh[1]), (got[2], start2, fresh[2])):
        assert float(cupy.abs(g - (s + f)).max()) <= 1e-5 * float(cupy.abs(s + f).max())


def test_partial_gradients():
    args, inputs = make((129,), 64, 256, seed=8)
    ref64 = W.reference(inputs, xp=cupy)
    g = cupyffn.gelu_ffn_backward(*args, need_weight_grads=False)
    assert g.grad_weight1 is None and g.grad_weight2 is None
    assert W.relative_l2(g.grad_hidden_states, ref64[0], xp=cupy) <= 1e-4
    g = cupyffn.gelu_ffn_backward(*args, need_grad_hidden=False)
    assert g.grad_hidden_states is None
    assert W.relative_l2(g.grad_weight1, ref64[1], xp=cupy) <= 1e-4
    assert W.relative_l2(g.grad_weight2, ref64[2], xp=cupy) <= 1e-4


@pytest.mark.parametrize("precision", PRECISIONS)
def test_plan_steady_state_allocates_nothing(precision):
    args, _ = make((512,), 128, 512, seed=12)
    plan = cupyffn.GeluFFNBackward(512, 128, 512, precision=precision)
    out = poisoned(args)
    plan(*args, out=out)
    pool = cupy.get_default_memory_pool()
    count = [0]

    def counting(nbytes):
        count[0] += 1
        return pool.malloc(nbytes)

    cupy.cuda.set_allocator(counting)
    try:
        for _ in range(3):
            plan(*args, out=out)
    finally:
        cupy.cuda.set_allocator(pool.malloc)
    assert count[0] == 0
    plan.close()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_graph_replay_matches_eager(precision):
    args, _ = make((300,), 128, 512, seed=21)
    stream = cupy.cuda.Stream(non_blocking=True)
    eager = cupyffn.GeluFFNBackward(300, 128, 512, precision=precision)
    graphed = cupyffn.GeluFFNBackward(300, 128, 512, precision=precision, graph=True)
    out_e, out_g = poisoned(args), poisoned(args)
    for step in range(3):
        if step:  # new contents, same addresses: the graph must pick them up
            new, _ = make((300,), 128, 512, seed=100 + step)
            for a, n in zip(args, new):
                a[...] = n
        cupy.cuda.Device().synchronize()  # made on the legacy stream, which `stream` does not follow
        with stream:
            for o in out_g:
                o.fill(numpy.nan)
            eager(*args, out=out_e, stream=stream)
            graphed(*args, out=out_g, stream=stream)
        stream.synchronize()
        for e, g in zip(out_e, out_g):
            assert bool((e.view(cupy.uint32) == g.view(cupy.uint32)).all()), f"step {step}"
    assert len(graphed.engine.graph_cache(routes.GRAPH_PLAN)._graphs) == 1


def test_graph_owned_outputs_are_reused():
    args, inputs = make((64,), 64, 256, seed=22)
    plan = cupyffn.GeluFFNBackward(64, 64, 256, graph=True)
    first = plan(*args)
    second = plan(*args)
    assert all(a is b for a, b in zip(first, second))
    assert_contract(second, W.reference(inputs, xp=cupy), "bf16x3")


def test_plan_on_two_streams_and_threads():
    shape = (500,)
    jobs = [make(shape, 128, 512, seed=s) for s in (31, 32)]
    expected = [cupyffn.gelu_ffn_backward(*a, precision="bf16x3") for a, _ in jobs]
    cupy.cuda.Device().synchronize()
    errors = []

    def work(i):
        try:
            with cupy.cuda.Device(0):
                stream = cupy.cuda.Stream(non_blocking=True)
                args = jobs[i][0]
                for _ in range(5):
                    with stream:
                        out = poisoned(args)
                        got = cupyffn.gelu_ffn_backward(*args, precision="bf16x3", out=out, stream=stream)
                    stream.synchronize()
                    for g, e in zip(got, expected[i]):
                        if not bool((g.view(cupy.uint32) == e.view(cupy.uint32)).all()):
                            errors.append(f"thread {i}: results differ from the single-threaded run")
        except Exception as e:  # surface in the main thread
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_cublas_failure_fills_out_with_nan(monkeypatch):
    args, _ = make((64,), 64, 256, seed=40)
    cupyffn.clear_cache()
    calls = [0]

    def failing_form(original):  # the third GEMM fails, launched directly or (call graph) through its table
        def failing(self, handle, *table):
            calls[0] += 1
            if calls[0] == 3:
                raise _cublas.CublasError("cublasGemmEx (injected)", 13)
            return original(self, handle, *table)
        return failing

    monkeypatch.setattr(_cublas.Gemm, "__call__", failing_form(_cublas.Gemm.__call__))
    monkeypatch.setattr(_cublas.Gemm, "indirect", failing_form(_cublas.Gemm.indirect))
    out = (cupy.zeros(args[1].shape, cupy.float32), cupy.zeros(args[2].shape, cupy.float32),
           cupy.zeros(args[3].shape, cupy.float32))
    with pytest.raises(cupyffn.CublasError, match="injected"):
        cupyffn.gelu_ffn_backward(*args, out=out)
    for o in out:
        assert bool(cupy.isnan(o).all())
    monkeypatch.undo()
    cupyffn.clear_cache()


def test_allocation_failure_is_memory_error_and_leaves_out_untouched(monkeypatch):
    args, _ = make((64,), 64, 256, seed=41)
    cupyffn.clear_cache()
    out = tuple(o.fill(3.0) or o for o in poisoned(args))

    def no_memory(nbytes):
        raise cupy.cuda.memory.OutOfMemoryError(nbytes, 0, 0)

    monkeypatch.setattr(cupy.cuda, "alloc", no_memory)
    with pytest.raises(MemoryError, match=r"cupyffn needs \d+ bytes"):
        cupyffn.gelu_ffn_backward(*args, out=out)
    monkeypatch.undo()
    for o in out:
        assert bool((o == 3.0).all())


def _scaled_inputs(scales, seed, tokens=256):
    """Consistent inputs (forward recomputed) with grad_output, hidden_states, weight1, weight2 scaled."""
    inputs = W.make_inputs((tokens,), 128, 512, xp=cupy, seed=seed)
    s_dy, s_x, s_w1, s_w2 = scales
    dy = (inputs["grad_output"].astype(cupy.float64) * s_dy).astype(cupy.float32)
    x = (inputs["hidden_states"].astype(cupy.float64) * s_x).astype(cupy.float32)
    w1 = (inputs["weight1"].astype(cupy.float64) * s_w1).astype(cupy.float32)
    w2 = (inputs["weight2"].astype(cupy.float64) * s_w2).astype(cupy.float32)
    z = (x.astype(cupy.float64) @ w1.T.astype(cupy.float64)).astype(cupy.float32)
    z64 = z.astype(cupy.float64)
    t = cupy.tanh(numpy.sqrt(2 / numpy.pi) * (z64 + 0.044715 * z64 ** 3)).astype(cupy.float32)
    g = (0.5 * z64 * (1 + t.astype(cupy.float64))).astype(cupy.float32)
    d = {"grad_output": dy, "hidden_states": x, "weight1": w1, "weight2": w2,
         "linear1_out": z, "tanh_inner": t, "gelu_out": g}
    return [d[n] for n in W.INPUT_NAMES], d


SCALES = [(1e30, 1, 1, 1), (1e-30, 1, 1, 1), (1, 1e-30, 1, 1), (1, 1, 1e-25, 1), (1, 1, 1, 1e25),
          (1e20, 1e-20, 1, 1)]


@pytest.mark.parametrize("scales", SCALES, ids=lambda s: "x".join(f"{v:g}" for v in s))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_extreme_magnitudes(scales, precision):
    args, inputs = _scaled_inputs(scales, seed=50)
    ref64 = W.reference(inputs, xp=cupy)
    assert all(bool(cupy.isfinite(r).all()) for r in ref64)
    grads = cupyffn.gelu_ffn_backward(*args, precision=precision, out=poisoned(args))
    assert_contract(grads, ref64, precision, f"scales {scales}")


def test_f16_scales_follow_the_data():
    """tf32 keeps per-tensor scales across calls (delayed scaling); a jump in magnitude is rescued in-call."""
    plan = cupyffn.GeluFFNBackward(256, 128, 512, precision="tf32")
    for scales in [(1, 1, 1, 1), (1e20, 1, 1, 1e-15), (1e-20, 1e10, 1e-10, 1), (1, 1, 1, 1)]:
        args, inputs = _scaled_inputs(scales, seed=51)
        grads = plan(*args, out=poisoned(args))
        assert_contract(grads, W.reference(inputs, xp=cupy), "tf32", f"scales {scales}")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_nonfinite_inputs_propagate_like_fp32(precision):
    args, inputs = make((64,), 64, 256, seed=60)
    inputs["grad_output"][3, 5] = numpy.nan
    inputs["hidden_states"][10, 7] = numpy.inf
    inputs["tanh_inner"][20, 30] = -numpy.inf
    # gelu_out stays 0.5 z (1 + t), as the backward's contract defines it (the tf32 plan on an H100/H200 forms it
    # from linear1_out and tanh_inner instead of reading it)
    z = inputs["linear1_out"][20, 30]
    inputs["gelu_out"][20, 30] = numpy.float32(0.5) * z * (numpy.float32(1.0) + inputs["tanh_inner"][20, 30])
    ref32 = W.reference(inputs, xp=cupy, dtype=numpy.float32)
    grads = cupyffn.gelu_ffn_backward(*[inputs[n] for n in W.INPUT_NAMES], precision=precision)
    for label, g, r in zip(W.OUTPUT_NAMES, grads, ref32):
        got = ~cupy.isfinite(g.reshape(r.shape))
        want = ~cupy.isfinite(r)
        assert bool(want.any()), label
        assert bool((got == want).all()), f"{precision} {label}: non-finite pattern differs from the fp32 reference"


def test_alternating_arrays_skip_validation(monkeypatch):
    """Two layers of one shape share a plan (or outputs alternate between two allocations): once each
    signature has been validated, neither call validates again, and both stay correct."""
    from cupyffn.api import validate as _validate

    sets = [make((96,), 64, 256, seed=s) for s in (41, 42)]
    outs = [poisoned(args) for args, _ in sets]
    plan = cupyffn.GeluFFNBackward(96, 64, 256)
    for (args, _), out in zip(sets, outs):
        plan(*args, out=out)
    calls = []
    real = _validate.validate
    monkeypatch.setattr(_validate, "validate", lambda *a, **k: calls.append(1) or real(*a, **k))
    for _ in range(3):
        for (args, inputs), out in zip(sets, outs):
            for o in out:
                o.fill(numpy.nan)
            plan(*args, out=out)
            assert_contract(out, W.reference(inputs, xp=cupy), "bf16x3", "alternating arrays")
    assert calls == [], f"{len(calls)} full validations for arrays validated before"
    plan.close()
