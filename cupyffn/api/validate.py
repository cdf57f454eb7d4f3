"""The one validator: every call (functional forward and backward, plans, the torch and JAX layers) is checked here,
once, and becomes a `Call`. Every error names the argument and what was expected; nothing is written or launched
before a Call exists, so a rejected call leaves every array untouched. The shape, dtype and precision rules are
cupyffn/core/rules.py's, over shapes and dtype names, which the JAX layer and the torch operators' fake
implementations run too (on tracers and fake tensors, at trace time); the rules that need the arrays themselves
(device, layout, byte order, out=, overlap) are here.

What a call may be (docs/precisions.md, "16-bit activations and biases"):

* activations (hidden_states, grad_output, linear1_out, tanh_inner, gelu_out and the outputs of their shapes) in one
  dtype: float32, bfloat16 or float16;
* float32 activations: float32 weights and biases, float32 gradients, any precision;
* bfloat16 / float16 activations: weights float32 (master weights, rounded to the activation dtype as autocast
  does) or the activation dtype, biases in the weights' dtype or float32, precision None (the operands are multiplied as they
  are), no tanh_inner (the GELU derivative is recomputed from linear1_out), weight and bias gradients in float32 or
  the weights' dtype (chosen by out=, float32 by default);
* arrays whose last dimension is contiguous and whose leading dimensions flatten to one row stride; weights also as
  the transpose of such a matrix (``[in, out]`` storage, as transformers' Conv1D keeps them: `weights_transposed`);
  outputs C-contiguous, except that with transposed weights the weight gradients may be stored as the weights are
  (transposes of C-contiguous ``[in, out]`` matrices: `grads_transposed`, the parameter's own layout, so no copy
  follows). Which engine takes which layout: cupyffn/api/routes.py (`requirement`).

Repeated calls (training loops, CUDA graphs) pass arrays of the same configuration again, at the same addresses or
elsewhere (a training step's new outputs): `check`, the validator's one entry, keeps the Call it validated beside
the arrays' configuration (`signature`; `Remembered` also holds the route the door chose), so an equal
configuration skips everything here but what depends on where the arrays are (docs/decisions/070).

Torch tensors (cupyffn/core/arrays.py, "torch tensors read by pointer"): the DLPack stream handshake is replaced by
one `arrays.follow_torch` per call, which the executor makes for a Call whose `follow` names a device
(docs/decisions/048-dlpack-free-import.md).
"""

import itertools
import math
import sys
from typing import Any, NamedTuple, Optional, Tuple

import numpy

from ..core import arrays as _arrays
from ..core import precision as _precision
from ..core import rules as _rules
from ..core.arrays import Matrix, dtype_name
from ..core.results import BACKWARD_OUTPUTS, FORWARD_OUTPUTS, BackwardInputs, ForwardInputs


class Request(NamedTuple):
    """What a call asks for besides its arrays (hashable: part of the key of a remembered call)."""

    kind: str                           # "forward" or "backward"
    precision: Optional[str] = None     # a precision name; None: the default of the arrays' device
    need_grad_hidden: bool = True
    need_weight_grads: bool = True
    need_bias_grads: bool = False
    accumulate: bool = False
    torch_layer: bool = False  # the torch layer's CPU call: torch's own ops where they are the precision's (059)


