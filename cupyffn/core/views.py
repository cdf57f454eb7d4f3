"""CuPy views over raw device pointers and streams, for the framework layers (cupyffn.torch, cupyffn.jax) and for
float32 CUDA torch tensors given to the functional API (cupyffn/core/arrays.py ``torch_view``); NumPy views of CPU
torch tensors (``numpy_view``, the torch layer on the CPU).

A framework tensor reaches cupyffn as a ``cupy.ndarray`` built from its pointer, shape and strides:
no DLPack import (whose stream handshake is empty in the layers, since they run cupyffn on the stream the
framework itself uses; the functional API makes its one ordering per call instead, ``arrays.follow_torch``)
and, for a repeated tensor, cupyffn's validated-call fast path.

Views are cached by (pointer, shape, strides, device). A view is a pure function of that key and owns
nothing (``UnownedMemory`` with no owner), so when the framework frees a tensor and reuses its address
for one of the same geometry, the cached view describes the new tensor exactly. The caller keeps the
tensor itself alive for as long as it uses the view (the length of one cupyffn call); a view is never
handed out of cupyffn (results are the caller's out= objects, or arrays cupyffn allocated).
"""

_views = {}
_MAX = 256


def float32_view(ptr, shape, strides, device_id):
    """A float32 ``cupy.ndarray`` at device address `ptr`; `strides` in elements; owns nothing (see above).

    `shape` and `strides`: tuples, or tuple subclasses that hash and compare as tuples (``torch.Size``).
    """
    return typed_view(ptr, shape, strides, device_id, "float32")


def numpy_dtype(name):
    """The NumPy dtype CuPy uses for `name` ("float32", "float16", "bfloat16": ml_dtypes' type, which CuPy >= 14
    takes as its bfloat16; ImportError saying so when ml_dtypes is missing)."""
    import numpy

    if name != "bfloat16":
        return numpy.dtype(name)
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError("bfloat16 arrays need ml_dtypes (pip install 'cupyffn[bf16]'): CuPy represents bfloat16 "
                          "through it") from None
    return numpy.dtype(ml_dtypes.bfloat16)


def numpy_view(tensor):
    """A NumPy view of CPU torch `tensor` (bfloat16 through ml_dtypes' type, which NumPy lacks), None for None."""
    if tensor is None:
        return None
    import torch  # a torch tensor exists: torch is imported

    if tensor.dtype is torch.bfloat16:
        return tensor.detach().view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return tensor.detach().numpy()


def typed_view(ptr, shape, strides, device_id, dtype):
    """A ``cupy.ndarray`` of dtype name `dtype` at device address `ptr` (as float32_view)."""
    key = (ptr, shape, strides, device_id, dtype)
    view = _views.get(key)
    if view is not None:
        return view
    import cupy

    shape, strides = tuple(shape), tuple(strides)
    np_dtype = numpy_dtype(dtype)
    size = np_dtype.itemsize
    if any(n == 0 for n in shape):
        with cupy.cuda.Device(device_id):  # no memory to point at; nothing is read or written
            view = cupy.empty(shape, dtype=np_dtype)
    else:
        extent = size * (1 + sum((n - 1) * s for n, s in zip(shape, strides)))
        memory = cupy.cuda.UnownedMemory(ptr, extent, None, device_id)
        view = cupy.ndarray(shape, np_dtype, cupy.cuda.MemoryPointer(memory, 0),
                            strides=tuple(size * s for s in strides))
    if len(_views) >= _MAX:
        _views.clear()
    _views[key] = view
    return view


def clear():
    _views.clear()


class _StreamHandle:
    """A raw CUDA stream pointer behind the CUDA stream protocol (for ``cupy.cuda.Stream.from_external``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


# (raw stream pointer, device id) -> CuPy stream object. The object is only a (pointer, device) pair that
# owns nothing, so a pointer the framework reuses for a new stream maps to an equivalent object.
_streams = {}


def external_stream(ptr, device_id):
    """A CuPy stream object for the framework's raw stream `ptr` on `device_id`; it does not own (or destroy) it.

    CuPy >= 14: ``cupy.cuda.Stream.from_external``; older CuPy: ``cupy.cuda.ExternalStream`` (deprecated in 14).
    Call with `device_id` current in CuPy: the stream belongs to it.
    """
    key = (ptr, device_id)
    stream = _streams.get(key)
    if stream is None:
        import cupy

        from_external = getattr(cupy.cuda.Stream, "from_external", None)
        if from_external is not None:
            stream = from_external(_StreamHandle(ptr))
        else:
            stream = cupy.cuda.ExternalStream(ptr, device_id)
        if len(_streams) >= 64:
            _streams.clear()
        _streams[key] = stream
    return stream
