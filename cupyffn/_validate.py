"""Argument checking for the backward pass: every error names the argument and what was expected.

`prepare()` turns the seven inputs (and `out`) into a `Call`: the backend, device, sizes and 2-D
row-strided views the engines work on. Nothing is written and nothing is launched here, so a bad
call leaves every array untouched.
"""

from typing import Any, NamedTuple, Optional, Tuple

import numpy

from . import _arrays

INPUT_NAMES = ("grad_output", "hidden_states", "weight1", "weight2", "linear1_out", "tanh_inner", "gelu_out")
OUTPUT_NAMES = ("grad_hidden_states", "grad_weight1", "grad_weight2")


class Call(NamedTuple):
    backend: str                 # "cpu" or "gpu"
    device: Any                  # "cpu" or CUDA device id
    tokens: int                  # T, product of the leading dimensions
    dim: int                     # D
    hidden_dim: int              # H
    lead_shape: Tuple[int, ...]  # leading dimensions of the activations
    inputs: Tuple[_arrays.Matrix, ...]           # in INPUT_NAMES order
    out: Tuple[Optional[_arrays.Matrix], ...]    # in OUTPUT_NAMES order; None where not given


def _name_of(array):
    return type(array).__module__.split(".")[0] + "." + type(array).__name__


def _matrix(array, name):
    """2-D row-strided view of `array` ([..., C] -> [prod(...), C]) or a ValueError saying why not."""
    shape = tuple(array.shape)
    itemsize = array.dtype.itemsize
    rows = int(numpy.prod(shape[:-1], dtype=numpy.int64))
    cols = shape[-1]
    if rows == 0 or cols == 0:
        ld = cols
    else:
        ld = _arrays.row_stride(shape, tuple(array.strides), itemsize)
        if ld is None:
            raise ValueError(
                f"{name} has strides {tuple(array.strides)} (bytes) for shape {shape}: cupyffn reads arrays "
                f"whose last dimension is contiguous and whose leading dimensions flatten to one row stride "
                f"(any C-contiguous array, or a slice of rows or columns of one). Pass "
                f"ascontiguousarray({name}) instead")
    return _arrays.Matrix(array, _arrays.data_ptr(array), rows, cols, ld)


def _overlaps(a, b):
    (a0, a1), (b0, b1) = a.span, b.span
    return a0 < b1 and b0 < a1


def prepare(args, out=None, stream=None, need_grad_hidden=True, need_weight_grads=True, accumulate=False):
    """Check the seven inputs (INPUT_NAMES order) and `out`; return a Call."""
    if not need_grad_hidden and not need_weight_grads:
        raise ValueError("need_grad_hidden and need_weight_grads are both False: there is nothing to compute")
    if stream is not None and not hasattr(stream, "ptr"):
        raise TypeError(f"stream must be a cupy.cuda.Stream (or ExternalStream) or None; got {type(stream).__name__}")

    imported = [_arrays.import_array(a, n, stream) for a, n in zip(args, INPUT_NAMES)]
    backends = {b for b, _ in imported}
    if len(backends) > 1:
        cpu = next(n for (b, _), n in zip(imported, INPUT_NAMES) if b == "cpu")
        gpu = next(n for (b, _), n in zip(imported, INPUT_NAMES) if b == "gpu")
        raise ValueError(f"cannot mix NumPy (CPU) and GPU arrays: {cpu} is on the CPU but {gpu} is on a GPU")
    backend = backends.pop()
    if backend == "cpu" and stream is not None:
        raise ValueError("stream= is for GPU arrays; these inputs are NumPy (CPU) arrays")
    arrays = [a for _, a in imported]

    for a, n in zip(arrays, INPUT_NAMES):
        if a.dtype != numpy.float32:
            raise TypeError(f"{n} must be float32; got {a.dtype}")

    devices = [_arrays.device_of(a) for a in arrays]
    if len(set(devices)) > 1:
        where = ", ".join(f"{n} on {'cuda:%s' % d if d != 'cpu' else 'cpu'}" for n, d in zip(INPUT_NAMES, devices))
        raise ValueError(f"all arrays must be on one device; got {where}")

    grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner, gelu_out = arrays
    if grad_output.ndim < 1 or grad_output.shape[-1] < 1:
        raise ValueError(f"grad_output must have shape [..., dim] with dim >= 1; got {tuple(grad_output.shape)}")
    dim = grad_output.shape[-1]
    lead = tuple(grad_output.shape[:-1])
    if tuple(hidden_states.shape) != tuple(grad_output.shape):
        raise ValueError(f"hidden_states must have the shape of grad_output {tuple(grad_output.shape)}; "
                         f"got {tuple(hidden_states.shape)}")
    if weight1.ndim != 2 or weight1.shape[1] != dim or weight1.shape[0] < 1:
        raise ValueError(f"weight1 must have shape (hidden_dim, dim) with dim = grad_output.shape[-1] = {dim} "
                         f"and hidden_dim >= 1; got {tuple(weight1.shape)}")
    hidden_dim = weight1.shape[0]
    if tuple(weight2.shape) != (dim, hidden_dim):
        raise ValueError(f"weight2 must have shape (dim, hidden_dim) = {(dim, hidden_dim)} to match "
                         f"grad_output {tuple(grad_output.shape)} and weight1 {tuple(weight1.shape)}; "
                         f"got {tuple(weight2.shape)}")
    act_shape = lead + (hidden_dim,)
    for a, n in ((linear1_out, "linear1_out"), (tanh_inner, "tanh_inner"), (gelu_out, "gelu_out")):
        if tuple(a.shape) != act_shape:
            raise ValueError(f"{n} must have shape {act_shape} (grad_output's leading dimensions "
                             f"{lead} + hidden_dim {hidden_dim} from weight1 {tuple(weight1.shape)}); "
                             f"got {tuple(a.shape)}")

    inputs = tuple(_matrix(a, n) for a, n in zip(arrays, INPUT_NAMES))
    outs = _prepare_out(out, backend, devices[0], stream, inputs, grad_output.shape,
                        need_grad_hidden, need_weight_grads, accumulate)
    tokens = inputs[0].rows
    return Call(backend, devices[0], tokens, dim, hidden_dim, lead, inputs, outs)