class Call(NamedTuple):
    """A validated call: where it runs, its sizes and dtypes, the geometry of its arrays and what it computes. Plain
    data, filled once here: the executor and the engines read fields, they never call back into the validator."""

    request: Request
    kind: str                    # the pass: "forward" or "backward" (request.kind)
    backend: str                 # "cpu" (NumPy) or "gpu"
    device: Any                  # "cpu" or the CUDA device id
    act: str                     # activation dtype name
    weights: str                 # the weights' dtype name
    grads: str                   # backward: the weight and bias gradients' dtype name; forward: act
    precision: Any               # float32 activations: the resolved Precision; 16-bit: None
    tokens: int                  # T, the product of the activations' leading dimensions
    dim: int                     # D
    hidden_dim: int              # H
    lead_shape: Tuple[int, ...]
    weights_transposed: bool     # weight1 / weight2 given as transposed views of [in, out] matrices
    inputs: Any                  # Forward/BackwardInputs of Matrix (None: absent); transposed weights: their storage
    out: Tuple[Optional[Matrix], ...]      # OUTPUTS order of the kind; None where not given
    arrays: Tuple[Any, ...]                # the imported input arrays (None where absent)
    out_arrays: Tuple[Any, ...]            # the imported out= arrays (None where not given)
    computed: Tuple[bool, ...]             # which outputs (OUTPUTS order) the call computes
    output_shapes: Tuple[Tuple[int, ...], ...]
    output_dtypes: Tuple[str, ...]
    follow: Any = None           # device id whose torch current stream the call follows, or None
    grads_transposed: bool = False  # backward: the weight gradients stored [in, out], as the transposed weights are
    ready: int = 0               # grad_hidden_ready's raw CUDA event (0: none), recorded once grad_hidden is written


def _computed(request, act):
    if request.kind == "forward":
        return (True, True, act == "float32", True)
    r = request
    needed = (r.need_grad_hidden, r.need_weight_grads, r.need_weight_grads)
    return needed + (True, True) if r.need_bias_grads else needed


def outputs_of(kind):
    return FORWARD_OUTPUTS if kind == "forward" else BACKWARD_OUTPUTS


def output_shapes(kind, lead, dim, hidden):
    if kind == "forward":
        return lead + (dim,), lead + (hidden,), lead + (hidden,), lead + (hidden,)
    return lead + (dim,), (hidden, dim), (dim, hidden), (hidden,), (dim,)


# ---------------------------------------------------------------------- the configuration of repeated arrays
_cupy_ndarray = None
UNKNOWN = object()  # signature's answer before torch has been seen: try again after validating


def signature(args, out):
    """(configuration, addresses) of a call's arrays: (shape, strides, dtype, device, address mod 16) of each NumPy
    array (and whether it is writeable), CuPy array and CUDA torch tensor, all that validation and the route read of
    it but where it is (decision 070), and the addresses (0 for None). None for any other argument (validated every
    time), UNKNOWN while torch has not been seen (it may be a tensor). The three kinds' strides or dtypes differ in
    kind, so they never share an entry; exact types only (subclasses are validated each time)."""
    global _cupy_ndarray
    nd = _cupy_ndarray
    if nd is None:
        # only look CuPy up, never import it: a CuPy array exists only once CuPy is imported, and the NumPy route
        # must work where CuPy is not installed
        nd = getattr(sys.modules.get("cupy"), "ndarray", None)
        if nd is not None:
            _cupy_ndarray = nd
    tt = _arrays.seen_torch_types()  # None until import_array has seen torch imported
    config, where = [], []
    if out is not None:
        if not isinstance(out, (tuple, list)):
            return None
        args = (*args, *out, len(out))
    for a in args:
        t = type(a)
        if t is nd:
            data = a.data
            ptr = data.ptr
            config.append((a.shape, a.strides, a.dtype, data.device_id, ptr & 15))
        elif a is None or t is int:
            config.append(a)
            ptr = 0
        elif tt is not None and t in tt and a.is_cuda:
            ptr = a.data_ptr()
            config.append((a.shape, a.stride(), a.dtype, a.get_device(), ptr & 15))
        elif t is numpy.ndarray:
            ptr = a.__array_interface__["data"][0]
            config.append((a.shape, a.strides, a.dtype, "cpu", ptr & 15, a.flags.writeable))
        else:
            return UNKNOWN if tt is None else None
        where.append(ptr)
    return tuple(config), tuple(where)


class Remembered:
    """A validated call kept beside its configuration: `last`, (addresses, Call) of the call seen last (its arrays
    dropped), `extents`, the bytes each array spans (inputs then outputs), and the door's `route` (None: not yet)."""

    __slots__ = ("last", "extents", "route", "used")

    def __init__(self, where, call):
        self.last, self.route, self.used = (where, call), None, next(_uses)
        self.extents = tuple(None if m is None else m.span[1] - m.span[0] for m in call.inputs + call.out)


