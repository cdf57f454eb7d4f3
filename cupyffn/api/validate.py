"""Argument checking for the backward pass: every error names the argument and what was expected.

`prepare()` turns the seven inputs (and `out`) into a `Call`: the backend, device, sizes and 2-D
row-strided views the engines work on. Nothing is written and nothing is launched here, so a bad
call leaves every array untouched.

Repeated calls with the same arrays are common (training loops, CUDA graphs), so a validated call
is remembered by its `signature` (pointer, shape, strides and dtype of every CuPy array; pointer, shape
and strides of every float32 CUDA torch tensor, read from the tensor without a DLPack import): a call
with an equal signature has the same validation outcome and reuses the geometry (`reuse`).

Torch tensors (cupyffn/_arrays.py, "torch tensors read by pointer"): the DLPack stream handshake that
ordered torch's pending work before cupyffn's is replaced by one `_arrays.follow_torch` per call, made
by `prepare` or `reuse`, whichever the call takes (docs/decisions/048-dlpack-free-import.md).
"""

import math
import sys
from typing import Any, NamedTuple, Optional, Tuple

import numpy

from ..core import arrays as _arrays

INPUT_NAMES = ("grad_output", "hidden_states", "weight1", "weight2", "linear1_out", "tanh_inner", "gelu_out")
OUTPUT_NAMES = ("grad_hidden_states", "grad_weight1", "grad_weight2")
#: out= entries 3 and 4 of a call with need_bias_grads
BIAS_NAMES = ("grad_bias1", "grad_bias2")


def needed_outputs(need_grad_hidden, need_weight_grads, need_bias_grads):
    """Which of OUTPUT_NAMES (+ BIAS_NAMES, with need_bias_grads) a call computes."""
    needed = (need_grad_hidden, need_weight_grads, need_weight_grads)
    return needed + (True, True) if need_bias_grads else needed


def output_shapes(lead_shape, dim, hidden_dim):
    """The shapes of OUTPUT_NAMES + BIAS_NAMES for activations of leading dimensions `lead_shape`."""
    return lead_shape + (dim,), (hidden_dim, dim), (dim, hidden_dim), (hidden_dim,), (dim,)


class Call(NamedTuple):
    backend: str                 # "cpu" or "gpu"
    device: Any                  # "cpu" or CUDA device id
    tokens: int                  # T, product of the leading dimensions
    dim: int                     # D
    hidden_dim: int              # H
    lead_shape: Tuple[int, ...]  # leading dimensions of the activations
    inputs: Tuple[Optional[_arrays.Matrix], ...]  # geometry, INPUT_NAMES order (None: not kept, recomputed)
    out: Tuple[Optional[_arrays.Matrix], ...]    # OUTPUT_NAMES (+ BIAS_NAMES) order; None where not given
    arrays: Tuple[Any, ...]                      # the (imported) input arrays
    out_arrays: Tuple[Any, ...]                  # the (imported) out= arrays, or None entries
    follow: Any = None           # device id whose torch current stream the call follows (torch tensors), or None


def _matrix(array, name):
    """Geometry of `array` seen as [prod(leading dims), last dim], or a ValueError saying why it cannot be."""
    shape = array.shape
    cols = shape[-1]
    rows = math.prod(shape[:-1])
    if rows == 0 or cols == 0:
        ld = cols
    else:
        ld = _arrays.row_stride(shape, array.strides, 4)
        if ld is None:
            raise ValueError(
                f"{name} has strides {tuple(array.strides)} (bytes) for shape {tuple(shape)}: cupyffn reads arrays "
                f"whose last dimension is contiguous and whose leading dimensions flatten to one row stride "
                f"(any C-contiguous array, or a slice of rows or columns of one). Pass "
                f"ascontiguousarray({name}) instead")
    return _arrays.Matrix(_arrays.data_ptr(array), rows, cols, ld)


def _import(obj, name, stream, torch_devices):
    """_arrays.import_array, except that a float32 CUDA torch tensor's device is appended to `torch_devices` (its
    stream is followed once per call, by prepare) instead of being followed here."""
    viewed = _arrays.torch_view(obj)
    if viewed is None:
        return _arrays.import_array(obj, name, stream)
    torch_devices.append(viewed[0])
    return "gpu", viewed[1]


def _overlaps(a, b):
    (a0, a1), (b0, b1) = a.span, b.span
    return a0 < b1 and b0 < a1


_cupy_ndarray = None


