"""The functional API's route for 16-bit activations and biases: arguments read and checked, outputs allocated, the
cached plan of cupyffn/_lt_ffn.py run on the GPU, or the same computation in NumPy on the CPU.

``gelu_ffn_forward`` / ``gelu_ffn_backward`` come here when the activations are bfloat16 or float16, or when biases
(``bias1`` / ``bias2``, ``need_bias_grads``) are involved (docs/decisions/049-biases-and-16-bit-activations.md).
"""

import contextlib
from typing import Any, NamedTuple

import numpy

from ..core import arrays as _arrays, checks as _checks, plans as _plan_cache
from ..cpu import lt as _lt_cpu
from ..lt.engine import ITEMSIZE, LtBackward, LtForward, LtKey
from ..core.plans import PlanCache
from ..core.views import numpy_dtype

HALF = ("bfloat16", "float16")
ACTS = HALF + ("float32",)
INPUTS = ("grad_output", "hidden_states", "weight1", "weight2", "linear1_out", "tanh_inner", "gelu_out")
GRADS = ("grad_hidden_states", "grad_weight1", "grad_weight2", "grad_bias1", "grad_bias2")
FORWARD = ("output", "linear1_out", "tanh_inner", "gelu_out")
FORWARD_INPUTS = ("hidden_states", "weight1", "weight2", "bias1", "bias2")
#: precisions float32 activations with biases may take (None: "ieee")
FLOAT32_PRECISIONS = (None, "ieee", "tf32")

_forwards = PlanCache(4)
_backwards = PlanCache(4)


def clear_cache():
    _recent.clear()
    _forwards.clear()
    _backwards.clear()


def dtype_name(obj):
    """'bfloat16', 'float16', 'float32', ... of an array or tensor of any framework (cheap; None without a dtype)."""
    d = getattr(obj, "dtype", None)
    if d is None:
        return None
    name = getattr(d, "name", None)
    return name if isinstance(name, str) else str(d).rpartition(".")[2]


def wants(first, *biased):
    """Whether a call with first activation `first` takes this route: 16-bit activations, or any bias."""
    return any(biased) or dtype_name(first) in HALF


#: float32 precisions whose biases the float32 engine takes (cupyffn/_forward.py, the backward plans)
ENGINE_BIAS_PRECISIONS = ("bf16x3", "fp16+fp8")


def engine_biases(first, precision):
    """Whether a biased call with first activation `first` in precision `precision` (a name or None) runs on the
    float32 engine rather than here: float32 activations in a split precision."""
    return precision in ENGINE_BIAS_PRECISIONS and dtype_name(first) == "float32"


def _check_precision(precision, act, jax=False):
    """Refuse a precision 16-bit activations, or float32 ones with biases, cannot take; `jax`: for cupyffn.jax, whose
    biases run on this route only."""
    if act in HALF:
        if precision is not None:
            raise ValueError(f"precision= chooses how float32 operands are multiplied; {act} activations are "
                             f"multiplied as they are (bf16/fp16 tensor cores, fp32 accumulation): pass precision=None")
    elif jax and precision not in FLOAT32_PRECISIONS:
        raise ValueError(f"biases with float32 activations run in precision 'ieee' (the default) or 'tf32' in "
                         f"cupyffn.jax (cuBLASLt GEMMs with fused bias epilogues; 'bf16x3' and 'fp16+fp8' take biases "
                         f"in cupyffn.gelu_ffn_forward / gelu_ffn_backward and the torch layer: docs/precisions.md); "
                         f"got precision={precision!r}")
    elif precision not in FLOAT32_PRECISIONS + ENGINE_BIAS_PRECISIONS:
        raise ValueError(f"biases with float32 activations run in precision 'ieee' (the default), 'tf32', "
                         f"'bf16x3' or 'fp16+fp8' (docs/precisions.md); got precision={precision!r}")


def _fp32_precision(precision, act):
    """The plan's precision: float32 activations' ("ieee" by default), None for 16-bit ones."""
    return None if act in HALF else (precision or "ieee")


