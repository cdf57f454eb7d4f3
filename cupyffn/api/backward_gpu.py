"""The GPU call of a backward plan (`GeluFFNBackward`, cupyffn/_backward_plan.py): under the plan's lock, the
capture query, the outputs, the engine's ordering, `set_io` and one of five routes (the engine's `enqueue`, its call
graph `launch_graph`, the graph captured for a repeated set of arrays, a `graph=True` plan's replay, or everything
serialized on the caller's stream while a caller's capture holds the side stream; docs/architecture.md), and the
NaN fill of `out=` after a failure."""

import contextlib

import numpy

from ..core import arrays as _arrays, plans as _plan_cache
from . import validate as _validate


def run(plan, call, out, stream, accumulate, ready=None):
    """The GPU call of `plan` (a GeluFFNBackward with an engine): the results to return (module docstring)."""
    import cupy

    engine = plan._engine
    if cupy.cuda.runtime.getDevice() == plan.device:  # the common case: no context switch needed
        device = contextlib.nullcontext()
    else:
        device = cupy.cuda.Device(plan.device)
    with device:
        s = stream if stream is not None else cupy.cuda.get_current_stream()
        sp = s.ptr
        # Under a caller's capture: no allocation, no host synchronization, no event from outside
        # the capture (so no order_after_previous: ordering the graph's replays with earlier eager
        # calls is the caller's business), and _ev_done is not recorded (close() synchronizes on it).
        # The engine's own fork/join to its side stream is captured as graph edges.
        capturing = _plan_cache.is_capturing(sp)
        with plan._lock:
            if plan._closed:
                raise closed_error()
            if capturing:
                _check_capturable(plan, call)
            results, pointers = _outputs(plan, call, out, s)
            if plan.tokens == 0:
                if ready:  # grad_hidden_states is empty: ready at once, in stream order
                    cupy.cuda.runtime.eventRecord(ready, sp)
                with s:
                    for r in results[1:]:
                        if r is not None and not accumulate:
                            _as_cupy(r).fill(0)
                return results
            io = (call.inputs, tuple(pointers), bool(accumulate))
            if capturing:
                _plan_cache.pin(plan)  # from now on a graph may replay this plan's scratch
            else:
                engine.order_after_previous(sp)
            try:
                # where the plan runs a call graph, arrays seen before replay the graph captured for them, with no
                # launch re-pointed (cupyffn/_graph_replay.py; docs/decisions/052-io-graphs.md)
                replays = engine.call_graph and not ready and not capturing and not plan.graph
                graph = engine.io_graphs.graph(io) if replays else None
                if graph is not None:
                    engine.io_graphs.launch(graph, sp)
                else:
                    _enqueue(plan, call, io, pointers, accumulate, s, capturing, ready, replays)
            except BaseException as e:
                if capturing:  # no NaN fill: it would be captured too; the caller must discard the capture
                    raise
                error = _plan_cache.fill_nan_after_failure(e, lambda: _after_failure(plan, call, s))
                if error is e:
                    raise
                raise error from e
            if not capturing:
                engine.record_done(sp)
    return results


def _enqueue(plan, call, io, pointers, accumulate, s, capturing, ready, replays):
    """The call's launches pointed at its arrays (if the last call's were others), then one of the routes (module
    docstring). `replays`: the call-graph route, through the plan's graphs per set of arrays."""
    engine, sp = plan._engine, s.ptr
    if io != plan._io:
        plan._io = None  # half-set launches must not be taken for this call's
        engine.set_io(call.inputs, pointers, accumulate)
        plan._io = io
    if capturing:
        if engine.side_in_capture and engine.side_capture_stream != sp and not engine.side_stream_free():
            # another capture, still open, holds the side stream: this one stays on its stream
            engine.enqueue(sp, serial=True, grad_hidden_ready=ready)
        else:
            engine.side_in_capture, engine.side_capture_stream = True, sp
            engine.enqueue(sp, grad_hidden_ready=ready)
    elif engine.side_in_capture and not engine.side_stream_free():
        engine.enqueue(sp, serial=True, grad_hidden_ready=ready)  # all on the caller's stream
    elif plan.graph:
        _replay_or_capture(plan, io, s)
    elif replays:  # the re-pointed call graph the first time these arrays come; a graph of them the second
        engine.io_graphs.run(io, lambda stream, captured: engine.enqueue(stream) if captured
                             else engine.launch_graph(stream), sp)
    else:
        engine.enqueue(sp, grad_hidden_ready=ready)