def signature(args, out, accumulate):
    """Identity of a call's arrays, or None when any is neither a CuPy array nor a float32 CUDA torch tensor
    (those always take prepare()).

    A CuPy array's entry is (pointer, shape, strides in bytes, dtype); a torch tensor's (pointer, shape, strides
    in elements), read from the tensor (its dtype is float32 and it is on CUDA, or the signature is None and
    prepare() says what is wrong): the entries differ in length, so the two kinds never share a signature, and
    every torch entry's dtype and device are the same. The exact type (torch.Tensor or torch.nn.Parameter) is
    checked, so tensor subclasses take prepare() and DLPack.
    """
    global _cupy_ndarray
    nd = _cupy_ndarray
    if nd is None:
        # Only look CuPy up, never import it: a CuPy array exists only once CuPy is imported, and the NumPy
        # path must work where CuPy is not installed (sys.modules holds None for an import that was blocked).
        nd = getattr(sys.modules.get("cupy"), "ndarray", None)
        if nd is not None:
            _cupy_ndarray = nd
    tt = _arrays._torch_types  # None until import_array has seen torch imported (the first call takes prepare)
    if nd is None and tt is None:
        return None
    f32 = _arrays._torch_f32
    sig = [accumulate]
    for a in args:
        t = type(a)
        if t is nd:
            sig.append((a.data.ptr, a.shape, a.strides, a.dtype))
        elif a is None:  # memory mode (tanh_inner / gelu_out not kept); prepare() decides if allowed
            sig.append(None)
        elif tt is not None and t in tt and a.dtype is f32 and a.is_cuda:
            sig.append((a.data_ptr(), a.shape, a.stride()))
        else:
            return None
    if out is not None:
        if not isinstance(out, (tuple, list)):
            return None
        for a in out:
            t = type(a)
            if a is None:
                sig.append(None)
            elif t is nd:
                sig.append((a.data.ptr, a.shape, a.strides, a.dtype))
            elif tt is not None and t in tt and a.dtype is f32 and a.is_cuda:
                sig.append((a.data_ptr(), a.shape, a.stride()))
            else:
                return None
        sig.append(len(out))
    return tuple(sig)


def reuse(call, args, out, stream=None):
    """The validated `call` for new arrays with the same signature (same memory, shapes and strides).

    `stream`: the call's stream= (None: CuPy's current one); where the call has torch tensors, cupyffn's stream
    is ordered after torch's current stream here (`_arrays.follow_torch`), as prepare() does for a new call.
    The arrays are kept as given (torch tensors too: `_arrays.view2d` views them by pointer where needed).
    """
    if call.follow is not None:
        _arrays.follow_torch(call.follow, stream)
    return call._replace(arrays=tuple(args), out_arrays=tuple(out) if out is not None else (None,) * len(call.out))


def prepare(args, out=None, stream=None, need_grad_hidden=True, need_weight_grads=True, accumulate=False,
            need_bias_grads=False):
    """Check the seven inputs (INPUT_NAMES order) and `out` (3 arrays, or 5 with need_bias_grads); return a Call."""
    if not need_grad_hidden and not need_weight_grads:
        raise ValueError("need_grad_hidden and need_weight_grads are both False: there is nothing to compute")
    if stream is not None and not hasattr(stream, "ptr"):
        raise TypeError(f"stream must be a cupy.cuda.Stream (or ExternalStream) or None; got {type(stream).__name__}")

    for a, n in zip(args[:5], INPUT_NAMES[:5]):
        if a is None:
            raise TypeError(f"{n} is required; only tanh_inner and gelu_out may be None (recomputed from linear1_out)")
    # Memory mode: a missing tanh_inner / gelu_out is recomputed from linear1_out inside the kernels.
    present = [(a, n) for a, n in zip(args, INPUT_NAMES) if a is not None]
    torch_devices = []  # torch tensors read by pointer: their stream is followed once, below
    imported = [_import(a, n, stream, torch_devices) for a, n in present]
    backends = {b for b, _ in imported}
    names = [n for _, n in present]
    if len(backends) > 1:
        cpu = next(n for (b, _), n in zip(imported, names) if b == "cpu")
        gpu = next(n for (b, _), n in zip(imported, names) if b == "gpu")
        raise ValueError(f"cannot mix NumPy (CPU) and GPU arrays: {cpu} is on the CPU but {gpu} is on a GPU")
    backend = backends.pop()
    if backend == "cpu" and stream is not None:
        raise ValueError("stream= is for GPU arrays; these inputs are NumPy (CPU) arrays")
    given = dict(zip(names, (a for _, a in imported)))
    arrays = [given.get(n) for n in INPUT_NAMES]

    for n, a in given.items():
        if a.dtype != numpy.float32:
            raise TypeError(f"{n} must be float32; got {a.dtype}")

    devices = [_arrays.device_of(a) for a in given.values()]
    if len(set(devices)) > 1:
        where = ", ".join(f"{n} on {'cuda:%s' % d if d != 'cpu' else 'cpu'}" for n, d in zip(names, devices))
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
        if a is not None and tuple(a.shape) != act_shape:
            raise ValueError(f"{n} must have shape {act_shape} (grad_output's leading dimensions "
                             f"{lead} + hidden_dim {hidden_dim} from weight1 {tuple(weight1.shape)}); "
                             f"got {tuple(a.shape)}")

    inputs = tuple(None if a is None else _matrix(a, n) for a, n in zip(arrays, INPUT_NAMES))
    outs, out_arrays = _prepare_out(out, backend, devices[0], stream, inputs, arrays,
                                    need_grad_hidden, need_weight_grads, accumulate, torch_devices, need_bias_grads)
    tokens = inputs[0].rows
    follow = None
    if torch_devices:  # all on devices[0], checked above: one wait, not one per tensor (the DLPack handshake's)
        follow = devices[0]
        _arrays.follow_torch(follow, stream)
    return Call(backend, devices[0], tokens, dim, hidden_dim, lead, inputs, outs, tuple(arrays), out_arrays, follow)


