"""The host path of torch tensors in the functional API, on the CPU: a float32 CUDA torch tensor is read from its
attributes (data_ptr, shape, stride, device) instead of a DLPack import, validated once per signature, and the call
follows torch's current stream once (cupyffn/core/arrays.py, cupyffn/api/validate.py; docs/decisions/048-dlpack-free-import.md).

No GPU here: a fake tensor type stands for torch.Tensor (it is registered as the type read by pointer), views over
its made-up addresses are built but never touched, and the stream queries and the device-side wait are recorded
instead of made. tests/test_gpu_host_path.py runs the real thing.
"""

import types

import numpy
import pytest

cupy = pytest.importorskip("cupy")

from cupyffn.api import backward_plan as _backward_plan, execute as _execute  # noqa: E402
from cupyffn.api import functional as _functional, validate as _validate  # noqa: E402
from cupyffn.core import arrays as _arrays, views as _views  # noqa: E402
from cupyffn.core.results import BACKWARD_INPUTS  # noqa: E402

T, D, H = 12, 64, 256
INPUT_SHAPES = ((T, D), (T, D), (H, D), (D, H), (T, H), (T, H), (T, H))
OUT_SHAPES = ((T, D), (H, D), (D, H))
F32 = object()  # plays torch.float32 (compared with `is`)
F16 = object()
TORCH_STREAM = 0x7000
OTHER_STREAM = 0x9000


class FakeTensor:
    """What cupyffn reads of a torch tensor: data_ptr(), shape, stride() (elements), dtype, is_cuda, get_device()."""

    def __init__(self, ptr, shape, stride=None, dtype=F32, device=0, cuda=True):
        self.ptr, self.shape, self.dtype, self.is_cuda, self.device = ptr, tuple(shape), dtype, cuda, device
        self._stride = tuple(stride) if stride is not None else (shape[1], 1)
        self.reads = 0

    def data_ptr(self):
        self.reads += 1
        return self.ptr

    def stride(self):
        return self._stride

    def get_device(self):
        return self.device


class FakeSubclass(FakeTensor):
    """A tensor subclass (FakeTensor, FunctionalTensor, ...): never read by pointer."""


def tensors(base=1 << 36, shapes=INPUT_SHAPES, **kw):
    """Fake tensors at distinct, non-overlapping made-up addresses."""
    return [FakeTensor(base + (i << 28), s, **kw) for i, s in enumerate(shapes)]


class Stream:
    def __init__(self, ptr):
        self.ptr = ptr


def prepare(args, out=None, stream=None, **flags):
    """The one validator on a backward call."""
    return _validate.validate(_validate.Request("backward", **flags), args, out, stream)


def signature(args, out=None):
    return _validate.signature(args, out)


@pytest.fixture
def fake_torch(monkeypatch):
    """FakeTensor registered as torch's tensor type; torch's current stream TORCH_STREAM; waits recorded."""
    state = types.SimpleNamespace(torch_stream=TORCH_STREAM, waits=[], stream_queries=0, cupy_current=OTHER_STREAM)

    def torch_stream(device):
        state.stream_queries += 1
        return state.torch_stream

    monkeypatch.setattr(_arrays, "_torch_types", frozenset({FakeTensor}))
    monkeypatch.setattr(_arrays, "_torch_f32", F32)
    monkeypatch.setattr(_arrays, "_torch_stream", torch_stream)
    monkeypatch.setattr(_arrays, "_wait", lambda producer, consumer, device, capturing=None: state.waits.append(
        (producer, consumer, device)))
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda device_id=-1: Stream(state.cupy_current))
    monkeypatch.setattr(_views, "_views", {})
    return state