def _check_capturable(plan, call):
    """Raise, before anything is enqueued, if this call would have to allocate during capture."""
    owned = plan._owned_out if plan.graph and plan._owned_out else None
    names = [n for i, (n, need) in enumerate(zip(_validate.OUTPUT_NAMES + _validate.BIAS_NAMES, _needed(plan)))
             if need and call.out[i] is None and not (owned and owned[i] is not None)]
    if names:
        raise RuntimeError(
            f"cupyffn: gelu_ffn_backward was called during CUDA stream capture without out= for "
            f"{', '.join(names)}: allocating from CuPy's memory pool inside a capture would tie that "
            f"memory to the graph with nothing keeping it alive. Pass every output in out=")
    if plan._engine.allocates_for(call.inputs):
        raise RuntimeError(
            "cupyffn: gelu_ffn_backward was called during CUDA stream capture, but this plan has not "
            "yet run in memory mode (gelu_out=None) and would allocate its buffer; call it once with "
            "the same arguments outside the capture first")


def _after_failure(plan, call, stream):
    """Mark the failed call's work done (close() waits for it) and NaN-fill the caller's out= arrays."""
    plan._engine.record_done(stream.ptr)
    _poison(call, stream)


def _outputs(plan, call, out, stream):
    """(results to return, device pointers to write): the caller's out= objects, else new (or plan-owned) arrays."""
    import cupy

    shapes = _validate.output_shapes(call.lead_shape, plan.dim, plan.hidden_dim)
    needed = _needed(plan)
    if plan.graph and plan._owned_out is None:
        plan._owned_out = [None] * len(needed)
    results, pointers = [], []
    for i, (shape, need) in enumerate(zip(shapes, needed)):
        if not need:
            results.append(None)
            pointers.append(0)
        elif call.out[i] is not None:
            results.append(out[i])
            pointers.append(call.out[i].ptr)
        else:
            if plan.graph and plan._owned_out[i] is not None:
                array = plan._owned_out[i]
            else:
                array = _allocate(cupy, shape, stream)
                if plan.graph:
                    plan._owned_out[i] = array
            results.append(array)
            pointers.append(array.data.ptr)
    return results, pointers


def _needed(plan):
    return _validate.needed_outputs(plan.need_grad_hidden, plan.need_weight_grads, plan.need_bias_grads)


def _replay_or_capture(plan, key, stream):
    graph = plan._graphs.get(key)
    if graph is not None:
        plan._graphs.move_to_end(key)
        graph.launch(stream=stream)
        return
    import cupy

    engine = plan._engine
    engine.enqueue(stream.ptr)  # this call's results, the ordinary way
    if plan._capture_stream is None:
        plan._capture_stream = cupy.cuda.Stream(non_blocking=True)
    cs = plan._capture_stream
    cs.begin_capture()
    try:
        engine.enqueue(cs.ptr)
    except BaseException:
        cs.end_capture()  # leave the stream usable; the graph is discarded
        raise
    graph = cs.end_capture()
    graph.upload(stream=stream)
    plan._graphs[key] = graph
    while len(plan._graphs) > 4:
        plan._graphs.popitem(last=False)


def _allocate(cupy, shape, stream):
    try:
        with stream:
            return cupy.empty(shape, dtype=cupy.float32)
    except cupy.cuda.memory.OutOfMemoryError as e:
        nbytes = 4 * int(numpy.prod(shape))
        raise MemoryError(f"cupyffn could not allocate an output of shape {shape} ({nbytes} bytes): {e}") from None


def _as_cupy(array):
    import cupy

    return array if isinstance(array, cupy.ndarray) else cupy.from_dlpack(array)


def _poison(call, stream):
    """After a failure mid-call, fill the caller's out= arrays with NaN so no stale or partial value
    passes (with accumulate=True too: a partial accumulation cannot be undone)."""
    with stream:
        for array, m in zip(call.out_arrays, call.out):
            if m is not None:
                _arrays.view2d(array, m).fill(numpy.nan)


def closed_error():
    return RuntimeError("this GeluFFNBackward plan was closed")


def stream_ptr(stream, device):
    import cupy

    if stream is not None:
        return stream.ptr
    with cupy.cuda.Device(device):
        return cupy.cuda.get_current_stream().ptr
