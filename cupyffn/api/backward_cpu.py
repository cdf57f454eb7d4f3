"""The CPU route of a backward call (NumPy arrays): the outputs allocated or taken from `out=`, then
`cupyffn._numpy_backend.backward` (the GPU's operand rounding, on the CPU); NaN in `out=` after a failure."""

import numpy

from ..core import arrays as _arrays
from ..cpu import backend as _numpy_backend
from . import validate as _validate


def run(call, out, precision, need_grad_hidden, need_weight_grads, accumulate, need_bias_grads=False):
    shapes = _validate.output_shapes(call.lead_shape, call.dim, call.hidden_dim)
    needed = _validate.needed_outputs(need_grad_hidden, need_weight_grads, need_bias_grads)
    results, views = [], []
    for i, (shape, need) in enumerate(zip(shapes, needed)):
        if not need:
            results.append(None)
            views.append(None)
        elif call.out[i] is not None:
            results.append(out[i])
            views.append(_arrays.view2d(call.out_arrays[i], call.out[i]))
        else:
            array = numpy.empty(shape, dtype=numpy.float32)
            results.append(array)
            views.append(array.reshape(-1, shape[-1]))
    if call.tokens == 0:
        for v in views[1:]:
            if v is not None and not accumulate:
                v[...] = 0
        return results
    try:
        _numpy_backend.backward(call, precision, need_grad_hidden, need_weight_grads, accumulate, views)
    except BaseException:
        for v, m in zip(views, call.out):
            if m is not None:
                v[...] = numpy.nan  # as on the GPU: never leave partial results in the caller's arrays
        raise
    return results
