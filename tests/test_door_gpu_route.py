"""The door's flow on every GPU route, through the real executor with only the device stubbed (tests/fake_gpu.py;
issue 59, item 9): a first call enters validate, route and execute once each and builds its engine once; a repeated
call, with the same arrays or with new output arrays of the same configuration (a training step's), neither
validates nor routes again, and the engine is bound to the new outputs. Followed by grad_output (or hidden_states)
as tests/door_trace.py follows an argument; torch tensors and CuPy arrays alike. tests/test_door_flow.py is the
NumPy route's, run for real."""

import pytest

pytest.importorskip("cupy")

import cupyffn  # noqa: E402
from cupyffn.api import routes  # noqa: E402

import fake_gpu  # noqa: E402
from door_trace import trace  # noqa: E402
from fake_gpu import BF16, F32, fresh  # noqa: E402

T, D, H = 12, 64, 256


@pytest.fixture
def gpu(monkeypatch):
    g = fake_gpu.install(monkeypatch)
    yield g
    fake_gpu.uninstall()


def _backward_arrays(dtype, as_cupy):
    shapes = [(T, D), (T, D), (H, D), (D, H), (T, H), (T, H) if dtype is F32 else None, (T, H)]
    args = fresh(shapes, dtype, as_cupy=as_cupy)
    weights = fresh([(H, D), (D, H)], F32 if dtype is F32 else dtype, as_cupy=as_cupy)
    args[2:4] = weights
    return args


def _backward_out(dtype, as_cupy):
    return fresh([(T, D)], dtype, as_cupy=as_cupy) + fresh([(H, D), (D, H)], F32, as_cupy=as_cupy)


def _forward_arrays(dtype, as_cupy):
    return fresh([(T, D)], dtype, as_cupy=as_cupy) + fresh([(H, D), (D, H)], F32, as_cupy=as_cupy) + [None, None]


def _forward_out(dtype, as_cupy):
    tanh = [(T, H)] if dtype is F32 else [None]
    return fresh([(T, D), (T, H)] + tanh + [(T, H)], dtype, as_cupy=as_cupy)


#: (what, the pass, activation dtype, precision, the engine the route table builds, its graph policy)
CASES = [
    ("tf32 backward", "backward", F32, "tf32", "GpuEngine", routes.REPEATED),
    ("bf16x3 backward", "backward", F32, "bf16x3", "GpuEngine", routes.EAGER),
    ("bf16 backward (cuBLASLt)", "backward", BF16, None, "LtBackward", routes.REPEATED),
    ("tf32 forward", "forward", F32, "tf32", "GpuForward", routes.EAGER),
    ("bf16 forward (cuBLASLt)", "forward", BF16, None, "LtForward", routes.REPEATED),
]


def _call(kind, precision, args, out, stream):
    if kind == "forward":
        x, w1, w2, b1, b2 = args
        return cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2, precision=precision, out=out, stream=stream)
    return cupyffn.gelu_ffn_backward(*args, precision=precision, out=out, stream=stream)


def _ptr(a):
    return a.data_ptr() if isinstance(a, fake_gpu.FakeTensor) else a.data.ptr


def _bound(args, out):
    """What the engine is bound to for `args` and `out` (RecordingEngine's note): input and output addresses."""
    return ("bind", tuple(None if a is None else _ptr(a) for a in args),
            tuple(0 if o is None else _ptr(o) for o in out))


def _follows(array):
    """carries() for tests/door_trace.py: `array` itself, a CuPy view of its memory, or its address."""
    ptr = _ptr(array)

    def carries(obj):
        if obj is array or (type(obj) is int and obj == ptr):
            return True
        data = getattr(obj, "data", None)
        return getattr(data, "ptr", None) == ptr or getattr(obj, "ptr", None) == ptr

    return carries