# ---------------------------------------------------------------------------------------------
# signature
# ---------------------------------------------------------------------------------------------
def test_signature_of_torch_tensors(fake_torch):
    """The configuration of the arrays (shape, strides in elements, dtype, device, address mod 16) and, apart, their
    addresses."""
    args, out = tensors(), tensors(base=1 << 40, shapes=OUT_SHAPES)
    sig = signature(args, out)
    assert sig is not None and sig == signature(args, out)
    config, where = sig
    assert config[0] == ((T, D), (D, 1), F32, 0, 0)
    assert where[:7] == tuple(a.ptr for a in args) and where[7:10] == tuple(o.ptr for o in out)
    # another shape, strides, dtype, device or alignment: another configuration
    strided = list(args)
    strided[1] = FakeTensor(args[1].ptr, (T, D), (2 * D, 1))
    assert signature(strided, out)[0] != config
    half = list(args)
    half[1] = FakeTensor(args[1].ptr, (T, D), dtype=F16)  # read by pointer too (16-bit activations)
    assert signature(half, out)[0] != config
    elsewhere = list(args)
    elsewhere[1] = FakeTensor(args[1].ptr, (T, D), device=1)
    assert signature(elsewhere, out)[0] != config
    misaligned = list(args)
    misaligned[2] = FakeTensor(args[2].ptr + 4, (H, D))
    assert signature(misaligned, out)[0] != config
    assert signature(args, None)[0] != config
    # another address of the same configuration: the same configuration
    moved = list(args)
    moved[2] = FakeTensor(args[2].ptr + 4096, (H, D))
    assert signature(moved, out)[0] == config and signature(moved, out)[1] != where
    # memory mode: None entries
    assert signature(args[:5] + [None, None], out) is not None


@pytest.mark.parametrize("make", [
    lambda a: FakeTensor(a.ptr, a.shape, cuda=False),    # a CPU tensor: NumPy through DLPack
    lambda a: FakeSubclass(a.ptr, a.shape),              # a subclass: DLPack
    lambda a: object(),                                  # not an array at all
], ids=["cpu", "subclass", "object"])
def test_signature_is_none_where_validation_must_look(fake_torch, make):
    args = tensors()
    for i in (0, 3, 6):
        bad = list(args)
        bad[i] = make(args[i])
        assert signature(bad) is None
    out = tensors(base=1 << 40, shapes=OUT_SHAPES)
    out[1] = make(out[1])
    assert signature(args, out) is None


def test_torch_and_cupy_entries_never_collide(fake_torch):
    """A CuPy view of the same memory has a signature entry of another form (strides in bytes, NumPy's dtype)."""
    args = tensors()
    view = _views.float32_view(args[0].ptr, (T, D), (D, 1), 0)
    mixed = [view] + args[1:]
    sig_t, sig_m = signature(args), signature(mixed)
    assert sig_t is not None and sig_m is not None and sig_t[0] != sig_m[0]
    assert sig_m[0][0] == ((T, D), (4 * D, 4), numpy.dtype(numpy.float32), 0, 0) and sig_m[1][0] == args[0].ptr


def test_no_torch_means_no_signature_yet(monkeypatch):
    """Before torch tensors were seen the signature cannot tell what another object is: UNKNOWN, asked again after
    validating. NumPy arrays it can always tell."""
    monkeypatch.setattr(_validate, "_cupy_ndarray", None)
    monkeypatch.setattr(_arrays, "_torch_types", None)
    monkeypatch.setitem(__import__("sys").modules, "cupy", None)
    arrays = [numpy.zeros(2)] * 7
    assert signature(arrays[:6] + [FakeTensor(1 << 36, (T, H))]) is _validate.UNKNOWN
    config, where = signature(arrays)
    assert config[0] == ((2,), (8,), numpy.dtype(numpy.float64), "cpu", where[0] & 15, True)


# ---------------------------------------------------------------------------------------------
# prepare: geometry, errors, the stream followed once
# ---------------------------------------------------------------------------------------------
def test_prepare_reads_geometry_by_pointer(fake_torch):
    args = tensors()
    # hidden_states: columns [0, D) of a [T, 3 D] buffer (row stride 3 D); weight2: rows of a wider buffer
    args[1] = FakeTensor(args[1].ptr, (T, D), (3 * D, 1))
    args[0] = FakeTensor(args[0].ptr, (3, 4, D), (4 * D, D, 1))  # leading dims flatten: T = 12
    args[1] = FakeTensor(args[1].ptr, (3, 4, D), (4 * 3 * D, 3 * D, 1))
    for i in (4, 5, 6):
        args[i] = FakeTensor(args[i].ptr, (3, 4, H), (4 * H, H, 1))
    out = tensors(base=1 << 40, shapes=((3, 4, D), (H, D), (D, H)),)
    out[0] = FakeTensor(out[0].ptr, (3, 4, D), (4 * D, D, 1))
    call = prepare(args, out, Stream(TORCH_STREAM))
    assert (call.backend, call.device, call.tokens, call.dim, call.hidden_dim) == ("gpu", 0, T, D, H)
    assert call.lead_shape == (3, 4)
    assert call.inputs[1] == _arrays.Matrix(args[1].ptr, T, D, 3 * D)  # float32
    assert call.inputs[2] == _arrays.Matrix(args[2].ptr, H, D, D)
    assert call.out[0] == _arrays.Matrix(out[0].ptr, T, D, D)
    assert all(isinstance(a, cupy.ndarray) for a in call.arrays)
    assert call.arrays[1].data.ptr == args[1].ptr and call.arrays[1].strides == (4 * 3 * D * 4, 3 * D * 4, 4)
    assert call.follow == 0


