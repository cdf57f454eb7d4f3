"""A GPU route without a GPU (issue 59, item 9): the door (validate, route, execute), the route table, the plan caches,
the graph cache and the engines' shared base (cupyffn/cuda/stream_engine.py) run for real; what would reach the
device is stubbed: the CUDA runtime's device, event and stream calls, the capture query, the captured graphs
(cupyffn/cuda/call_graph.py), torch's current stream and the engines' own device work (their construction, bind and
launches: each engine class the route table builds is replaced by a `RecordingEngine`, which notes what the
executor asks of it). Arrays are torch tensors (`FakeTensor`, read by pointer as real CUDA tensors are) or CuPy
views at made-up addresses, which nothing reads or writes.

`install(monkeypatch)` puts the stubs in place and returns the `FakeGpu` whose `engines` lists every engine built;
tests/test_door_gpu_route.py uses it.
"""

import itertools
import types

import cupy

from cupyffn.api import execute as _execute
from cupyffn.api import validate as _validate
from cupyffn.core import arrays as _arrays
from cupyffn.core import plans as _plans
from cupyffn.core import views as _views
from cupyffn.cuda import graph_cache as _graph_cache
from cupyffn.cuda.stream_engine import StreamEngine

TORCH_STREAM = 0x7000


class FakeDtype:
    """A torch dtype as cupyffn reads it (compared with `is`, named by `.name`)."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"torch.{self.name}"


F32, BF16, F16 = FakeDtype("float32"), FakeDtype("bfloat16"), FakeDtype("float16")


class FakeTensor:
    """What cupyffn reads of a CUDA torch tensor: data_ptr(), shape, stride() (elements), dtype, is_cuda,
    get_device()."""

    def __init__(self, ptr, shape, stride=None, dtype=F32, device=0):
        self.ptr, self.shape, self.dtype, self.device = ptr, tuple(shape), dtype, device
        self.is_cuda = True
        self._stride = tuple(stride) if stride is not None else tuple(
            int(__import__("math").prod(self.shape[i + 1:])) for i in range(len(self.shape)))

    def data_ptr(self):
        return self.ptr

    def stride(self):
        return self._stride

    def get_device(self):
        return self.device


_addresses = itertools.count(1)


def fresh(shapes, dtype=F32, device=0, as_cupy=False):
    """Arrays of `shapes` at addresses no other call of the test used (1 GiB apart: nothing overlaps), as
    FakeTensors or as CuPy views."""
    out = []
    for s in shapes:
        if s is None:
            out.append(None)
            continue
        ptr = next(_addresses) << 30
        t = FakeTensor(ptr, s, dtype=dtype, device=device)
        out.append(_views.typed_view(ptr, t.shape, t.stride(), device, dtype.name) if as_cupy else t)
    return out


class FakeStream:
    _ptrs = itertools.count(0x100, 0x100)

    def __init__(self, ptr=None, non_blocking=False):
        self.ptr = next(self._ptrs) if ptr is None else ptr

    @classmethod
    def from_external(cls, handle):
        return cls(handle.__cuda_stream__()[1])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeEvent:
    _ptrs = itertools.count(0xE000, 0x10)

    def __init__(self, disable_timing=False):
        self.ptr = next(self._ptrs)


class FakeDevice:
    def __init__(self, device_id=0):
        self.id = device_id

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeRuntime:
    """The CUDA runtime calls the door and the engines' base make: recorded in `log`."""

    eventDisableTiming = 2

    def __init__(self):
        self.log = []

    def getDevice(self):
        return 0

    def getDeviceCount(self):
        return 1

    def setDevice(self, device):
        self.log.append(("setDevice", device))

    def eventCreateWithFlags(self, flags):
        return 0xEF00

    def eventRecord(self, event, stream):
        self.log.append(("record", event, stream))

    def streamWaitEvent(self, stream, event, flags):
        self.log.append(("wait", stream, event))

    def eventSynchronize(self, event):
        self.log.append(("synchronize", event))


class FakeCallGraph:
    """A captured graph: capture() issues the call once (as captured), launch() notes the launch."""

    log = None  # set by install: the FakeGpu's log

    def capture(self, issue, stream_ptr, upload_stream_ptr=None):
        FakeCallGraph.log.append(("capture", stream_ptr))
        issue(stream_ptr)

    def launch(self, stream_ptr):
        FakeCallGraph.log.append(("graph launch", stream_ptr))

    def destroy(self):
        pass