def _import(objs, names, stream):
    """import_array of every non-None object (torch's stream followed once); ('cpu'|'gpu', arrays, device)."""
    devices = set()
    arrays = [None if o is None else _arrays.import_array(o, n, stream, devices) for o, n in zip(objs, names)]
    backends = {a[0] for a in arrays if a is not None}
    if len(backends) > 1:
        raise ValueError("cannot mix NumPy (CPU) and GPU arrays")
    backend = backends.pop()
    arrays = [None if a is None else a[1] for a in arrays]
    where = {_arrays.device_of(a) for a in arrays if a is not None}
    if len(where) > 1:
        raise ValueError("all arrays must be on one device; got " + ", ".join(
            f"{n} on {_arrays.device_of(a)}" for a, n in zip(arrays, names) if a is not None))
    if backend == "cpu" and stream is not None:
        raise ValueError("stream= is for GPU arrays; these inputs are NumPy (CPU) arrays")
    for device in devices:
        _arrays.follow_torch(device, stream)
    return backend, arrays, where.pop(), bool(devices)


def _contiguous(a, name, gpu):
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous with bfloat16/float16 activations or biases (the cuBLASLt "
                         f"plans read packed rows); pass ascontiguousarray({name})")
    if gpu and a.size and a.data.ptr % 16:
        raise ValueError(f"{name} must start on a 16-byte boundary (cuBLASLt); got address {a.data.ptr:#x}")


def _expect(a, name, shape, dtypes):
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(a.shape)}")
    if dtype_name(a) not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(dtypes)}; got {dtype_name(a)}")


def _block(first, name, w1, w2, precision):
    """(activation dtype, D, H, weights' dtype) of a call whose first activation is `first` (named `name`), with
    the weights and the precision checked against it."""
    act = dtype_name(first)
    if act not in ACTS:
        raise TypeError(f"{name} must be bfloat16, float16 or float32; got {act}")
    _check_precision(precision, act)
    if first.ndim < 1:
        raise ValueError(f"{name} must have shape [..., dim]; got {tuple(first.shape)}")
    D = first.shape[-1]
    if w1.ndim != 2 or w1.shape[1] != D:
        raise ValueError(f"weight1 must have shape (hidden_dim, dim) with dim = {D}; got {tuple(w1.shape)}")
    H = w1.shape[0]
    wt = dtype_name(w1)
    _expect(w1, "weight1", (H, D), ("float32", act) if act != "float32" else ("float32",))
    _expect(w2, "weight2", (D, H), (wt,))
    return act, D, H, wt


def _layout(arrays, names, gpu, D, H, act):
    """Every given array C-contiguous (16-byte aligned on the GPU), and rows cuBLASLt can read."""
    for a, name in zip(arrays, names):
        if a is not None:
            _contiguous(a, name, gpu)
    if gpu and (D * ITEMSIZE[act] % 16 or H * ITEMSIZE[act] % 16):
        raise ValueError(f"dim = {D} and hidden_dim = {H} must be multiples of {16 // ITEMSIZE[act]} for {act} "
                         f"activations on the GPU (cuBLASLt reads 16-byte-aligned rows)")


def _span(a):
    if isinstance(a, numpy.ndarray):
        p = a.__array_interface__["data"][0]
    else:
        p = a.data.ptr
    return p, p + a.nbytes


def _overlap(a, b):
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a.nbytes and b.nbytes and a0 < b1 and b0 < a1


def _outputs(out, names, shapes, dtypes, backend, device, stream, inputs, lengths):
    """(arrays, given): the caller's out= entries imported and checked, or None where cupyffn allocates."""
    given = [None] * max(lengths)
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) not in lengths:
            raise TypeError(f"out must be a sequence of {' or '.join(map(str, lengths))} arrays "
                            f"({', '.join(names[:max(lengths)])}); an entry may be None to have cupyffn allocate it")
        for i, obj in enumerate(out):
            if obj is None:
                continue
            label = f"out[{i}] ({names[i]})"
            b, a = _arrays.import_array(obj, label, stream)
            if b != backend or _arrays.device_of(a) != device:
                raise ValueError(f"{label} must be on the inputs' device")
            if shapes[i] is None:
                raise ValueError(f"{label} must be None: this call does not compute {names[i]}")
            _expect(a, label, shapes[i], dtypes[i])
            _contiguous(a, label, backend == "gpu")
            if not getattr(a.flags, "writeable", True):
                raise ValueError(f"{label} must be writeable")
            for inp_name, inp in inputs:
                if inp is not None and _overlap(a, inp):
                    raise ValueError(f"{label} overlaps the memory of {inp_name}: outputs may not alias inputs")
            for j in range(i):
                if given[j] is not None and _overlap(a, given[j]):
                    raise ValueError(f"{label} overlaps out[{j}] ({names[j]})")
            given[i] = a
    return given