#: validated calls by (configuration, request, owner): enough for every layer of a deep model, forward and backward;
#: when full, the least recently used quarter goes (a use ticks a counter on the entry: a hit hashes its key once)
REMEMBERED_SIZE = 1024
_remembered = {}
_uses = itertools.count()


def forget():
    """Drop every remembered call (cupyffn.clear_cache)."""
    _remembered.clear()


def check(request, args, out=None, stream=None, ready_event=None, owner=0):
    """The validator's one entry: (the Call, its Remembered entry). A configuration validated before (for the same
    request and `owner`, a plan's token or 0) is reused, what depends on the addresses checked again (`_moved`); any
    other call is validated (`validate`). `ready_event`: grad_hidden_ready."""
    _check_stream(stream)
    sig = signature(args, out)
    entry = None
    if sig is not None and sig is not UNKNOWN:
        key = (sig[0], request, owner)
        entry = _remembered.get(key)
    if entry is not None:
        entry.used = next(_uses)
        where, known = entry.last
        if stream is not None and known.backend == "cpu":
            raise ValueError(_CPU_STREAM)
        if where != sig[1]:
            known = _moved(known, sig[1], entry.extents)
            entry.last = (sig[1], known)
        return known._replace(arrays=tuple(args), out_arrays=tuple(out) if out is not None else (None,) * len(known.out),
                              ready=_ready_event(ready_event, known)), entry
    call = validate(request, args, out, stream)
    call = call._replace(ready=_ready_event(ready_event, call))
    if sig is UNKNOWN:  # the process's first CuPy arrays or torch tensors: validate has imported them
        sig = signature(args, out)
    if sig is None or sig is UNKNOWN:  # validated every time: nothing to remember it by
        return call, Remembered(None, call)
    entry = Remembered(sig[1], call._replace(arrays=None, out_arrays=None, ready=0))
    if len(_remembered) >= REMEMBERED_SIZE:
        _drop_least_recent()
    _remembered[(sig[0], request, owner)] = entry
    return call, entry


