"""The one executor: a validated Call and its Route in (cupyffn/api/routes.py); the engine taken from its plan cache (or
the plan's own), the outputs allocated (or the caller's out=), the engine bound and run along the route, the results
out. Every entry point ends here (cupyffn/api/functional.py for the functions and for plans).

The call's context is computed once, here: its stream, whether that stream is capturing a CUDA graph, and the wait on
torch's stream where the call has torch tensors. GPU, under the engine's lock: under a caller's capture no
allocation, no host synchronization and no event from outside the capture (the engine is pinned: a graph may replay
its scratch); otherwise ordering after the engine's previous call (cupyffn/cuda/stream_engine.py). Then, by the
route's graph policy: into the caller's capture; all on the caller's stream while a capture holds the side stream;
the graph of this set of arrays (cupyffn/cuda/graph_cache.py), captured once the policy has seen it often enough; or
the engine's eager call. After a failure (not under capture) the caller's out= arrays are NaN-filled, so no stale or
partial value passes; the engine's "done" event is recorded also then, so close() waits for the partial work.
"""

import contextlib
import math

import numpy

from ..core import arrays as _arrays
from ..core import checks as _checks
from ..core import plans as _plans
from ..core.plans import EngineCache
from ..core.results import FFNForward, FFNGrads, Outputs
from ..core.views import numpy_dtype
from .no_tokens import fill
from .routes import GRAPH_PLAN
from .validate import outputs_of

#: engines kept per (engine, pass): a plan per shape and configuration, least recently used evicted
CACHE_SIZE = 4
_caches = {}  # (route.engine, "forward" | "backward") -> EngineCache


def clear_engines():
    """Drop the cached engines (waiting for their last calls; their device memory goes back to CuPy's pool). Engines
    captured into a CUDA graph stay (``release_captured_plans``); those in use by another thread close when their
    call ends."""
    for cache in _caches.values():
        cache.clear()


def engine_cache(engine, kind):
    """The EngineCache of `engine` ("float32", "lt") running `kind` ("forward", "backward")."""
    cache = _caches.get((engine, kind))
    if cache is None:
        cache = _caches.setdefault((engine, kind), EngineCache(CACHE_SIZE))
    return cache


# ---------------------------------------------------------------------- outputs
def outputs(call, out, stream=None, capturing=False, owned=None, what="cupyffn"):
    """(results for the caller, the outputs as arrays (None where not computed)): the caller's out= object where it
    gave one, else a new array (NumPy on the CPU; CuPy on `stream` on a GPU), or the plan's own (`owned`: a list a
    graph=True plan keeps its outputs in)."""
    shapes, dtypes, computed = call.output_shapes, call.output_dtypes, call.computed
    results, arrays, missing = [], [], []
    for i, given in enumerate(call.out):
        if not computed[i]:
            results.append(None)
            arrays.append(None)
        elif given is not None:
            results.append(out[i])
            arrays.append(call.out_arrays[i])
        elif owned is not None and owned[i] is not None:
            results.append(owned[i])
            arrays.append(owned[i])
        else:
            missing.append(i)
            results.append(None)
            arrays.append(None)
    if missing and capturing:
        names = ", ".join(outputs_of(call.kind)[i] for i in missing)
        raise RuntimeError(f"cupyffn: {what} was called during CUDA stream capture without out= for {names}: "
                           f"allocating from CuPy's memory pool inside a capture would tie that memory to the graph "
                           f"with nothing keeping it alive. Pass every output in out=")
    for i in missing:
        if _stored_transposed(call, i):  # the weight gradients as the weights are stored: [in, out]
            a = _allocate(call, shapes[i][::-1], dtypes[i], stream).T
        else:
            a = _allocate(call, shapes[i], dtypes[i], stream)
        results[i] = arrays[i] = a
        if owned is not None:
            owned[i] = a
    return results, arrays


def _stored_transposed(call, i):
    return call.grads_transposed and call.kind == "backward" and i in (1, 2)


def _allocate(call, shape, dtype, stream):
    if call.backend == "cpu":
        return numpy.empty(shape, numpy_dtype(dtype))
    import cupy

    try:
        with cupy.cuda.Device(call.device), stream:
            return cupy.empty(shape, dtype=numpy_dtype(dtype))
    except cupy.cuda.memory.OutOfMemoryError as e:
        nbytes = numpy_dtype(dtype).itemsize * math.prod(shape)
        raise MemoryError(f"cupyffn could not allocate an output of shape {shape} ({nbytes} bytes): {e}") from None


def _pointers(call, arrays):
    """The outputs' addresses (0 where not computed): the validated out= entries', and the arrays allocated (their
    storage's: a transposed view starts where its storage does)."""
    return tuple(0 if a is None else _arrays.data_ptr(a) if m is None else m.ptr for m, a in zip(call.out, arrays))


# ---------------------------------------------------------------------- running
def run(call, route, out, stream=None, check_activations=False, plan=None):
    """Run `call` (validated) along `route`; returns the results (module docstring). `plan`: the GeluFFNBackward the
    call is made through (its own engine and, graph=True, the outputs it owns; pinned instead of the engine under a
    caller's capture)."""
    what = "gelu_ffn_forward" if call.kind == "forward" else "gelu_ffn_backward"
    if call.backend == "cpu":
        if check_activations:
            _checks.check(call, None)
        results, arrays = outputs(call, out, what=what)
        _run_cpu(call, route.build(route.key), arrays)
    else:
        results = _run_on_device(call, route, out, stream, check_activations, plan, what)
    return (FFNForward if call.kind == "forward" else FFNGrads)(*results)


