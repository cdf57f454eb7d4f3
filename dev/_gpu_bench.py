"""What the tools' GPU benches share (convert_bench, split_bench, gemm_forms_bench): integer-list arguments, and a
base for their Bench: a non-blocking stream, the L2 flush (a memset of twice the L2, as the benchmark flushes), the
device description their JSON starts with, and the median time of a call by CUDA events after a flush. cupy is
imported only when a Bench is made (a tool must import without it)."""

import datetime

from _event_timing import flushed_median_ms_batched  # dev/ (the script's folder is on sys.path)


def int_list(text, name, parser):
    """Comma-separated positive integers of argument `name`, or parser.error."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        parser.error(f"{name} must be comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        parser.error(f"{name} must list positive integers, got {text!r}")
    return values


class GpuBench:
    """self.cupy, args (with reps and warmup), device, stream, props, flush_bytes and flush_buf."""

    def __init__(self, args):
        import cupy

        self.cupy = cupy
        self.args = args
        self.device = cupy.cuda.Device()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.props = cupy.cuda.runtime.getDeviceProperties(self.device.id)
        self.flush_bytes = 2 * int(self.props["l2CacheSize"])
        with self.stream:
            self.flush_buf = cupy.empty(self.flush_bytes, dtype=cupy.uint8)

    def device_info(self, **extra):
        """The device, versions, date and protocol fields of a result, then `extra`."""
        cupy = self.cupy
        name = self.props["name"]
        return dict(device=name.decode() if isinstance(name, bytes) else str(name),
                    cc=f"{self.props['major']}.{self.props['minor']}", driver=cupy.cuda.runtime.driverGetVersion(),
                    runtime=cupy.cuda.runtime.runtimeGetVersion(), cupy_version=cupy.__version__,
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    l2_flush_bytes=self.flush_bytes, reps=self.args.reps, warmup=self.args.warmup, **extra)

    def settled_state(self, state, launch, run_once):
        """A copy of the fp16 scale `state` (a device array) after two gathering passes of `launch`: the first
        (run_once(launch, state as it is now)) decides the exponents, the second settles them, so that nothing moves
        any more. Every candidate then starts from that copy."""
        with self.stream:
            start = state.copy()
        run_once(launch, start)
        launch(self.stream.ptr)
        self.stream.synchronize()
        with self.stream:
            return state.copy()

    def median_ms(self, run):
        """Median ms of `run()` (enqueued on self.stream) over args.reps samples after args.warmup unflushed calls,
        the L2 flushed (a memset of flush_buf) before each sample, events around the call only
        (_event_timing.flushed_median_ms_batched)."""
        runtime = self.cupy.cuda.runtime

        def flush():
            runtime.memsetAsync(self.flush_buf.data.ptr, 0, self.flush_bytes, self.stream.ptr)
        return flushed_median_ms_batched(self.cupy, self.stream, run, flush, self.args.reps, self.args.warmup)