def test_validation_waits_for_nothing_and_marks_the_stream_to_follow(fake_torch):
    args, out = tensors(), tensors(base=1 << 40, shapes=OUT_SHAPES)
    call = prepare(args, out, Stream(OTHER_STREAM))
    assert call.follow == 0 and fake_torch.waits == [] and fake_torch.stream_queries == 0


def test_the_stream_is_followed_once_per_call(fake_torch, fake_gpu):
    """The executor orders its stream after torch's once per call, whatever the number of tensors."""
    plan = _FakePlan()
    args, out = tensors(), tensors(base=1 << 40, shapes=OUT_SHAPES)
    plan(*args, out=out, stream=Stream(OTHER_STREAM))
    assert fake_torch.waits == [(TORCH_STREAM, OTHER_STREAM, 0)]  # ten tensors, one wait
    assert fake_torch.stream_queries == 1
    fake_torch.waits.clear()
    plan(*args, out=out, stream=Stream(TORCH_STREAM))  # cupyffn on torch's own stream: stream order holds
    assert fake_torch.waits == []
    plan(*args, out=out, stream=None)  # None: CuPy's current stream of the device (OTHER_STREAM here)
    assert fake_torch.waits == [(TORCH_STREAM, OTHER_STREAM, 0)]
    assert len(fake_gpu) == 3


def test_no_wait_for_cupy_arrays(fake_torch):
    views = [_views.float32_view(a.ptr, a.shape, a.stride(), 0) for a in tensors()]
    call = prepare(views, None, Stream(OTHER_STREAM))
    assert call.follow is None and fake_torch.waits == [] and fake_torch.stream_queries == 0


def test_nothing_is_waited_for_when_validation_fails(fake_torch):
    args = tensors()
    args[2] = FakeTensor(args[2].ptr, (H, D + 1))
    with pytest.raises(ValueError, match=r"^weight1 must have shape"):
        prepare(args, None, Stream(OTHER_STREAM))
    assert fake_torch.waits == []


@pytest.mark.parametrize("index", range(7))
def test_unreadable_layout_names_the_argument(fake_torch, index):
    args = tensors()
    a = args[index]
    args[index] = FakeTensor(a.ptr, a.shape, (1, a.shape[0]))  # a transpose: last dimension not unit-stride
    name = BACKWARD_INPUTS[index]
    strides = (4, 4 * a.shape[0])
    with pytest.raises(ValueError, match=rf"^{name} has strides \({strides[0]}, {strides[1]}\) \(bytes\) for shape"):
        prepare(args, None, Stream(TORCH_STREAM))


def test_non_contiguous_out_names_the_entry(fake_torch):
    out = tensors(base=1 << 40, shapes=OUT_SHAPES)
    out[2] = FakeTensor(out[2].ptr, (D, H), (2 * H, 1))
    with pytest.raises(ValueError, match=r"^out\[2\] \(grad_weight2\) must be C-contiguous"):
        prepare(tensors(), out, Stream(TORCH_STREAM))


def test_devices_must_agree(fake_torch):
    args = tensors()
    args[3] = FakeTensor(args[3].ptr, args[3].shape, device=1)
    with pytest.raises(ValueError, match=r"^all arrays must be on one device; weight2 is on cuda:1 but grad_output is "
                                         r"on cuda:0 \(.*weight2 on cuda:1"):
        prepare(args, None, Stream(TORCH_STREAM))
    out = tensors(base=1 << 40, shapes=OUT_SHAPES)
    out[0] = FakeTensor(out[0].ptr, out[0].shape, device=1)
    with pytest.raises(ValueError, match=r"^out\[0\] \(grad_hidden_states\) is on cuda:1 but the inputs are on cuda:0"):
        prepare(tensors(), out, Stream(TORCH_STREAM))


