"""What the tools' GPU benches share (convert_bench, split_bench, gemm_forms_bench): integer-list arguments, and a
base for their Bench: a non-blocking stream, the L2 flush (a memset of twice the L2, as the benchmark flushes), the
device description their JSON starts with, and the median time of a call by CUDA events after a flush. cupy is
imported only when a Bench is made (a tool must import without it)."""

import datetime
import statistics


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
        """A snapshot of the fp16 scale `state` (a device array) once a first gathering pass of `launch` has decided
        the exponents (run_once(launch, snapshot): from the state as it is) and a second has settled them (nothing
        moves any more): what every candidate then starts from."""
        with self.stream:
            start = state.copy()
        run_once(launch, start)
        launch(self.stream.ptr)
        self.stream.synchronize()
        with self.stream:
            return state.copy()

    def median_ms(self, run):
        """Median ms of `run()` (enqueued on self.stream) over args.reps samples after args.warmup unflushed calls,
        the L2 flushed before each sample, events around the call only."""
        cupy = self.cupy
        runtime = cupy.cuda.runtime
        for _ in range(self.args.warmup):
            run()
        events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(self.args.reps)]
        for start, end in events:
            runtime.memsetAsync(self.flush_buf.data.ptr, 0, self.flush_bytes, self.stream.ptr)
            start.record(self.stream)
            run()
            end.record(self.stream)
        self.stream.synchronize()
        return statistics.median(cupy.cuda.get_elapsed_time(s, e) for s, e in events)
