"""The engine of a call with no tokens (T = 0, either backend): the weight and bias gradients zero-filled (kept when
accumulating), grad_hidden_ready recorded at once. `fill` also NaN-fills out= after a failure (the executor)."""

import math

import numpy

from ..core import arrays as _arrays
from ..core.views import external_stream

_NAN16 = {"bfloat16": 0x7FC0, "float16": 0x7E00}


class NoTokens:

    def bind(self, call, outputs):
        self._call, self._arrays = call, outputs.arrays

    def enqueue(self, stream_ptr=None, serial=False, ready=0):
        call = self._call
        if call.kind == "backward" and not call.request.accumulate:
            for a in self._arrays[1:]:
                if a is None:
                    continue
                if call.backend == "cpu":
                    a[...] = 0
                else:
                    fill(_as_array(a), external_stream(stream_ptr, call.device), 0)
        if ready:
            import cupy

            cupy.cuda.runtime.eventRecord(ready, stream_ptr)


def _as_array(a):
    """A CuPy view of a torch tensor given as out= (a remembered call keeps the caller's objects), else `a`."""
    if type(a) in (_arrays.seen_torch_types() or ()):
        return _arrays.view2d(a, _arrays.Matrix(a.data_ptr(), math.prod(a.shape[:-1]), a.shape[-1], a.shape[-1],
                                                _arrays.dtype_name(a)))
    return a


def fill(array, stream, value):
    """`array` (a CuPy array) filled with `value` on `stream`; NaN in a 16-bit dtype as its bit pattern."""
    with stream:
        name = _arrays.dtype_name(array)
        if value != value and name in _NAN16:  # NaN in a 16-bit dtype CuPy may not fill: its bit pattern
            array.view(numpy.uint16).fill(_NAN16[name])
        else:
            array.fill(value)