def test_aliasing_is_still_refused(fake_torch):
    args = tensors()
    out = tensors(base=1 << 40, shapes=OUT_SHAPES)
    out[1] = FakeTensor(args[2].ptr, (H, D))  # grad_weight1 written over weight1
    with pytest.raises(ValueError, match=r"^out\[1\] \(grad_weight1\) overlaps the memory of weight1"):
        prepare(args, out, Stream(TORCH_STREAM))


def test_real_torch_tensors_of_other_dtypes_keep_dlpacks_message():
    """A CPU (or non-float32) torch tensor is not read by pointer: DLPack and the usual float32 message."""
    torch = pytest.importorskip("torch")
    import cupyffn

    rng = numpy.random.default_rng(0)
    args = [torch.from_numpy(rng.standard_normal(s).astype(numpy.float32)) for s in INPUT_SHAPES]
    assert signature(args) in (None, _validate.UNKNOWN)  # CPU tensors: never the pointer path
    args[3] = args[3].half()
    with pytest.raises(TypeError, match=r"^weight2 must be float32; got float16$"):
        cupyffn.gelu_ffn_backward(*args)


# ---------------------------------------------------------------------------------------------
# reuse: the validated call of a repeated signature, through a plan
# ---------------------------------------------------------------------------------------------
class _FakePlan:
    """What the door needs of a GeluFFNBackward (its token in the cache of validated calls, shape, device, graph,
    engine, owned outputs)."""

    graph, owned_outputs = False, None
    tokens, dim, hidden_dim, device = T, D, H, 0
    engine = types.SimpleNamespace(call_graph=False)

    def __init__(self):
        self.token = next(_backward_plan._tokens)

    def __call__(self, *args, out=None, stream=None, kind="backward"):
        request = _validate.Request(kind, "tf32")
        return _functional.run(request, args, out, stream, plan=self)


@pytest.fixture
def fake_gpu(monkeypatch):
    """The executor's GPU side on "device 0", no stream capturing, and the engine's part replaced by a record of the
    calls it would run (the list returned)."""
    from cupyffn.core import plans as _plans

    ran = []
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(_plans, "_stream_is_capturing", lambda ptr: False)
    monkeypatch.setattr(_execute, "_run_gpu", lambda call, *a, **k: ran.append(call))
    return ran


def test_a_repeated_call_validates_once_and_follows_each_time(fake_torch, fake_gpu, monkeypatch):
    validated = []
    real = _validate.validate
    monkeypatch.setattr(_validate, "validate", lambda *a, **k: validated.append(1) or real(*a, **k))
    plan = _FakePlan()
    args, out = tensors(), tensors(base=1 << 40, shapes=OUT_SHAPES)
    stream = Stream(OTHER_STREAM)
    plan(*args, out=out, stream=stream)
    for _ in range(3):
        plan(*args, out=out, stream=stream)
    first, calls = fake_gpu[0], fake_gpu[1:]
    assert len(validated) == 1  # the signature's cache hit skips validation
    assert len(fake_torch.waits) == 4  # but every call is ordered after torch's stream, once
    for call in calls:
        assert call.inputs == first.inputs and call.out == first.out and call.follow == 0
        assert call.arrays == tuple(args) and call.out_arrays == tuple(out)  # as given: no view built
    # torch's stream changed (torch.cuda.stream(...) around the call): the wait follows it
    fake_torch.torch_stream = 0x7100
    plan(*args, out=out, stream=stream)
    assert fake_torch.waits[-1] == (0x7100, OTHER_STREAM, 0) and len(validated) == 1
    # cupyffn's stream is torch's: nothing to wait for
    plan(*args, out=out, stream=Stream(0x7100))
    assert len(fake_torch.waits) == 5
    # new memory at one tensor, same configuration (a training step's new output): not validated again, the call
    # pointed at it
    moved = list(out)
    moved[0] = FakeTensor(out[0].ptr + (1 << 20), (T, D))
    plan(*args, out=moved, stream=stream)
    assert len(validated) == 1 and fake_gpu[-1].out[0] == first.out[0]._replace(ptr=moved[0].ptr)
    assert fake_gpu[-1].out[1:] == first.out[1:] and fake_gpu[-1].inputs == first.inputs
    # another configuration (strides): validated once
    strided = list(out)
    strided[0] = FakeTensor(out[0].ptr + (1 << 20), (T, D), (2 * D, 1))
    with pytest.raises(ValueError, match=r"^out\[0\] \(grad_hidden_states\) must be C-contiguous"):
        plan(*args, out=strided, stream=stream)
    assert len(validated) == 2
    # another plan of the same shape keeps its own entries (its route may differ: graph=True)
    _FakePlan()(*args, out=out, stream=stream)
    assert len(validated) == 3