@pytest.mark.parametrize("as_cupy", [False, True], ids=["torch", "cupy"])
@pytest.mark.parametrize("what,kind,dtype,precision,engine,policy", CASES, ids=[c[0] for c in CASES])
def test_first_call_and_repeats(gpu, what, kind, dtype, precision, engine, policy, as_cupy):
    make_args, make_out = (_forward_arrays, _forward_out) if kind == "forward" else (_backward_arrays, _backward_out)
    args, out = make_args(dtype, as_cupy), make_out(dtype, as_cupy)
    stream = fake_gpu.FakeStream(0x9000)
    followed = _follows(args[0])

    first = trace(lambda: _call(kind, precision, args, out, stream), followed)
    for stage in ("api/validate.py", "api/routes.py", "api/execute.py"):
        assert first.entries[stage] == 1, (stage, first.files)
    assert first.functions["api/validate.py:validate"] == 1 and first.functions["api/routes.py:route"] == 1
    assert first.doubled <= 0.25 * len(first.files), first.files
    assert all(r is o for r, o in zip(first.result, out))  # the caller's out= objects
    assert [e.name for e in gpu.engines] == [engine]
    built = gpu.engines[0]
    assert built.log[0] == _bound(args, out)
    assert built.log[1][0] in ("enqueue", "call graph")
    assert gpu.torch_waits == ([] if as_cupy else [(fake_gpu.TORCH_STREAM, 0x9000, 0)])

    again = trace(lambda: _call(kind, precision, args, out, stream), followed)
    assert again.entries["api/validate.py"] == 1 and again.entries["api/execute.py"] == 1, again.files
    assert "api/routes.py" not in again.entries and again.functions["api/validate.py:validate"] == 0
    assert len(gpu.engines) == 1
    if policy is routes.REPEATED:  # the second sighting of these arrays is captured
        assert [e[0] for e in gpu.log] == ["capture", "graph launch"] and gpu.log[1][1] == 0x9000

    new_out = make_out(dtype, as_cupy)  # a training step's: new outputs, the same configuration
    step = trace(lambda: _call(kind, precision, args, new_out, stream), followed)
    assert step.entries["api/validate.py"] == 1 and step.entries["api/execute.py"] == 1, step.files
    assert step.functions["api/validate.py:validate"] == 0 and "api/routes.py" not in step.entries
    assert all(r is o for r, o in zip(step.result, new_out)) and len(gpu.engines) == 1
    assert _bound(args, new_out) in built.log  # bound to the new outputs


def test_a_plan_goes_through_the_same_door(gpu):
    """GeluFFNBackward: its engine built once, with the plan; its calls validated and routed once."""
    plan = cupyffn.GeluFFNBackward(T, D, H, precision="bf16x3", device=0)
    assert [e.name for e in gpu.engines] == ["GpuEngine"]
    args, out = _backward_arrays(F32, False), _backward_out(F32, False)
    stream = fake_gpu.FakeStream(0x9000)
    followed = _follows(args[0])
    first = trace(lambda: plan(*args, out=out, stream=stream), followed)
    assert first.functions["api/validate.py:validate"] == 1 and first.functions["api/routes.py:route"] == 1
    again = trace(lambda: plan(*args, out=out, stream=stream), followed)
    assert again.functions["api/validate.py:validate"] == 0 and "api/routes.py" not in again.entries
    assert [e[0] for e in plan.engine.log] == ["bind", "enqueue", "enqueue"]
    plan.close()


def _validated(kind, args, out, precision):
    from cupyffn.api import validate

    request = validate.Request(kind, precision)
    return validate.validate(request, args, out)._replace(arrays=None, out_arrays=None)


@pytest.mark.parametrize("as_cupy", [False, True], ids=["torch", "cupy"])
@pytest.mark.parametrize("kind,dtype,precision", [("backward", F32, "tf32"), ("backward", BF16, None),
                                                  ("forward", F32, "bf16x3"), ("forward", BF16, None)])
def test_a_call_at_new_addresses_is_the_call_validation_gives(gpu, kind, dtype, precision, as_cupy):
    """The remembered call pointed at new addresses (outputs, and inputs too) equals the Call a full validation of
    those arrays gives, field for field."""
    from cupyffn.api import validate

    make_args, make_out = (_forward_arrays, _forward_out) if kind == "forward" else (_backward_arrays, _backward_out)
    request = validate.Request(kind, precision)
    first = make_args(dtype, as_cupy)
    validate.check(request, first, make_out(dtype, as_cupy))
    for moved in ("outputs", "everything"):
        args = make_args(dtype, as_cupy) if moved == "everything" else first
        out = make_out(dtype, as_cupy)
        call, _ = validate.check(request, args, out)
        assert call._replace(arrays=None, out_arrays=None) == _validated(kind, args, out, precision)
        assert call.arrays == tuple(args) and call.out_arrays == tuple(out)


def test_new_outputs_are_still_checked_for_aliasing(gpu):
    """What depends on the addresses is checked on every call of a remembered configuration: an output over an input
    or over another output is refused with validation's message, and nothing is run."""
    args, out = _backward_arrays(F32, False), _backward_out(F32, False)
    cupyffn.gelu_ffn_backward(*args, precision="tf32", out=out)
    engine = gpu.engines[0]
    runs = len(engine.log)
    over_input = list(out)
    over_input[1] = fake_gpu.FakeTensor(args[2].ptr, (H, D))  # grad_weight1 written over weight1
    with pytest.raises(ValueError, match=r"^out\[1\] \(grad_weight1\) overlaps the memory of weight1: outputs may "
                                         r"not alias inputs$"):
        cupyffn.gelu_ffn_backward(*args, precision="tf32", out=over_input)
    over_output = list(out)
    over_output[2] = fake_gpu.FakeTensor(out[1].ptr + 4 * D, (D, H))  # inside grad_weight1
    with pytest.raises(ValueError, match=r"^out\[2\] \(grad_weight2\) overlaps out\[1\] \(grad_weight1\)$"):
        cupyffn.gelu_ffn_backward(*args, precision="tf32", out=over_output)
    assert len(engine.log) == runs
    cupyffn.gelu_ffn_backward(*args, precision="tf32", out=out)  # the remembered call is intact
    assert engine.log[-1][0] == "enqueue" and len(gpu.engines) == 1