class RecordingEngine(StreamEngine):
    """An engine as the executor sees it (cupyffn/cuda/stream_engine.py's protocol), its own device work replaced by
    notes in `log`: built with the real engine class's arguments, which it keeps in `built_with`."""

    call_graph = False  # GpuEngine: eager calls as one re-pointed call graph launch

    def __init__(self, gpu, name, args, kwargs):
        key = args[0] if len(args) == 1 else None
        StreamEngine.__init__(self, key.device if key is not None else args[4])
        self.name, self.built_with, self.log = name, (args, kwargs), []
        self.key = key
        self.plan = types.SimpleNamespace(call_graph=self.call_graph)
        self.side = FakeStream() if name in ("GpuEngine", "LtBackward") else None
        gpu.engines.append(self)

    def io_key(self, call, outputs):
        return call.inputs, outputs.pointers, bool(call.request.accumulate)

    def bind(self, call, outputs):
        self.log.append(("bind", tuple(m and m.ptr for m in call.inputs), outputs.pointers))

    def enqueue(self, stream_ptr, serial=False, ready=0):
        self.log.append(("enqueue", stream_ptr, serial))

    def eager(self, stream_ptr, ready=0):
        if self.call_graph and not ready:
            self.log.append(("call graph", stream_ptr))
        else:
            self.enqueue(stream_ptr)

    def _release(self):
        self.log.append(("released",))


class FakeGpu:
    def __init__(self):
        self.engines = []
        self.log = []  # captures and graph launches
        self.runtime = FakeRuntime()
        self.torch_waits = []


def _engine_class(gpu, name, call_graph=False):
    def build(*args, **kwargs):
        engine = type(name, (RecordingEngine,), {"call_graph": call_graph})
        return engine(gpu, name, args, kwargs)

    return build


def install(monkeypatch):
    """Stub the device (module docstring); returns the FakeGpu. The remembered calls and cached engines are dropped
    before and after (cupyffn.clear_cache), so no other test's call is taken for this one's."""
    import cupy_backends.cuda.api as _api

    from cupyffn.f32 import engine as _f32_engine
    from cupyffn.f32 import forward as _f32_forward
    from cupyffn.f32 import plan as _f32_plan
    from cupyffn.lt import engine as _lt_engine

    gpu = FakeGpu()
    _validate.forget()
    _execute.clear_engines()
    monkeypatch.setattr(cupy.cuda, "runtime", gpu.runtime)
    monkeypatch.setattr(_api, "runtime", gpu.runtime)
    monkeypatch.setattr(cupy.cuda, "Device", FakeDevice)
    monkeypatch.setattr(cupy.cuda, "Event", FakeEvent)
    monkeypatch.setattr(cupy.cuda, "Stream", FakeStream)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda device_id=-1: FakeStream(0x5000))
    monkeypatch.setattr(_views, "_streams", {})
    monkeypatch.setattr(_plans, "_stream_is_capturing", lambda ptr: False)
    FakeCallGraph.log = gpu.log
    monkeypatch.setattr(_graph_cache, "CallGraph", FakeCallGraph)
    monkeypatch.setattr(_graph_cache, "_capture_streams", {})
    # torch: FakeTensor is the type read by pointer; its current stream TORCH_STREAM; the wait on it recorded
    monkeypatch.setattr(_arrays, "_torch_types", frozenset({FakeTensor}))
    monkeypatch.setattr(_arrays, "_torch_f32", F32)
    monkeypatch.setattr(_arrays, "_torch_16", {BF16: "bfloat16", F16: "float16"})
    monkeypatch.setattr(_arrays, "_torch_stream", lambda device: TORCH_STREAM)
    monkeypatch.setattr(_arrays, "_wait", lambda producer, consumer, device, capturing=None: gpu.torch_waits.append(
        (producer, consumer, device)))
    monkeypatch.setattr(_validate, "_cupy_ndarray", cupy.ndarray)
    # the engines: the float32 backward's runs a call graph where its plan's measured window says so (the route's
    # graph column is decided from the same window)
    monkeypatch.setattr(_f32_engine, "GpuEngine", lambda *a, **k: _engine_class(
        gpu, "GpuEngine", _f32_plan.call_graph_wanted(a[3], a[0]))(*a, **k))
    monkeypatch.setattr(_f32_forward, "GpuForward", _engine_class(gpu, "GpuForward"))
    monkeypatch.setattr(_lt_engine, "LtForward", _engine_class(gpu, "LtForward"))
    monkeypatch.setattr(_lt_engine, "LtBackward", _engine_class(gpu, "LtBackward"))
    return gpu


def uninstall():
    """What install's callers run at the end (before monkeypatch undoes the stubs): the engines closed, the calls
    forgotten."""
    _validate.forget()
    _execute.clear_engines()