def test_view2d_of_a_reused_call_reads_the_tensor(fake_torch):
    """call.arrays of a reused call are the caller's tensors; view2d (NaN fill after a failure, check_activations)
    views them by pointer."""
    a = FakeTensor(1 << 36, (T, D), (3 * D, 1))
    m = _arrays.Matrix(a.ptr, T, D, 3 * D)
    v = _arrays.view2d(a, m)
    assert isinstance(v, cupy.ndarray) and v.data.ptr == a.ptr
    assert v.shape == (T, D) and v.strides == (3 * D * 4, 4) and v.dtype == numpy.float32


def test_import_array_follows_per_tensor(fake_torch):
    """import_array itself (the float32 forward's path, cupyffn/f32/forward.py) reads torch tensors by pointer and follows torch's stream."""
    a = FakeTensor(1 << 36, (T, D))
    backend, view = _arrays.import_array(a, "hidden_states", Stream(OTHER_STREAM))
    assert backend == "gpu" and view.data.ptr == a.ptr and view.shape == (T, D)
    assert fake_torch.waits == [(TORCH_STREAM, OTHER_STREAM, 0)]


def test_import_array_leaves_the_wait_to_a_caller_that_collects_devices(fake_torch):
    devices = set()
    _arrays.import_array(FakeTensor(1 << 36, (T, D)), "hidden_states", Stream(OTHER_STREAM), devices)
    assert devices == {0} and fake_torch.waits == [] and fake_torch.stream_queries == 0


def test_the_forward_follows_torch_once_per_call(fake_torch, fake_gpu):
    """gelu_ffn_forward's call: three inputs and four outputs, all torch tensors, validated without a wait, one wait
    in the executor."""
    x, w1, w2 = tensors(shapes=((T, D), (H, D), (D, H)))
    outs = tensors(base=1 << 40, shapes=((T, D), (T, H), (T, H), (T, H)))
    call = _validate.validate(_validate.Request("forward"), (x, w1, w2, None, None), outs, Stream(OTHER_STREAM))
    assert call.backend == "gpu" and [a.data.ptr for a in call.out_arrays] == [o.ptr for o in outs]
    assert fake_torch.waits == [] and call.follow == 0
    _FakePlan()(x, w1, w2, None, None, out=outs, stream=Stream(OTHER_STREAM), kind="forward")
    assert fake_torch.waits == [(TORCH_STREAM, OTHER_STREAM, 0)] and fake_torch.stream_queries == 1
    assert len(fake_gpu) == 1 and fake_gpu[0].kind == "forward"


def test_the_forward_waits_for_nothing_when_its_arguments_are_refused(fake_torch):
    x, w1, w2 = tensors(shapes=((T, D), (H, D), (D, H)))
    bad = FakeTensor(1 << 40, (T, D + 1))
    with pytest.raises(ValueError, match=r"out\[0\] \(output\) must have shape"):
        _validate.validate(_validate.Request("forward"), (x, w1, w2, None, None), (bad, None, None, None),
                           Stream(OTHER_STREAM))
    assert fake_torch.waits == [] and fake_torch.stream_queries == 0


# ---------------------------------------------------------------------------------------------
# the wait itself (runtime calls recorded)
# ---------------------------------------------------------------------------------------------
class FakeRuntime:
    eventDisableTiming = 2

    def __init__(self, device=0):
        self.device, self.log = device, []

    def getDevice(self):
        return self.device

    def setDevice(self, d):
        self.log.append(("setDevice", d))
        self.device = d

    def eventCreateWithFlags(self, flags):
        self.log.append(("eventCreate", self.device, flags))
        return 0xE0 + self.device

    def eventRecord(self, event, stream):
        self.log.append(("record", event, stream, self.device))

    def streamWaitEvent(self, stream, event, flags):
        self.log.append(("wait", stream, event, self.device))