def _allocate(given, shapes, dtypes, backend, stream, capturing, what):
    import cupy

    arrays = []
    for g, shape, dtype, name in zip(given, shapes, dtypes, what):
        if g is not None or shape is None:
            arrays.append(g)
            continue
        if capturing:
            raise RuntimeError(f"cupyffn: called during CUDA stream capture without out= for {name}: allocating "
                               f"inside a capture would tie that memory to the graph. Pass it in out=")
        if backend == "cpu":
            arrays.append(numpy.empty(shape, numpy_dtype(dtype)))
        else:
            with stream:
                arrays.append(cupy.empty(shape, numpy_dtype(dtype)))
    return arrays


def _nan_fill(arrays):
    for a in arrays:
        if a is not None:
            a.view(numpy.uint16 if a.dtype.itemsize == 2 else numpy.uint32).fill(
                {"bfloat16": 0x7FC0, "float16": 0x7E00}.get(dtype_name(a), 0x7FC00000))


def _run_gpu(plans, key, build, run, fill, stream, capturing, what):
    plan = plans.acquire(key)
    if plan is None:
        if capturing:
            raise RuntimeError(f"cupyffn: {what} was called during CUDA stream capture but no plan exists for this "
                               f"shape and dtypes; call it once outside the capture first (on any stream)")
        plan = plans.acquire(key, build)
    try:
        with plan.lock:
            if capturing:
                _plan_cache.pin(plan)
            run(plan)
    except BaseException as e:
        if capturing:
            raise
        error = _plan_cache.fill_nan_after_failure(e, fill)
        if error is e:
            raise
        raise error from e
    finally:
        plans.release(plan)


def _stream(stream, device):
    import cupy

    with cupy.cuda.Device(device):
        s = stream if stream is not None else cupy.cuda.get_current_stream()
    return s, _plan_cache.is_capturing(s.ptr)


def _callers(out, given, res):
    """The results as the caller sees them: its own out= objects where given, cupyffn's arrays elsewhere."""
    return [out[i] if i < len(out or ()) and given[i] is not None else r for i, r in enumerate(res)]


class _Prepared(NamedTuple):
    """A checked GPU call, ready to enqueue (and, keyed by its signature, to replay without checks)."""

    plans: Any
    key: LtKey
    build: Any
    device: int
    follow: bool          # torch tensors among the arguments: follow torch's stream (on a replay)
    fill: list            # (pointer, shape, dtype name) of the caller's outputs, NaN-filled after a failure
    result: Any           # the result type (FFNForward or FFNGrads) with its number of fields
    enqueue: Any          # enqueue(plan, stream_ptr, capturing, ready_event)
    what: str


# signature -> _Prepared: repeated arrays skip the checks (as the float32 route's validated-call cache, decision
# 014), only for calls whose every output is the caller's (nothing is allocated per call)
_recent = {}
_cupy_ndarray = None


def _signature(args, out, flags):
    """Identity of the call's arrays (pointer, shape, strides, dtype; CuPy arrays and CUDA torch tensors only, else
    None) and flags."""
    global _cupy_ndarray
    if _cupy_ndarray is None:
        import cupy

        _cupy_ndarray = cupy.ndarray
    nd, tt = _cupy_ndarray, _arrays._torch_types or ()
    sig = [flags]
    for a in (*args, *(out if isinstance(out, (tuple, list)) else (out,))):
        t = type(a)
        if a is None:
            sig.append(None)
        elif t is nd:
            sig.append((a.data.ptr, a.shape, a.strides, a.dtype, a.device.id))
        elif t in tt and a.is_cuda:
            sig.append((a.data_ptr(), a.shape, a.stride(), a.dtype, a.get_device()))
        else:
            return None
    return tuple(sig)


def _remember(sig, prepared):
    if len(_recent) >= 32:
        _recent.clear()
    _recent[sig] = prepared


def _replay(prepared, out, stream, ready):
    """Run a remembered call again; the results are this call's out= objects (every output was given)."""
    if ready is not None and not prepared.key.need_grad_hidden:
        raise ValueError("grad_hidden_ready= needs GPU arrays and need_grad_hidden=True")
    s, capturing = _stream(stream, prepared.device)
    if prepared.follow:
        _arrays.follow_torch(prepared.device, s)
    kind, n = prepared.result
    _execute(prepared, s, capturing, ready)
    out = list(out) + [None] * (n - len(out))
    if kind is not None:  # FFNForward: its tanh_inner is None
        return kind(*out)
    from .backward_plan import FFNGrads

    return FFNGrads(*out)


