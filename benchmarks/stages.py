"""The benchmark's stage table: the GPU time of each stage of one float32 backward call, every step serialized
(bench.py's per-stage profile and the dev/ tools that read it; docs/architecture.md, "The stages of a GPU call").
A measurement of the plan's own engine, kept out of the product's classes: it walks the engine's stage graph
(cupyffn/f32/schedule.py) with an event after each stage."""

import math

import numpy

from cupyffn.api import functional, routes
from cupyffn.api.validate import Request
from cupyffn.f32.layout import ROWS_COLS


def profile(plan, *arrays, out, stream=None, reps=5, before_each=None):
    """GPU time of each stage of one call of GeluFFNBackward `plan`.

    Runs the call once the ordinary way (so `arrays` and `out` are validated as usual), then `reps` more times with
    every step serialized on `stream` and an event after each step; `before_each()`, if given, is called (on
    `stream`) before each rep, e.g. to flush the L2. Serialized steps do not overlap, so their sum exceeds an
    ordinary call's time at small T. Returns ``{stage: {"ms": median ms, "bytes": bytes moved}}`` in issue order;
    "bytes" only for memory-bound stages; a stage issued twice in one call gets " #2" (the fp16 rescue launches).
    GPU plans only; `out` (every output: three, five with need_bias_grads) receives the results, as in an ordinary
    call."""
    engine = plan.engine
    if engine is None:
        raise RuntimeError("the stage profile needs a GPU plan; a device='cpu' plan has no GPU stages")
    n = 5 if plan.need_bias_grads else 3
    if out is None or len(out) != n or any(o is None for o in out):
        raise ValueError(f"the stage profile needs out= with all {n} output arrays")
    if isinstance(reps, bool) or not isinstance(reps, (int, numpy.integer)) or reps < 1:
        raise ValueError(f"reps must be an integer >= 1; got {reps!r}")
    import cupy

    s = stream if stream is not None else cupy.cuda.get_current_stream()
    if engine.closed:
        raise RuntimeError("this GeluFFNBackward plan was closed")
    # the ordinary call, without graphs (EAGER), binds the launches to these very arrays
    request = Request("backward", plan.precision.name, plan.need_grad_hidden, plan.need_weight_grads,
                      plan.need_bias_grads)
    functional.run(request, arrays, out, s, plan=plan, graphs=routes.EAGER)
    with engine.lock:  # no ordinary call of this plan interleaves with the serialized ones
        if engine.closed:  # closed by another thread since the call above: its scratch is being freed
            raise RuntimeError("this GeluFFNBackward plan was closed")
        samples = time_stages(engine, s, reps, before_each)  # the engine's stage graph, serialized
    nbytes = stage_bytes(engine.stage, engine.plan)
    result = {}
    for stage, values in samples.items():
        row = {"ms": float(numpy.median(values))}
        if stage in nbytes:
            row["bytes"] = nbytes[stage]
        result[stage] = row
    return result


def stage_bytes(stage, plan):
    """Bytes each memory-bound stage of `stage` (a StageContext of `plan`) moves (for GB/s in the benchmark)."""
    out = {}
    layout = plan.layout
    for name, (names, _, _) in stage.convert.items():
        out[name] = sum(4 * math.prod(plan.dims(ROWS_COLS[n])) + layout.written(n) for n in names)
    write = layout.written("grad_linear1") if plan.planes else 4 * plan.T * plan.H
    if not plan.fused_gemm1:
        out["dgelu"] = 12 * plan.T * plan.H + write
    return out


def time_stages(engine, stream, reps, before_each=None):
    """GPU time of each stage (`Step.stage`) of `reps` calls of `engine` with every step serialized on `stream`
    (StageRunner.enqueue(serial=True), an event after each stage): {stage: [ms per rep]} in issue order; a stage
    issued twice in one call gets " #2" (the fp16 rescue launches). `before_each()`, if given, is called (on
    `stream`) before each rep, e.g. to flush the L2. The caller holds the plan's lock."""
    import cupy

    s = stream
    samples = {}
    for _ in range(int(reps)):
        if before_each is not None:
            with s:
                before_each()
        events = [(None, cupy.cuda.Event())]
        events[0][1].record(s)

        def mark(stage):
            ev = cupy.cuda.Event()
            ev.record(s)
            events.append((stage, ev))

        engine.order_after_previous(s.ptr)
        engine.enqueue(s.ptr, serial=True, mark=mark)
        engine.record_done(s.ptr)
        s.synchronize()
        seen = {}
        for (_, a), (stage, b) in zip(events, events[1:]):
            seen[stage] = seen.get(stage, 0) + 1
            key = stage if seen[stage] == 1 else f"{stage} #{seen[stage]}"
            samples.setdefault(key, []).append(cupy.cuda.get_elapsed_time(a, b))
    return samples
