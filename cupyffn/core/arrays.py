"""Taking arrays in: NumPy, CuPy, or any DLPack / CUDA Array Interface producer, zero-copy.

Everything here is about what an argument *is* (backend, device, memory span, 2-D row-strided view);
what it must be is decided in cupyffn/api/validate.py.
"""

import contextlib
import sys
import threading
from typing import NamedTuple

import numpy

from . import views as _views

_DL_CPU = 1
_DL_CUDA = 2
_DL_CUDA_MANAGED = 13


def _cupy():
    import cupy

    return cupy


def import_array(obj, name, stream, torch_devices=None):
    """Return ("cpu", numpy array) or ("gpu", cupy array) for `obj`, without copying.

    GPU producers are imported on `stream` (a CuPy stream or None for the current one), so their
    pending work is ordered before anything cupyffn enqueues there (the DLPack stream handshake).
    A float32, bfloat16 or float16 CUDA torch tensor is read by pointer instead (`torch_view`, no DLPack import) and ordered
    by `follow_torch`: at once, or, where the caller passes a set as `torch_devices`, by the caller once per
    call after it has read every tensor (the tensor's device is added to the set). Other torch tensors
    (another dtype, the CPU, subclasses) keep DLPack, and with it its messages.
    """
    if isinstance(obj, numpy.ndarray):
        return "cpu", obj
    cls = type(obj)
    if cls.__name__ == "ndarray" and cls.__module__.startswith("cupy"):
        return "gpu", obj
    viewed = torch_view(obj)
    if viewed is not None:
        if torch_devices is None:
            follow_torch(viewed[0], stream)
        else:
            torch_devices.add(viewed[0])
        return "gpu", viewed[1]
    if hasattr(obj, "__dlpack_device__") and hasattr(obj, "__dlpack__"):
        if getattr(obj, "requires_grad", False) is True:  # torch refuses to export it (BufferError): say why here
            raise TypeError(f"{name} is a torch tensor that requires grad, which torch does not export zero-copy: pass "
                            f"{name}.detach() (cupyffn's functions record no autograd), or use the torch layer "
                            f"(cupyffn.torch.GeluFFN / cupyffn.torch.gelu_ffn), which does")
        try:
            device_type = int(obj.__dlpack_device__()[0])
        except Exception as e:  # a producer that cannot say where it lives
            raise TypeError(f"{name}: __dlpack_device__() failed ({e})") from e
        if device_type == _DL_CPU:
            return "cpu", _import_with(lambda: numpy.from_dlpack(obj), name)
        if device_type in (_DL_CUDA, _DL_CUDA_MANAGED):
            cupy = _cupy()
            with (stream if stream is not None else contextlib.nullcontext()):
                return "gpu", _import_with(lambda: cupy.from_dlpack(obj), name)
        raise TypeError(f"{name} lives on DLPack device type {device_type}; cupyffn takes CPU or CUDA arrays")
    if hasattr(obj, "__cuda_array_interface__"):
        cupy = _cupy()
        with (stream if stream is not None else contextlib.nullcontext()):
            return "gpu", _import_with(lambda: cupy.asarray(obj), name)
    raise TypeError(
        f"{name} must be a numpy.ndarray, a cupy.ndarray or an object with __dlpack__ or "
        f"__cuda_array_interface__ (torch.Tensor, jax.Array, ...); got {type(obj).__module__}.{type(obj).__name__}")



def _import_with(load, name):
    try:
        return load()
    except Exception as e:
        raise TypeError(f"{name} could not be imported zero-copy ({type(e).__name__}: {e}); "
                        f"cupyffn takes float32, bfloat16 and float16 arrays") from e


def device_of(array):
    """'cpu' or the CUDA device id of an array returned by import_array."""
    if isinstance(array, numpy.ndarray):
        return "cpu"
    return array.device.id