def _prepare_out(out, backend, device, stream, inputs, grad_hidden_shape, need_grad_hidden,
                 need_weight_grads, accumulate):
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True adds into existing gradients: pass "
                             "out=(grad_hidden_states or None, grad_weight1, grad_weight2)")
        return (None, None, None)
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise TypeError("out must be a sequence of three arrays (grad_hidden_states, grad_weight1, grad_weight2); "
                        "an entry may be None to have cupyffn allocate it")
    expected = {"grad_hidden_states": tuple(grad_hidden_shape), "grad_weight1": tuple(inputs[2].array.shape),
                "grad_weight2": tuple(inputs[3].array.shape)}
    needed = {"grad_hidden_states": need_grad_hidden, "grad_weight1": need_weight_grads,
              "grad_weight2": need_weight_grads}
    result = []
    for obj, name in zip(out, OUTPUT_NAMES):
        label = f"out[{OUTPUT_NAMES.index(name)}] ({name})"
        if obj is None:
            if accumulate and name != "grad_hidden_states" and needed[name]:
                raise ValueError(f"accumulate=True needs {label}: the gradient to add into")
            result.append(None)
            continue
        if not needed[name]:
            raise ValueError(f"{label} was given but is not computed (need_grad_hidden / need_weight_grads is False)")
        b, a = _arrays.import_array(obj, label, stream)
        if b != backend:
            where = "NumPy (CPU)" if b == "cpu" else "GPU"
            raise ValueError(f"{label} is a {where} array but the inputs are "
                             f"{'NumPy (CPU)' if backend == 'cpu' else 'GPU'} arrays")
        if _arrays.device_of(a) != device:
            raise ValueError(f"{label} is on cuda:{_arrays.device_of(a)} but the inputs are on cuda:{device}")
        if a.dtype != numpy.float32:
            raise TypeError(f"{label} must be float32; got {a.dtype}")
        if tuple(a.shape) != expected[name]:
            raise ValueError(f"{label} must have shape {expected[name]}; got {tuple(a.shape)}")
        if not a.flags.c_contiguous:
            raise ValueError(f"{label} must be C-contiguous; got strides {tuple(a.strides)} for shape {tuple(a.shape)}")
        m = _matrix(a, label)
        for inp, iname in zip(inputs, INPUT_NAMES):
            if _overlaps(m, inp):
                raise ValueError(f"{label} overlaps the memory of {iname}: outputs may not alias inputs")
        for prev, pname in zip(result, OUTPUT_NAMES):
            if prev is not None and _overlaps(m, prev):
                raise ValueError(f"{label} overlaps out[{OUTPUT_NAMES.index(pname)}] ({pname})")
        result.append(m)
    return tuple(result)