@pytest.fixture
def runtime(monkeypatch):
    from cupyffn.core import plans as _plans

    rt = FakeRuntime()
    capturing = set()
    monkeypatch.setattr(cupy.cuda, "runtime", rt)
    monkeypatch.setattr(_plans, "is_capturing", lambda ptr: ptr in capturing)
    monkeypatch.setattr(_arrays, "_wait_events", {})
    rt.capturing = capturing
    return rt


def test_wait_records_on_torch_and_waits_on_cupyffn(runtime):
    _arrays._wait(TORCH_STREAM, OTHER_STREAM, 0)
    _arrays._wait(TORCH_STREAM, OTHER_STREAM, 0)
    assert runtime.log == [("eventCreate", 0, 2), ("record", 0xE0, TORCH_STREAM, 0), ("wait", OTHER_STREAM, 0xE0, 0),
                           ("record", 0xE0, TORCH_STREAM, 0), ("wait", OTHER_STREAM, 0xE0, 0)]  # one event, reused


def test_wait_on_another_device_makes_it_current(runtime):
    _arrays._wait(0, OTHER_STREAM, 1)  # torch's legacy stream 0 is the current device's: device 1 made current
    assert runtime.log == [("setDevice", 1), ("eventCreate", 1, 2), ("record", 0xE1, 0, 1),
                           ("wait", OTHER_STREAM, 0xE1, 1), ("setDevice", 0)]
    assert runtime.device == 0


def test_wait_under_capture(runtime):
    runtime.capturing.add(OTHER_STREAM)  # only cupyffn's stream captures: an outside event cannot be waited on
    _arrays._wait(TORCH_STREAM, OTHER_STREAM, 0)
    assert runtime.log == []
    runtime.capturing.add(TORCH_STREAM)  # both (torch's capture, cupyffn joined): waited on, inside the capture
    _arrays._wait(TORCH_STREAM, OTHER_STREAM, 0)
    assert [e[0] for e in runtime.log] == ["eventCreate", "record", "wait"]
    runtime.log.clear()
    runtime.capturing.discard(OTHER_STREAM)  # torch's stream captures: the wait joins cupyffn's stream to it
    _arrays._wait(TORCH_STREAM, OTHER_STREAM, 0)
    assert [e[0] for e in runtime.log] == ["record", "wait"]


# ---------------------------------------------------------------------------------------------
# bench.py's host-time table (loop mode; GPU only): its plumbing, flags and markdown, on the CPU
# ---------------------------------------------------------------------------------------------
def test_host_only_implies_loop_only_and_is_refused_on_the_cpu(monkeypatch, capsys):
    import bench
    from benchmarks import gpu as G

    args = bench.parse_args(["--host-only"])
    assert args.host_only and args.loop_only
    monkeypatch.setattr(G, "gpu_or_reason", lambda: (None, "no GPU in this test"))
    assert bench.main(["--host-only", "--no-write"]) == 2
    err = capsys.readouterr().err
    assert "bench.py: --host-only:" in err and "bench.py: --loop-only:" in err and "refused" in err


def _fake_host_table(monkeypatch, rows):
    from benchmarks import layers, loop
    from cupyffn import workloads as W

    class FakeStream:
        ptr = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    fake_cupy = types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(synchronize=lambda: None),
                                   Stream=lambda non_blocking: FakeStream()),
        get_default_memory_pool=lambda: types.SimpleNamespace(free_all_blocks=lambda: None))
    monkeypatch.setattr(loop, "torch_or_none", lambda **k: None)
    monkeypatch.setattr(loop.W, "make_inputs", lambda lead, xp=None, seed=0: {
        n: numpy.zeros((4, 8), numpy.float32) for n in W.INPUT_NAMES})
    monkeypatch.setattr(layers, "host_impls", lambda args2d, stream, precision: {n: (None, None) for n in rows})
    timings = iter(range(1, 1000))
    monkeypatch.setattr(layers, "_host_us", lambda run, sync, calls: 10.0 * next(timings))
    return loop, fake_cupy, FakeStream()