def _prepare_out(out, backend, device, stream, inputs, arrays, need_grad_hidden, need_weight_grads, accumulate,
                 torch_devices=None, need_bias_grads=False):
    n = 5 if need_bias_grads else 3
    if out is None:
        if accumulate and (need_weight_grads or need_bias_grads):
            raise ValueError("accumulate=True adds into existing gradients: pass "
                             "out=(grad_hidden_states or None, grad_weight1, grad_weight2"
                             f"{', grad_bias1, grad_bias2' if need_bias_grads else ''})")
        return (None,) * n, (None,) * n
    lengths = (3, 5) if need_bias_grads else (3,)
    if not isinstance(out, (tuple, list)) or len(out) not in lengths:
        raise TypeError("out must be a sequence of three arrays (grad_hidden_states, grad_weight1, grad_weight2)"
                        f"{', or five with grad_bias1, grad_bias2 (need_bias_grads=True)' if need_bias_grads else ''}; "
                        "an entry may be None to have cupyffn allocate it")
    out = tuple(out) + (None,) * (n - len(out))
    expected = output_shapes(tuple(arrays[1].shape[:-1]), arrays[2].shape[1], arrays[2].shape[0])
    needed = needed_outputs(need_grad_hidden, need_weight_grads, need_bias_grads)
    spans = [(m.span, n) for m, n in zip(inputs, INPUT_NAMES) if m is not None]
    result, imported_out = [], []
    for i, (obj, name) in enumerate(zip(out, OUTPUT_NAMES + BIAS_NAMES)):
        label = f"out[{i}] ({name})"
        if obj is None:
            if accumulate and i > 0 and needed[i]:
                raise ValueError(f"accumulate=True needs {label}: the gradient to add into")
            result.append(None)
            imported_out.append(None)
            continue
        if not needed[i]:
            raise ValueError(f"{label} was given but is not computed (need_grad_hidden / need_weight_grads is False)")
        b, a = _import(obj, label, stream, torch_devices)
        if b != backend:
            where = "NumPy (CPU)" if b == "cpu" else "GPU"
            raise ValueError(f"{label} is a {where} array but the inputs are "
                             f"{'NumPy (CPU)' if backend == 'cpu' else 'GPU'} arrays")
        if _arrays.device_of(a) != device:
            raise ValueError(f"{label} is on cuda:{_arrays.device_of(a)} but the inputs are on cuda:{device}")
        if a.dtype != numpy.float32:
            raise TypeError(f"{label} must be float32; got {a.dtype}")
        if tuple(a.shape) != expected[i]:
            raise ValueError(f"{label} must have shape {expected[i]}; got {tuple(a.shape)}")
        if not a.flags.c_contiguous:
            raise ValueError(f"{label} must be C-contiguous; got strides {tuple(a.strides)} for shape {tuple(a.shape)}")
        if not getattr(a.flags, "writeable", True):
            raise ValueError(f"{label} is read-only")
        m = _matrix(a, label)
        (m0, m1) = m.span
        for (s0, s1), iname in spans:
            if m0 < s1 and s0 < m1:
                raise ValueError(f"{label} overlaps the memory of {iname}: outputs may not alias inputs")
        for j, prev in enumerate(result):
            if prev is not None and _overlaps(m, prev):
                raise ValueError(f"{label} overlaps out[{j}] ({(OUTPUT_NAMES + BIAS_NAMES)[j]})")
        result.append(m)
        imported_out.append(a)
    return tuple(result), tuple(imported_out)