def data_ptr(array):
    if isinstance(array, numpy.ndarray):
        return array.__array_interface__["data"][0]
    return array.data.ptr


ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_name(obj):
    """'bfloat16', 'float16', 'float32', ... of an array or tensor of any framework (cheap; None without a dtype)."""
    d = getattr(obj, "dtype", None)
    if d is None:
        return None
    name = getattr(d, "name", None)
    return name if isinstance(name, str) else str(d).rpartition(".")[2]


class Matrix(NamedTuple):
    """Geometry of a [rows, cols] row-major view of `dtype` elements: element (r, c) at ptr + itemsize (r ld + c)."""

    ptr: int
    rows: int
    cols: int
    ld: int
    dtype: str = "float32"

    @property
    def itemsize(self):
        return ITEMSIZE[self.dtype]

    @property
    def span(self):
        """[begin, end) bytes this view can touch (for aliasing checks)."""
        if self.rows == 0 or self.cols == 0:
            return (self.ptr, self.ptr)
        return (self.ptr, self.ptr + self.itemsize * ((self.rows - 1) * self.ld + self.cols))

    def overlaps(self, other):
        (a0, a1), (b0, b1) = self.span, other.span
        return a0 < b1 and b0 < a1


def view2d(array, m):
    """`array`'s memory as the 2-D [m.rows, m.cols] array (row stride m.ld) that `m` describes; no copy.

    `array`: what import_array returned, or the caller's own object where a validated call was reused
    (a torch tensor there: viewed by pointer, ``m.ptr`` being its data pointer)."""
    if isinstance(array, numpy.ndarray):
        strided = numpy.lib.stride_tricks.as_strided
    elif type(array) in (_torch_types or ()):
        return _views.typed_view(m.ptr, (m.rows, m.cols), (m.ld, 1), array.get_device(), m.dtype)
    else:
        strided = _cupy().lib.stride_tricks.as_strided
    return strided(array, (m.rows, m.cols), (m.itemsize * m.ld, m.itemsize))


def row_stride(shape, strides, itemsize):
    """Row stride (elements) of `shape`/`strides` seen as [prod(shape[:-1]), shape[-1]], or None.

    The last dimension must be unit-stride and the leading dimensions must flatten to one stride
    that does not make rows overlap.
    """
    cols = shape[-1]
    if cols > 1 and strides[-1] != itemsize:
        return None
    # Merge the leading dimensions from the innermost outwards; size-1 dimensions do not matter.
    ld = None
    span = None  # elements covered by the dimensions merged so far
    for size, stride in zip(reversed(shape[:-1]), reversed(strides[:-1])):
        if size == 1:
            continue
        if stride % itemsize:
            return None
        stride //= itemsize
        if ld is None:
            if stride < cols:
                return None
            ld, span = stride, stride * size
        elif stride != span:
            return None
        else:
            span *= size
    return cols if ld is None else ld


# ---------------------------------------------------------------------- torch tensors read by pointer
# A float32 CUDA torch.Tensor (or nn.Parameter: exact types, so subclasses such as FakeTensor or tensor
# subclasses with __torch_function__ keep the DLPack path) is read from its attributes: data_ptr(), shape,
# stride(), get_device(), giving a cached CuPy view (cupyffn/core/views.py) instead of a cupy.from_dlpack import per
# tensor, and a signature (cupyffn/api/validate.py) so that repeated tensors skip validation. torch is detected by
# looking it up in sys.modules, never imported here.
_torch_types = None  # frozenset of the exact types, once torch is imported
_torch_f32 = None  # torch.float32 (dtypes are singletons: compared with `is`)
_torch_16 = {}  # torch.bfloat16 / torch.float16 -> dtype name (the cuBLASLt engine, cupyffn/lt/engine.py)
_torch_stream = None  # device index -> torch's current raw stream on it