def _execute(prepared, s, capturing, ready):
    import cupy

    from ..core.views import typed_view

    def fill():
        _fill_on(s, [typed_view(p, shape, _strides(shape), prepared.device, dt) for p, shape, dt in prepared.fill])

    with cupy.cuda.Device(prepared.device):
        _run_gpu(prepared.plans, prepared.key, lambda: prepared.build(prepared.key),
                 lambda plan: prepared.enqueue(plan, s.ptr, capturing, ready), fill, s, capturing, prepared.what)


def _strides(shape):
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= d
    return tuple(reversed(strides))


def _geometry(arrays):
    return [(a.data.ptr, tuple(a.shape), dtype_name(a)) for a in arrays if a is not None]


# ---------------------------------------------------------------------- forward
def forward(hidden_states, weight1, weight2, bias1, bias2, precision, out, stream):
    """gelu_ffn_forward's route (see there): FFNForward(output, linear1_out, None, gelu_out)."""
    from .forward import FFNForward

    sig = _signature((hidden_states, weight1, weight2, bias1, bias2), out, ("forward", precision))
    if sig is not None:
        prepared = _recent.get(sig)
        if prepared is not None:
            return _replay(prepared, out, stream, None)
    backend, arrays, device, torch_in = _import((hidden_states, weight1, weight2, bias1, bias2), FORWARD_INPUTS,
                                                stream)
    x, w1, w2, b1, b2 = arrays
    act, D, H, wt = _block(x, "hidden_states", w1, w2, precision)
    for b, name, n in ((b1, "bias1", H), (b2, "bias2", D)):
        if b is not None:
            _expect(b, name, (n,), (wt,))
    gpu = backend == "gpu"
    _layout(arrays, FORWARD_INPUTS, gpu, D, H, act)
    lead = tuple(x.shape[:-1])
    shapes = (lead + (D,), lead + (H,), None, lead + (H,))
    dtypes = ((act,),) * 4
    if out is not None and len(out) == 4 and out[2] is not None:
        raise ValueError("out[2] (tanh_inner) must be None: with bfloat16/float16 activations or biases the forward "
                         "keeps linear1_out and gelu_out only (the backward's GELU derivative is recomputed from "
                         "linear1_out)")
    given = _outputs(out, FORWARD, shapes, dtypes, backend, device, stream, list(zip(FORWARD_INPUTS, arrays)), (4,))
    if not gpu:
        res = _allocate(given, shapes, [act] * 4, backend, None, False, FORWARD)
        _lt_cpu.forward(x, w1, w2, b1, b2, act, res, _fp32_precision(precision, act))
        return FFNForward(*_callers(out, given, res))
    s, capturing = _stream(stream, device)
    res = _allocate(given, shapes, [act] * 4, backend, s, capturing, FORWARD)
    result = FFNForward(*_callers(out, given, res))
    T = x.size // D if D else 0
    if T == 0:
        return result
    key = LtKey(device, T, D, H, act, wt, act, b1 is not None, b2 is not None,
                precision=_fp32_precision(precision, act))
    inputs = [None if a is None else a.data.ptr for a in arrays]
    outs = (res[0].data.ptr, res[1].data.ptr, res[3].data.ptr)
    prepared = _Prepared(_forwards, key, LtForward, device, torch_in, _geometry(given), (FFNForward, 4),
                         lambda plan, sptr, cap, ready: plan.run(*inputs, outs, sptr, cap), "gelu_ffn_forward")
    if sig is not None and all(g is r for g, r in zip(given, res)):
        _remember(sig, prepared)
    _execute(prepared, s, capturing, None)
    return result


def _fill_on(stream, arrays):
    with stream:
        _nan_fill(arrays)


