"""The tools' one way of timing a GPU call by CUDA events: warm-ups, then per sample the L2 flush, an event
before and after the call on `stream`, a wait for the second; the median in ms."""

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