def _run_on_device(call, route, out, stream, check_activations, plan, what):
    import cupy

    device = contextlib.nullcontext() if cupy.cuda.runtime.getDevice() == call.device else \
        cupy.cuda.Device(call.device)
    with device:
        s = stream if stream is not None else cupy.cuda.get_current_stream()
        capturing = _plans.is_capturing(s.ptr)
        if call.follow is not None:
            _arrays.follow_torch(call.follow, s, capturing)
        if check_activations:
            if capturing:
                raise ValueError("check_activations=True synchronizes with the stream, which CUDA stream capture "
                                 "does not allow: check once before capturing")
            _checks.check(call, s)
        if call.ready and route.graphs is GRAPH_PLAN:
            raise ValueError("grad_hidden_ready= is not supported by graph=True plans (a replayed graph records the "
                             "events it was captured with); capture the call in your own graph instead")
        if route.key is None and route.build is not None:  # an engine of its own per call (T = 0): nothing kept
            results, arrays = outputs(call, out, s, capturing, what=what)
            engine = route.build(None)
            engine.bind(call, Outputs(arrays, _pointers(call, arrays)))
            engine.enqueue(s.ptr, ready=call.ready)
            return results
        if plan is not None:
            results, arrays = outputs(call, out, s, capturing, plan.owned_outputs, what)
            _run_gpu(call, route, plan.engine, arrays, s, capturing, plan)
            return results
        cache = engine_cache(route.engine, call.kind)
        engine = cache.acquire(route.key)
        if engine is None:
            if capturing:  # building allocates and zero-fills
                raise RuntimeError(f"cupyffn: {what} was called during CUDA stream capture but no plan exists for "
                                   f"this shape/precision; call it once outside the capture first (on any stream)")
            engine = cache.acquire(route.key, lambda: route.build(route.key))
        try:
            results, arrays = outputs(call, out, s, capturing, what=what)
            _run_gpu(call, route, engine, arrays, s, capturing)
        finally:
            cache.release(engine)
    return results


def _run_cpu(call, engine, arrays):
    try:
        engine.bind(call, Outputs(arrays, _pointers(call, arrays)))
        engine.enqueue()
    except BaseException:
        for a, given in zip(arrays, call.out):
            if given is not None:
                a[...] = numpy.nan  # as on the GPU: never leave partial results in the caller's arrays
        raise


def _run_gpu(call, route, engine, arrays, stream, capturing, owner=None):
    sp = stream.ptr
    bound = Outputs(arrays, _pointers(call, arrays))
    with engine.lock:
        if engine.closed:
            raise RuntimeError(f"this {engine.what} was closed")
        if capturing:
            if engine.allocates_for(call):
                raise RuntimeError("cupyffn was called during CUDA stream capture, but this plan has not yet run in "
                                   "memory mode (gelu_out=None) and would allocate its buffer; call it once with the "
                                   "same arguments outside the capture first")
            _plans.pin(engine if owner is None else owner)  # from now on a graph may replay this engine's scratch
        else:
            engine.order_after_previous(sp)
        try:
            _issue(call, route, engine, bound, sp, capturing)
        except BaseException as e:
            if capturing:  # no NaN fill: it would be captured too; the caller must discard the capture
                raise
            error = _plans.fill_nan_after_failure(e, lambda: _poison(call, stream))
            if error is e:
                raise
            raise error from e
        finally:
            if not capturing:
                engine.record_done(sp)


def _issue(call, route, engine, bound, sp, capturing):
    """The call's work on `sp` by the route's graph policy (module docstring); `bound`: the Outputs."""
    ready = call.ready
    io = engine.io_key(call, bound)
    cache = engine.graph_cache(route.graphs)
    graphs = cache is not None and not capturing and not ready  # a replayed graph records no event of the caller's
    if graphs:
        graph = cache.graph(io)
        if graph is not None:  # nothing to bind or re-point: the graph holds this set of arrays
            cache.launch(graph, sp)
            return
    if capturing:
        serial = engine.serial_in_capture(sp)
        engine.bind_once(call, bound, io)
        engine.enqueue(sp, serial=serial, ready=ready)
        return
    # bound here, outside any capture of cupyffn's own: binding may allocate on first use (ieee's memory mode)
    engine.bind_once(call, bound, io)
    if not engine.side_stream_free():  # a caller's capture still holds the side stream
        engine.enqueue(sp, serial=True, ready=ready)
    elif not graphs:
        engine.eager(sp, ready)
    else:
        cache.run(io, lambda stream_ptr, captured: engine.enqueue(stream_ptr) if captured else
                  engine.eager(stream_ptr), sp)


# ---------------------------------------------------------------------- after a failure
def _poison(call, stream):
    """Fill the caller's out= arrays with NaN on `stream` (with accumulate=True too: a partial accumulation cannot be
    undone)."""
    for a, m in zip(call.out_arrays, call.out):
        if m is not None:
            fill(_arrays.view2d(a, m), stream, numpy.nan)