def test_another_device_or_alignment_is_another_configuration(gpu, monkeypatch):
    """An output on another device, or a cuBLASLt input off its 16-byte boundary: validated (and routed) again, so
    their errors are validation's and the route's."""
    from cupyffn.api import validate

    args, out = _backward_arrays(F32, False), _backward_out(F32, False)
    cupyffn.gelu_ffn_backward(*args, precision="tf32", out=out)
    other = list(out)
    other[0] = fake_gpu.FakeTensor(out[0].ptr, (T, D), device=1)
    with pytest.raises(ValueError, match=r"^out\[0\] \(grad_hidden_states\) is on cuda:1 but the inputs are on "
                                         r"cuda:0$"):
        cupyffn.gelu_ffn_backward(*args, precision="tf32", out=other)
    half = _backward_arrays(BF16, False)
    cupyffn.gelu_ffn_backward(*half, out=_backward_out(BF16, False))
    shifted = list(half)
    shifted[0] = fake_gpu.FakeTensor(half[0].ptr + 2, (T, D), dtype=BF16)
    with pytest.raises(ValueError, match=r"^grad_output must start on a 16-byte boundary \(cuBLASLt\)"):
        cupyffn.gelu_ffn_backward(*shifted, out=_backward_out(BF16, False))
    assert len(validate._remembered) == 3  # the refused layout is remembered, its route not


def test_the_least_recently_used_calls_are_dropped(gpu, monkeypatch):
    """Full, the remembered calls lose their least recently used quarter, not everything."""
    from cupyffn.api import validate

    monkeypatch.setattr(validate, "REMEMBERED_SIZE", 8)
    request = validate.Request("backward", "tf32")
    calls = []
    for tokens in range(1, 9):
        args = fresh([(tokens, D), (tokens, D), (H, D), (D, H), (tokens, H), (tokens, H), (tokens, H)])
        calls.append(args)
        validate.check(request, args)
    for args in calls[:2] + calls[4:]:  # used again: calls[2] and calls[3] are the least recently used
        validate.check(request, args)
    validate.check(request, fresh([(9, D), (9, D), (H, D), (D, H), (9, H), (9, H), (9, H)]))
    kept = sorted(config[0][0][0] for config, _, _ in validate._remembered)  # grad_output's T of each
    assert kept == [1, 2, 5, 6, 7, 8, 9]


def test_no_tokens_is_a_row_of_the_table(gpu, monkeypatch):
    """T = 0 on the GPU: the route table's NoTokens engine, built per call and run by the executor: the weight
    gradients zero-filled on the call's stream, grad_hidden_ready recorded; no engine cached, nothing validated or
    routed again."""
    from cupyffn.api import no_tokens

    filled = []
    monkeypatch.setattr(no_tokens, "fill", lambda array, stream, value: filled.append((array.data.ptr, stream.ptr,
                                                                                       value)))
    import cupy

    def empty(shape, dtype):  # an array with no elements, made without the device's memory pool
        memory = cupy.cuda.UnownedMemory(next(fake_gpu._addresses) << 30, 1, None, 0)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))

    monkeypatch.setattr(cupy, "empty", empty)
    shapes = [(0, D), (0, D), (H, D), (D, H), (0, H), (0, H), (0, H)]
    args = fresh(shapes[:2], as_cupy=True) + fresh(shapes[2:4]) + fresh(shapes[4:], as_cupy=True)
    out = fresh([(0, D)], as_cupy=True) + fresh([(H, D), (D, H)])
    stream = fake_gpu.FakeStream(0x9000)
    ready = fake_gpu.FakeEvent()
    flow = trace(lambda: cupyffn.gelu_ffn_backward(*args, precision="tf32", out=out, stream=stream,
                                                   grad_hidden_ready=ready), _follows(args[2]))
    assert flow.functions["api/routes.py:route"] == 1
    assert filled == [(out[1].ptr, 0x9000, 0), (out[2].ptr, 0x9000, 0)]
    assert ("record", ready.ptr, 0x9000) in gpu.runtime.log and gpu.engines == []
    cupyffn.gelu_ffn_backward(*args, precision="tf32", out=out, stream=stream, accumulate=True)
    assert len(filled) == 2  # accumulating: kept as they are
