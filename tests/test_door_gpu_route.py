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
