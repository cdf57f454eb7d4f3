"""The tools' way of timing a GPU call by CUDA events: warm-ups, then per sample the L2 flush, an event before and
after the call on `stream`; the median in ms. flushed_median_ms waits for each sample before enqueuing the next;
flushed_median_ms_batched (the GPU benches of dev/_gpu_bench.py) enqueues all samples, then waits once."""

import statistics


def flushed_median_ms(cupy, stream, run, flush, reps, warmup):
    """Median ms of `run()` over `reps` samples after `warmup` unflushed calls; `flush()` (enqueued on `stream`,
    outside the events) before each sample. `cupy` is passed in so that the tools import it only when they run."""
    with stream:
        for _ in range(warmup):
            run()
        samples = []
        for _ in range(reps):
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
    no sample waits for the host's enqueue of the next)."""
    for _ in range(warmup):
        run()
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(reps)]
    for start, stop in events:
        flush()
        start.record(stream)
        run()
        stop.record(stream)
    stream.synchronize()
    return statistics.median(cupy.cuda.get_elapsed_time(s, e) for s, e in events)