# ---------------------------------------------------------------------- backward
def backward(args, precision, out, stream, accumulate, need_grad_hidden, need_weight_grads, need_bias_grads,
             check_activations, grad_hidden_ready):
    """gelu_ffn_backward's route (see there): FFNGrads with grad_bias1 / grad_bias2 when need_bias_grads."""
    from .backward_plan import FFNGrads

    sig = None
    if not check_activations:
        sig = _signature(args, out, ("backward", precision, accumulate, need_grad_hidden, need_weight_grads,
                                     need_bias_grads))
        if sig is not None:
            prepared = _recent.get(sig)
            if prepared is not None:
                return _replay(prepared, out, stream, grad_hidden_ready)
    if args[5] is not None:
        raise ValueError("tanh_inner must be None with bfloat16/float16 activations or biases: these plans recompute "
                         "the GELU derivative from linear1_out inside GEMM1 (cuBLASLt's DGELU epilogue)")
    backend, arrays, device, torch_in = _import(args, INPUTS, stream)
    dy, x, w1, w2, z, _, g = arrays
    act, D, H, wt = _block(dy, "grad_output", w1, w2, precision)
    lead = tuple(dy.shape[:-1])
    _expect(x, "hidden_states", dy.shape, (act,))
    _expect(z, "linear1_out", lead + (H,), (act,))
    if g is not None:
        _expect(g, "gelu_out", lead + (H,), (act,))
    gpu = backend == "gpu"
    _layout(arrays, INPUTS, gpu, D, H, act)
    if grad_hidden_ready is not None and (not gpu or not need_grad_hidden):
        raise ValueError("grad_hidden_ready= needs GPU arrays and need_grad_hidden=True")
    if accumulate and out is None:
        raise ValueError("accumulate=True adds into out=: pass the gradients to add into")
    grads_dt = tuple({"float32", wt})
    shapes = (lead + (D,) if need_grad_hidden else None, (H, D) if need_weight_grads else None,
              (D, H) if need_weight_grads else None, (H,) if need_bias_grads else None,
              (D,) if need_bias_grads else None)
    dtypes = ((act,), grads_dt, grads_dt, grads_dt, grads_dt)
    given = _outputs(out, GRADS, shapes, dtypes, backend, device, stream, list(zip(INPUTS, arrays)),
                     (3, 5) if need_bias_grads else (3,))
    given += [None] * (5 - len(given))
    picked = {dtype_name(a) for a in given[1:] if a is not None}
    if len(picked) > 1:
        raise TypeError(f"the weight and bias gradients in out= must share one dtype; got {sorted(picked)}")
    gt = picked.pop() if picked else "float32"
    if accumulate:
        missing = [GRADS[i] for i in range(1, 5) if shapes[i] is not None and given[i] is None]
        if missing:
            raise ValueError(f"accumulate=True needs out= for {', '.join(missing)}")
    if check_activations and g is not None:
        _check(z, g, act, stream)
    if not gpu:
        res = _allocate(given, shapes, [act, gt, gt, gt, gt], backend, None, False, GRADS)
        _lt_cpu.backward(dy, x, w1, w2, z, g, act, res, accumulate, _fp32_precision(precision, act))
        return FFNGrads(*_callers(out, given, res))
    s, capturing = _stream(stream, device)
    res = _allocate(given, shapes, [act, gt, gt, gt, gt], backend, s, capturing, GRADS)
    T = dy.size // D if D else 0
    if T == 0:  # nothing to sum: weight and bias gradients are zero (or unchanged when accumulating)
        if not accumulate:
            with s:
                for a in res[1:]:
                    if a is not None:
                        a.fill(0)
        return FFNGrads(*_callers(out, given, res))
    key = LtKey(device, T, D, H, act, wt, gt, need_bias_grads, need_bias_grads, need_grad_hidden, need_weight_grads,
                g is None, _fp32_precision(precision, act))
    ptrs = {n: (None if a is None else a.data.ptr) for n, a in zip(INPUTS, arrays)}
    outs = {n: (None if a is None else a.data.ptr) for n, a in zip(GRADS, res)}
    result = FFNGrads(*_callers(out, given, res))
    prepared = _Prepared(_backwards, key, LtBackward, device, torch_in, _geometry(given), (None, 5),
                         lambda plan, sptr, cap, ready: plan.run(ptrs, outs, sptr, cap, accumulate, ready),
                         "gelu_ffn_backward")
    if sig is not None and all(g is r for g, r in zip(given, res)):  # every output the caller's: replayable
        _remember(sig, prepared)
    _execute(prepared, s, capturing, grad_hidden_ready)
    return result


def _check(z, g, act, stream):
    """check_activations for 16-bit (or fp32) gelu_out: judged at two units of its dtype's rounding."""
    rows, cols = _checks.positions(z.size, z.shape[-1])
    z2, g2 = z.reshape(-1, z.shape[-1]), g.reshape(-1, g.shape[-1])
    if isinstance(z, numpy.ndarray):
        zs, gs = z2[rows, cols], g2[rows, cols]
    else:
        import cupy

        with (stream if stream is not None else contextlib.nullcontext()):
            r, c = cupy.asarray(rows), cupy.asarray(cols)
            zs, gs = cupy.asnumpy(z2[r, c]), cupy.asnumpy(g2[r, c])
    eps = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}[act]
    _checks.judge(zs.astype(numpy.float64), None, gs.astype(numpy.float64), atol=1e-5, rtol=4 * eps)
