"""Taking arrays in: NumPy, CuPy, or any DLPack / CUDA Array Interface producer, zero-copy.

Everything here is about what an argument *is* (backend, device, memory span, 2-D row-strided view);
what it must be is decided in _validate.py.
"""

import contextlib
from typing import NamedTuple

import numpy

_DL_CPU = 1
_DL_CUDA = 2
_DL_CUDA_MANAGED = 13


def _cupy():
    import cupy

    return cupy


def import_array(obj, name, stream):
    """Return ("cpu", numpy array) or ("gpu", cupy array) for `obj`, without copying.

    GPU producers are imported on `stream` (a CuPy stream or None for the current one), so their
    pending work is ordered before anything cupyffn enqueues there (the DLPack stream handshake).
    """
    if isinstance(obj, numpy.ndarray):
        return "cpu", obj
    module = type(obj).__module__
    if module.startswith("cupy") and type(obj).__name__ == "ndarray":
        return "gpu", obj
    if hasattr(obj, "__dlpack_device__") and hasattr(obj, "__dlpack__"):
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
                        f"cupyffn takes float32 arrays") from e


def device_of(array):
    """'cpu' or the CUDA device id of an array returned by import_array."""
    if isinstance(array, numpy.ndarray):
        return "cpu"
    return array.device.id


def data_ptr(array):
    if isinstance(array, numpy.ndarray):
        return array.__array_interface__["data"][0]
    return array.data.ptr


class Matrix(NamedTuple):
    """Geometry of a [rows, cols] row-major float32 view: element (r, c) is at ptr + 4 * (r * ld + c)."""

    ptr: int
    rows: int
    cols: int
    ld: int

    @property
    def span(self):
        """[begin, end) bytes this view can touch (for aliasing checks)."""
        if self.rows == 0 or self.cols == 0:
            return (self.ptr, self.ptr)
        return (self.ptr, self.ptr + 4 * ((self.rows - 1) * self.ld + self.cols))


def view2d(array, m):
    """`array`'s memory as the 2-D [m.rows, m.cols] array (row stride m.ld) that `m` describes; no copy."""
    if isinstance(array, numpy.ndarray):
        strided = numpy.lib.stride_tricks.as_strided
    else:
        strided = _cupy().lib.stride_tricks.as_strided
    return strided(array, (m.rows, m.cols), (4 * m.ld, 4))


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