def torch_types():
    """The torch tensor types read by pointer: frozenset({torch.Tensor, torch.nn.Parameter}); empty while
    torch is not (or not yet completely) imported."""
    global _torch_types, _torch_f32, _torch_stream, _torch_16
    if _torch_types is not None:
        return _torch_types
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    parameter = getattr(getattr(torch, "nn", None), "Parameter", None)
    f32 = getattr(torch, "float32", None)
    if tensor is None or parameter is None or f32 is None:
        return frozenset()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what inductor's generated code calls
    if raw is None:  # pragma: no cover - a torch without it: the public spelling
        def raw(index):
            return torch.cuda.current_stream(index).cuda_stream
    _torch_f32, _torch_stream = f32, raw
    _torch_16 = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
    _torch_types = frozenset((tensor, parameter))
    return _torch_types


def seen_torch_types():
    """torch's tensor types once `torch_types` has looked them up (import_array meets torch imported), else None."""
    return _torch_types


def torch_view(obj):
    """(device id, CuPy view) of a float32, bfloat16 or float16 CUDA torch tensor, read from its data_ptr(), shape,
    stride() and get_device() (the view cached by cupyffn/core/views.py; it owns nothing, the caller keeps `obj` alive
    while it uses it); None for anything else (other dtypes, CPU tensors, subclasses: DLPack's business)."""
    cls = type(obj)
    if cls in (_torch_types or torch_types()) and obj.is_cuda:
        if obj.dtype is _torch_f32:
            device = obj.get_device()
            return device, _views.float32_view(obj.data_ptr(), obj.shape, obj.stride(), device)
        name = _torch_16.get(obj.dtype)
        if name is not None:
            device = obj.get_device()
            return device, _views.typed_view(obj.data_ptr(), obj.shape, obj.stride(), device, name)
    return None


def follow_torch(device_id, stream, capturing=None):
    """Order what cupyffn enqueues next on `stream` (a CuPy stream; None: CuPy's current stream of `device_id`)
    after the work torch has queued on its current stream of `device_id` (what DLPack's stream handshake,
    ``tensor.__dlpack__(stream=...)``, did for every tensor; here once per call).

    The two streams are compared by raw pointer: when they are the same stream (a caller passing torch's stream,
    or both on CUDA's legacy default stream), stream order already holds and nothing is done: two queries.
    Otherwise one event, reused, is recorded on torch's stream and `stream` waits on it (cudaEventRecord +
    cudaStreamWaitEvent, under a lock so that concurrent calls do not interleave record and wait): a
    device-side dependency, the host is never synchronized.

    Under CUDA stream capture: when torch's stream captures, the wait brings `stream` into that capture (as the
    handshake did). When only `stream` captures, an event recorded outside the capture cannot be waited on
    inside it (CUDA refuses), so nothing is done: ordering the graph's replays after torch's work is the
    caller's business, as it is for eager calls of the same plan. `capturing`: whether `stream` captures, where the
    caller knows (None: asked here).
    """
    tptr = _torch_stream(device_id)
    cptr = stream.ptr if stream is not None else _cupy().cuda.get_current_stream(device_id).ptr
    if tptr != cptr:
        _wait(tptr, cptr, device_id, capturing)


_wait_lock = threading.Lock()
_wait_events = {}  # device id -> raw CUDA event (timing disabled), created once, never destroyed


def _wait(producer_ptr, consumer_ptr, device_id, consumer_capturing=None):
    """`consumer_ptr` waits, on the device, for what `producer_ptr` has queued so far (follow_torch)."""
    from .plans import is_capturing

    if consumer_capturing is None:
        consumer_capturing = is_capturing(consumer_ptr)
    if consumer_capturing and not is_capturing(producer_ptr):
        return
    runtime = _cupy().cuda.runtime
    previous = runtime.getDevice()
    if previous != device_id:  # stream 0 (legacy) means the current device's: make it the tensors'
        runtime.setDevice(device_id)
    try:
        with _wait_lock:
            event = _wait_events.get(device_id)
            if event is None:
                event = _wait_events[device_id] = runtime.eventCreateWithFlags(runtime.eventDisableTiming)
            runtime.eventRecord(event, producer_ptr)
            runtime.streamWaitEvent(consumer_ptr, event, 0)
    finally:
        if previous != device_id:
            runtime.setDevice(previous)