def _drop_least_recent():
    for key, _ in sorted(list(_remembered.items()), key=lambda item: item[1].used)[:max(1, len(_remembered) // 4)]:
        _remembered.pop(key, None)  # another thread may have dropped it meanwhile


def _moved(call, where, extents):
    """Remembered `call` pointed at the addresses `where` (arguments, then out=), refused where an output overlaps an
    input or another output (the one check that depends on addresses)."""
    n = len(call.inputs)
    inputs = type(call.inputs)._make(None if m is None else Matrix(where[i], m.rows, m.cols, m.ld, m.dtype)
                                     for i, m in enumerate(call.inputs))
    out = tuple(None if m is None else Matrix(where[n + i], m.rows, m.cols, m.ld, m.dtype)
                for i, m in enumerate(call.out))
    spans = [((where[i], where[i] + extents[i]), name) for i, name in enumerate(_rules.inputs_of(call.kind))
             if inputs[i] is not None]
    given = [None if m is None else (where[n + i], where[n + i] + extents[n + i]) for i, m in enumerate(out)]
    names = outputs_of(call.kind)
    for i, span in enumerate(given):
        if span is not None:
            why = _aliasing(span, f"out[{i}] ({names[i]})", spans, given[:i], names)
            if why is not None:
                raise ValueError(why)
    return call._replace(inputs=inputs, out=out)


def _aliasing(span, label, spans, given, names):
    """Why the output of bytes [begin, end) `span` may not be written (None: it may): it overlaps an input (`spans`:
    (span, name)) or an output before it (`given`: spans, None where not given)."""
    begin, end = span
    for (b, e), iname in spans:
        if begin < e and b < end:
            return f"{label} overlaps the memory of {iname}: outputs may not alias inputs"
    for j, prev in enumerate(given):
        if prev is not None and begin < prev[1] and prev[0] < end:
            return f"{label} overlaps out[{j}] ({names[j]})"
    return None


def _ready_event(event, call):
    """The raw pointer of a grad_hidden_ready event (0 for None), after checking that `call` can honour it."""
    if event is None:
        return 0
    if call.backend == "cpu":
        raise ValueError("grad_hidden_ready= is for GPU arrays (a cupy.cuda.Event); these are NumPy (CPU) arrays, "
                         "whose results are all ready when the call returns")
    if call.kind == "backward" and not call.request.need_grad_hidden:
        raise ValueError("grad_hidden_ready= was given but grad_hidden_states is not computed (need_grad_hidden=False)")
    ptr = getattr(event, "ptr", None)
    if not isinstance(ptr, int) or not ptr:
        raise TypeError(f"grad_hidden_ready must be a cupy.cuda.Event or None; got {type(event).__name__}")
    return ptr


# ---------------------------------------------------------------------- the checks
def validate(request, args, out=None, stream=None):
    """Check a call's inputs (`_rules.inputs_of(request.kind)` order) and `out`; return its Call (module docstring)."""
    kind = request.kind
    names = _rules.inputs_of(kind)
    if kind == "backward":
        _rules.check_needs(request.need_grad_hidden, request.need_weight_grads, request.need_bias_grads)
    _check_stream(stream)
    required = 5 if kind == "backward" else 3
    for a, n in zip(args[:required], names):
        if a is None:
            optional = "tanh_inner and gelu_out may be None (recomputed from linear1_out)" if kind == "backward" \
                else "bias1 and bias2 may be None"
            raise TypeError(f"{n} is required; only {optional}")
    backend, arrays, torch_devices = _import(args, names, stream)
    device = _one_device(arrays, names)
    act, weights = _rules.check_dtypes(kind, tuple(None if a is None else _dtype_of(a) for a in arrays))
    lead, dim, hidden = _rules.check_shapes(kind, tuple(None if a is None else tuple(a.shape) for a in arrays))
    if request.accumulate and kind == "backward" and out is None and (request.need_weight_grads
                                                                       or request.need_bias_grads):
        raise ValueError("accumulate=True adds into existing gradients: pass out=(grad_hidden_states or None, "
                         "grad_weight1, grad_weight2" + (", grad_bias1, grad_bias2" if request.need_bias_grads else "")
                         + ")")
    transposed = _weights_transposed(arrays[names.index("weight1")], arrays[names.index("weight2")])
    inputs = (ForwardInputs if kind == "forward" else BackwardInputs)._make(
        None if a is None else _matrix(a, n, transposed and n in ("weight1", "weight2")) for a, n in zip(arrays, names))
    _rules.check_precision(act, request.precision)
    precision = _precision.resolve(request.precision, cpu=backend == "cpu") if act == "float32" else None
    grads = act if kind == "forward" else "float32"
    call = Call(request, kind, backend, device, act, weights, grads, precision, math.prod(lead), dim, hidden, lead,
                transposed, inputs, (), tuple(arrays), (), _computed(request, act),
                output_shapes(kind, lead, dim, hidden), _output_dtypes(kind, act, grads))
    given, given_arrays, grads, grads_transposed = _outputs(call, out, stream, torch_devices)
    if kind == "backward":
        call = call._replace(grads=grads, output_dtypes=_output_dtypes(kind, act, grads))
    # torch tensors read by pointer, all on `device` (checked): the executor orders its stream after torch's once per
    # call (`follow`), not once per tensor (the DLPack handshake's)
    return call._replace(out=given, out_arrays=given_arrays, grads_transposed=grads_transposed,
                         follow=device if torch_devices else None)


def _output_dtypes(kind, act, grads):
    return (act,) * 4 if kind == "forward" else (act,) + (grads,) * 4


def _check_stream(stream):
    if stream is not None and not hasattr(stream, "ptr"):
        raise TypeError(f"stream must be a cupy.cuda.Stream (or ExternalStream) or None; got {type(stream).__name__}")


_CPU_STREAM = "stream= is for GPU arrays; these inputs are NumPy (CPU) arrays"


def _import(args, names, stream):
    """(backend, imported arrays (None kept), torch devices to follow)."""
    torch_devices = set()  # torch tensors read by pointer: their stream is followed once, by validate
    arrays, backends = [], {}
    for a, n in zip(args, names):
        if a is None:
            arrays.append(None)
            continue
        backend, imported = _arrays.import_array(a, n, stream, torch_devices)
        backends.setdefault(backend, n)
        arrays.append(imported)
    if len(backends) > 1:
        raise ValueError(f"cannot mix NumPy (CPU) and GPU arrays: {backends['cpu']} is on the CPU but "
                         f"{backends['gpu']} is on a GPU")
    backend = next(iter(backends))
    if backend == "cpu" and stream is not None:
        raise ValueError(_CPU_STREAM)
    return backend, arrays, torch_devices


def _where(device):
    return "cpu" if device == "cpu" else f"cuda:{device}"


def _one_device(arrays, names):
    given = [(n, _arrays.device_of(a)) for a, n in zip(arrays, names) if a is not None]
    if len({d for _, d in given}) > 1:
        first = given[0]
        odd = next((n, d) for n, d in given if d != first[1])
        raise ValueError(f"all arrays must be on one device; {odd[0]} is on {_where(odd[1])} but {first[0]} is on "
                         f"{_where(first[1])} (" + ", ".join(f"{n} on {_where(d)}" for n, d in given) + ")")
    return given[0][1]


def _dtype_of(a):
    """`a`'s dtype name for the rules (cupyffn/core/rules.py); a dtype not in native byte order by its code ('>f4'),
    which matches no name: a byte-swapped float32 is not float32 to the kernels."""
    dt = getattr(a, "dtype", None)
    if getattr(dt, "byteorder", "=") not in ("=", "|") and not getattr(dt, "isnative", True):
        return dt.str
    return dtype_name(a)


def _transposed(a):
    """Whether 2-D `a` is the transpose of a row-strided matrix (columns contiguous), not row-strided itself."""
    rows, cols = a.shape
    s0, s1 = a.strides
    size = a.dtype.itemsize
    return rows > 1 and cols > 1 and s0 == size and s1 >= rows * size and s1 % size == 0


def _weights_transposed(w1, w2):
    """Both weights are transposed views ([in, out] storage); one alone is read as [out, in] (and refused by _matrix
    if its rows are not row-strided)."""
    return _transposed(w1) and _transposed(w2)


def _matrix(array, name, transposed=False):
    """Geometry of `array` seen as [prod(leading dims), last dim] (a transposed weight: its [in, out] storage), or a
    ValueError saying why it cannot be."""
    if transposed:
        array = array.T
    shape = array.shape
    cols = shape[-1]
    rows = math.prod(shape[:-1])
    itemsize = array.dtype.itemsize
    if rows == 0 or cols == 0:
        ld = cols
    else:
        ld = _arrays.row_stride(shape, array.strides, itemsize)
        if ld is None:
            raise ValueError(
                f"{name} has strides {tuple(array.strides)} (bytes) for shape {tuple(shape)}: cupyffn reads arrays "
                f"whose last dimension is contiguous and whose leading dimensions flatten to one row stride "
                f"(any C-contiguous array, or a slice of rows or columns of one). Pass ascontiguousarray({name}) "
                f"instead")
    return Matrix(_arrays.data_ptr(array), rows, cols, ld, dtype_name(array))


def _outputs(call, out, stream, torch_devices):
    """(given out= geometry, the imported out= arrays, the gradients' dtype, whether the weight gradients are stored
    transposed) of `call` (OUTPUTS order)."""
    kind, r = call.kind, call.request
    names = outputs_of(kind)
    computed = call.computed
    lengths = (4,) if kind == "forward" else ((3, 5) if r.need_bias_grads else (3,))
    n = max(lengths) if kind == "forward" or r.need_bias_grads else 3
    if out is None:
        return (None,) * n, (None,) * n, "float32", False
    if not isinstance(out, (tuple, list)) or len(out) not in lengths:
        listed = ", ".join(names[:max(lengths)])
        counts = " or ".join({3: "three", 4: "four", 5: "five"}[n] for n in lengths)
        raise TypeError(f"out must be a sequence of {counts} arrays ({listed}); an entry may be None to have cupyffn "
                        f"allocate it" + (" (need_bias_grads=True adds grad_bias1, grad_bias2)"
                                          if kind == "backward" and not r.need_bias_grads else ""))
    out = tuple(out) + (None,) * (n - len(out))
    shapes = call.output_shapes
    spans = [(m.span, nm) for m, nm in zip(call.inputs, _rules.inputs_of(kind)) if m is not None]
    given, given_spans, imported, grads, layouts = [], [], [], set(), {}
    for i, (obj, name) in enumerate(zip(out, names)):
        label = f"out[{i}] ({name})"
        if obj is None:
            if r.accumulate and kind == "backward" and i > 0 and computed[i]:
                raise ValueError(f"accumulate=True needs {label}: the gradient to add into")
            given.append(None)
            given_spans.append(None)
            imported.append(None)
            continue
        if not computed[i]:
            if kind == "forward":
                raise ValueError(f"{label} must be None: bfloat16/float16 forwards keep linear1_out and gelu_out only "
                                 f"(the backward recomputes the GELU derivative from linear1_out)")
            raise ValueError(f"{label} was given but is not computed (need_grad_hidden / need_weight_grads is False)")
        b, a = _arrays.import_array(obj, label, stream, torch_devices)
        if b != call.backend:
            where = "NumPy (CPU)" if b == "cpu" else "GPU"
            raise ValueError(f"{label} is a {where} array but the inputs are "
                             f"{'NumPy (CPU)' if call.backend == 'cpu' else 'GPU'} arrays")
        if _arrays.device_of(a) != call.device:
            raise ValueError(f"{label} is on {_where(_arrays.device_of(a))} but the inputs are on "
                             f"{_where(call.device)}")
        want = (call.act,) if kind == "forward" or i == 0 else tuple(dict.fromkeys(("float32", call.weights)))
        if _dtype_of(a) not in want:
            raise _rules.dtype_error(label, " or ".join(want), _dtype_of(a))
        if i > 0 and kind == "backward":
            grads.add(dtype_name(a))
        if tuple(a.shape) != shapes[i]:
            raise ValueError(f"{label} must have shape {shapes[i]}; got {tuple(a.shape)}")
        weight_grad = kind == "backward" and i in (1, 2)
        stored_transposed = weight_grad and call.weights_transposed and _transposed(a) and a.T.flags.c_contiguous
        if not (a.flags.c_contiguous or stored_transposed):
            also = (" (or, as the weights are given, the transpose of a C-contiguous [in, out] matrix)"
                    if weight_grad and call.weights_transposed else "")
            raise ValueError(f"{label} must be C-contiguous{also}; got strides {tuple(a.strides)} for shape "
                             f"{tuple(a.shape)}")
        if not getattr(a.flags, "writeable", True):
            raise ValueError(f"{label} is read-only")
        if weight_grad:
            layouts[label] = stored_transposed
        m = _matrix(a, label, stored_transposed)
        why = _aliasing(m.span, label, spans, given_spans, names)
        if why is not None:
            raise ValueError(why)
        given.append(m)
        given_spans.append(m.span)
        imported.append(a)
    if len(grads) > 1:
        raise TypeError(f"the weight and bias gradients in out= must share one dtype; got {sorted(grads)}")
    if len(set(layouts.values())) > 1:
        raise ValueError("out[1] (grad_weight1) and out[2] (grad_weight2) must share one layout: both C-contiguous "
                         "or both stored as the weights are ([in, out]); got " + ", ".join(
                             f"{k} {'[in, out]' if v else 'C-contiguous'}" for k, v in layouts.items()))
    return tuple(given), tuple(imported), grads.pop() if grads else "float32", any(layouts.values())


def check_size(name, value, minimum):
    """An integer argument (a plan's tokens, dim, hidden_dim) checked and returned as int."""
    if not isinstance(value, (int, numpy.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return int(value)