def test_host_table_rows_ratios_and_markdown(monkeypatch, capsys):
    from benchmarks import layers, report

    loop, fake_cupy, stream = _fake_host_table(monkeypatch, list(layers.HOST_ROWS))
    args = types.SimpleNamespace(loop_calls=50, given=frozenset(), host_only=True)
    result = loop.run_loop(args, fake_cupy)
    host = result["host_per_call"]
    assert result["host_only"] and "calls_per_measurement" not in result  # not taken for a full loop run
    assert host["calls"] == loop.HOST_CALLS and host["precision"] == "tf32"
    assert [w["tokens"] for w in host["workloads"]] == [256, 256, 8192, 8192]  # the official T = 256 and 8192
    first = host["workloads"][0]
    assert list(first["host_us"]) == list(layers.HOST_ROWS)
    assert first["ratios"]["torch-functional-out / cupy-functional-out"] == 2.0  # 20 us / 10 us
    assert first["ratios"]["torch-layer-autograd / torch-eager-autograd"] == 50.0 / 60.0
    assert first["ratios"]["jax-functional / cupy-functional"] == 80.0 / 70.0
    out = capsys.readouterr().out
    assert "torch-functional-out / cupy-functional-out: worst" in out and "(target <= 1.3)" in out
    md = report.host_markdown(dict(result, device="NVIDIA H200"))
    assert md.startswith("# Host time per call, NVIDIA H200")
    assert "| torch-functional-out | 20.0 | 100.0 | 180.0 | 260.0 |" in md
    assert "| torch-layer-autograd / torch-eager-autograd | 0.83 |" in md
    # --loop-calls given: it sets the table's calls
    args = types.SimpleNamespace(loop_calls=30, given=frozenset({"loop_calls"}), host_only=True)
    assert loop.run_loop(args, fake_cupy)["host_per_call"]["calls"] == 30


def test_host_table_without_torch(monkeypatch):
    loop, fake_cupy, stream = _fake_host_table(monkeypatch, ["cupy-functional-out"])
    args = types.SimpleNamespace(loop_calls=50, given=frozenset(), host_only=True)
    host = loop.run_loop(args, fake_cupy)["host_per_call"]
    assert all(list(w["host_us"]) == ["cupy-functional-out"] and w["ratios"] == {} for w in host["workloads"])


def test_host_results_are_written_beside_the_loop_results(monkeypatch, tmp_path):
    from benchmarks import report

    monkeypatch.setattr(report, "RESULTS", tmp_path)
    host = {"precision": "tf32", "calls": 5, "method": "m", "rows": {"cupy-functional-out": "CuPy"},
            "targets": {}, "workloads": [{"label": "B2xS128", "tokens": 256, "host_us": {"cupy-functional-out": 70.0},
                                          "ratios": {}}]}
    report.write_results(None, {"date": "2030-01-01T00:00:00", "device": "NVIDIA H200", "host_only": True,
                                "host_per_call": host})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nvidia-h200-host.json", "nvidia-h200-host.md"]
    assert "| cupy-functional-out | 70.0 | CuPy |" in (tmp_path / "nvidia-h200-host.md").read_text()


def test_a_bias_on_another_gpu_is_named(fake_torch):
    x, w1, w2 = tensors(shapes=((T, D), (H, D), (D, H)))
    b2 = FakeTensor(1 << 40, (D,), (1,), device=1)
    with pytest.raises(ValueError, match=r"^all arrays must be on one device; bias2 is on cuda:1 but hidden_states is "
                                         r"on cuda:0"):
        _validate.validate(_validate.Request("forward"), (x, w1, w2, None, b2), None, Stream(TORCH_STREAM))


# ---------------------------------------------------------------------------------------------
# the door's call flow on the GPU route (issue 49; tests/door_trace.py), the engine's part replaced
# ---------------------------------------------------------------------------------------------
def test_the_gpu_door_enters_validate_route_execute_once(fake_torch, fake_gpu):
    from door_trace import trace

    plan = _FakePlan()
    args, out = tensors(), tensors(base=1 << 40, shapes=OUT_SHAPES)
    dy = args[0]

    def carries(obj):
        ptr = getattr(getattr(obj, "data", None), "ptr", None) if isinstance(obj, cupy.ndarray) else None
        return obj is dy or ptr == dy.ptr or getattr(obj, "ptr", None) == dy.ptr or (type(obj) is int and obj == dy.ptr)

    stream = Stream(OTHER_STREAM)
    for repeat in (False, True):
        _, files, entries, doubled, _ = trace(lambda: plan(*args, out=out, stream=stream), carries)
        assert entries["api/validate.py"] == 1 and entries["api/execute.py"] == 1, files
        assert entries["api/routes.py"] == (0 if repeat else 1), files  # the route is remembered with the call
        assert doubled <= 0.25 * len(files), files
    assert len(fake_gpu) == 2
