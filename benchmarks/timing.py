"""The one CUDA-event timing of a GPU call outside bench.py's protocol (which is protocol.Timer: CUPTI spans,
rotated inputs, flushed warm-ups), used by benchmarks/accuracy.py and the dev/ tools (dev/README.md): warm-ups,
then per sample an optional L2 flush, an event before and after the call on `stream`; the median in ms.

flushed_median_ms waits for each sample before enqueuing the next; flushed_median_ms_batched enqueues all samples,
then waits once. host_median_us is the other clock: the host's time to issue a call, the device drained before each. `cupy` is passed in, so that a module using this imports cupy only when it runs (the dev/ tools
load without it: tests/tool_loader.py).
"""

import statistics
import time


def flushed_median_ms(cupy, stream, run, flush, reps, warmup):
    """Median ms of `run()` over `reps` samples after `warmup` unflushed calls, everything enqueued inside
    `with stream`; `flush()` (enqueued on `stream`, outside the events) before each sample, or no flush when
    `flush` is None. Each sample's stop event is waited for before the next sample is enqueued."""
    with stream:
        for _ in range(warmup):
            run()
        samples = []
        for _ in range(reps):
            if flush is not None:
                flush()
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            run()
            stop.record(stream)
            stop.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(samples)


def flushed_median_ms_batched(cupy, stream, run, flush, reps, warmup):
    """flushed_median_ms with every sample enqueued before the one wait at the end (the host stays ahead of the GPU:
    no sample waits for the host's enqueue of the next). `run` and `flush` enqueue on `stream` themselves (no
    `with stream` here)."""
    for _ in range(warmup):
        run()
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(reps)]
    for start, stop in events:
        if flush is not None:
            flush()
        start.record(stream)
        run()
        stop.record(stream)
    stream.synchronize()
    return statistics.median(cupy.cuda.get_elapsed_time(s, e) for s, e in events)


def host_median_us(run, calls, synchronize, warmup=10):
    """Median host microseconds of `run()` over `calls` calls after `warmup` more, `synchronize()` (the device's, e.g.
    torch.cuda.synchronize) before each, so each call's time is its own host work and not a wait for the queue."""
    times = []
    for _ in range(calls + warmup):
        synchronize()
        t0 = time.perf_counter()
        run()
        times.append(1e6 * (time.perf_counter() - t0))
    return statistics.median(times[warmup:])
