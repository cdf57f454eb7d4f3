"""grad_hidden_ready=: an event recorded right after grad_hidden_states is written (tensor-parallel overlap).

CPU: the argument's errors. GPU (marked gpu): another stream waits on the event and copies grad_hidden_states
while the caller's stream is still busy; the copy must equal the float64 reference (the output was NaN-poisoned
before the call, so a copy taken before GEMM3 wrote it fails), in both engine layouts (GEMM4 on the side
stream, and the "lean" layout where GEMM4 follows GEMM3 on the caller's stream).
"""

import numpy
import pytest

import cupyffn
from cupyffn import workloads as W


def test_cpu_arrays_refuse_the_event():
    inputs = W.make_inputs((8,), 16, 32, seed=3)
    args = [inputs[n] for n in W.INPUT_NAMES]
    with pytest.raises(ValueError, match="grad_hidden_ready= is for GPU arrays"):
        cupyffn.gelu_ffn_backward(*args, grad_hidden_ready=object())
    plan = cupyffn.GeluFFNBackward(8, 16, 32, device="cpu")
    with pytest.raises(ValueError, match="grad_hidden_ready= is for GPU arrays"):
        plan(*args, grad_hidden_ready=object())
    assert numpy.isfinite(plan(*args).grad_hidden_states).all()  # the plan still works


@pytest.mark.gpu
@pytest.mark.parametrize("lead, dim, hidden, lean", [((64,), 256, 1024, False), ((2, 1024), 256, 1024, True)],
                         ids=["side-stream-gemm4", "lean"])
def test_event_orders_a_reader_on_another_stream(lead, dim, hidden, lean):
    cupy = pytest.importorskip("cupy")
    inputs = W.make_inputs(lead, dim, hidden, xp=cupy, seed=11)
    ref64 = W.reference(inputs, xp=cupy)
    args = [inputs[n] for n in W.INPUT_NAMES]
    tokens = int(numpy.prod(lead))
    plan = cupyffn.GeluFFNBackward(tokens, dim, hidden, precision="bf16x3")
    assert plan.engine.layout.lean is lean  # both orders of GEMM3 / GEMM4 are covered
    main, reader = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    ready = cupy.cuda.Event(disable_timing=True)
    busy = cupy.random.default_rng(0).standard_normal((4096, 4096), dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    for trial in range(3):
        with main:
            out = [cupy.full(a.shape, numpy.nan, dtype=cupy.float32) for a in args[1:4]]
            for _ in range(10):  # keeps `main` busy: a reader not ordered after GEMM3 sees NaN
                busy = cupy.tanh(busy @ busy)
        grads = plan(*args, out=out, stream=main, grad_hidden_ready=ready)
        with reader:
            reader.wait_event(ready)
            copy = grads.grad_hidden_states.copy()  # read on `reader`, before the call is joined
        reader.synchronize()
        main.synchronize()
        err = W.relative_l2(copy, ref64[0], xp=cupy)
        assert err <= cupyffn.PRECISIONS["bf16x3"].contract, (trial, err)
        for g, r in zip(grads, ref64):  # the whole call is still complete on `main`
            assert W.relative_l2(g, r, xp=cupy) <= cupyffn.PRECISIONS["bf16x3"].contract
    # functional API, same event
    with main:
        out = [cupy.full(a.shape, numpy.nan, dtype=cupy.float32) for a in args[1:4]]
    cupyffn.gelu_ffn_backward(*args, out=out, stream=main, grad_hidden_ready=ready)
    with reader:
        reader.wait_event(ready)
        copy = out[0].copy()
    reader.synchronize()
    assert W.relative_l2(copy, ref64[0], xp=cupy) <= cupyffn.PRECISIONS["bf16x3"].contract
    main.synchronize()


@pytest.mark.gpu
def test_event_argument_errors():
    cupy = pytest.importorskip("cupy")
    inputs = W.make_inputs((8,), 16, 32, xp=cupy, seed=5)
    args = [inputs[n] for n in W.INPUT_NAMES]
    with pytest.raises(TypeError, match="grad_hidden_ready must be a cupy.cuda.Event"):
        cupyffn.gelu_ffn_backward(*args, grad_hidden_ready="now")
    with pytest.raises(ValueError, match="need_grad_hidden=False"):
        cupyffn.gelu_ffn_backward(*args, need_grad_hidden=False, grad_hidden_ready=cupy.cuda.Event())
    plan = cupyffn.GeluFFNBackward(8, 16, 32, graph=True)
    with pytest.raises(ValueError, match="graph=True plans"):
        plan(*args, grad_hidden_ready=cupy.cuda.Event())
