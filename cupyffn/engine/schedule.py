"""The stage graph of one backward call as data (`stages`: a tuple of `Step`), its two-stream executor
(`Executor.enqueue`), the call graph's capture and replay (`Executor.launch_graph`), and the per-stage timing
that the benchmark's stage table walks through the same steps (`time_stages`).

Work of one call (S = the caller's stream, S2 = the engine's side stream):

    S : convert A ─┬─► GEMM1 grad_gelu ──► dgelu ──┬─► GEMM3 grad_hidden ───────► join
                   │                     ▲         │                                ▲
    S2: convert B ─┴─► GEMM2 grad_weight2 ┘(B)      └─► GEMM4 grad_weight1 ─────────┘

(With bias gradients, S2 sums grad_output's columns into grad_bias2 and adds the rows of column sums the dgelu
pass left into grad_bias1 once dgelu is done (D), beside GEMM3 and before GEMM4: bandwidth-bound work beside a
compute-bound GEMM. At the start of S2 it was on the critical path of the lean layout, where S waits for GEMM2.)

`convert A` writes the operands of GEMM1 (grad_output, weight2) and `convert B` those of the rest
(gelu_out, hidden_states, weight1), each in one launch (tf32 at T <= 512: both in one launch on S,
CONVERT_AB_TOKENS); `dgelu` reads grad_gelu, linear1_out and tanh_inner once and writes grad_linear1 straight in
the format of GEMM3/GEMM4. GEMM1 and GEMM2, and GEMM3 and GEMM4, are independent: at small T, where one GEMM
leaves most of the GPU idle, they run side by side (docs/decisions/013-two-streams.md). Where the sm90 kernel
fuses GEMM1 and dgelu (cupyffn/engine/plan.py), GEMM1 + dgelu is one launch, then a one-thread scale decision and a
rescue launch; in memory mode with gelu_out formed in that epilogue, GEMM2 waits for the rescue launch:

    S : convert A ──► GEMM1 + dgelu + gelu_out ──► decide, rescue ──┬─► GEMM3 ──────────────────► join
    S2: convert B (hidden_states, weight1) ──────────────(B)─┘      └─► GEMM2 ──► GEMM4 ─────────┘

The lean layout (cupyffn/engine/layout.py): S waits for GEMM2 before dgelu, converts weight1 and hidden_states
after it ("convert late") and runs GEMM4 itself. With `serial=True` (a caller's capture holding the side stream,
or the per-stage profile) every step runs on S in this order and no event is waited on or recorded.
"""

import ctypes
import math
import weakref
from typing import NamedTuple

from ..cuda import kernels as _kernels
from ..core import precision as P
from ..cuda import call_graph as _call_graph
from .layout import ROWS_COLS

#: The events of a call: after the fork, after convert A, after convert B, after the step that finishes
#: grad_linear1, and S2's last work (the join; also the lean layout's wait for GEMM2).
EVENTS = ("start", "A", "B", "D", "side")


class Gemm(NamedTuple):
    """A step's GEMM: gemm1..gemm4 by index (the call table's entry), on the handle of the step's stream."""

    index: int


class Step(NamedTuple):
    """One step of the stage graph: on `stream` ("S" or "S2"), wait for `waits` (names in EVENTS), run `run` (our
    kernel launches, or a Gemm) in order, record grad_hidden_ready if `ready`, mark `stage` (the name of the
    stage table's row; None: not a row of its own), then record `records`."""

    stream: str
    run: tuple = ()
    stage: str = None
    waits: tuple = ()
    records: tuple = ()
    ready: bool = False


#: Before a call's steps: S2 forks from S.
FORK = (Step("S", records=("start",)), Step("S2", waits=("start",)))
#: After them, also on failure (nothing of this call may land after the caller's error handling): S joins S2.
JOIN = (Step("S2", records=("side",)), Step("S", waits=("side",)))


def stages(engine):
    """The steps of a call of `engine` in its current mode (GpuEngine._select_mode: its convert and fused launches,
    cvt_b, gelu_in_gemm1; whether ieee memory mode recomputes gelu_out), in issue order."""
    e = engine
    steps = []

    def convert(stage, stream):
        if stage in e._convert:
            _, first, rescue = e._convert[stage]
            steps.append(Step(stream, (first,), stage))
            if rescue is not None:
                steps.append(Step(stream, (rescue,), "f16 rescue"))

    convert("convert A", "S")
    steps.append(Step("S", records=("A",)))
    # convert B's rescue writes alpha2, which needs grad_output's scale (with gelu_in_gemm1 it writes no alpha;
    # convert B still follows A, which GEMM1 waits for, rather than halve A's bandwidth)
    s2_after_a = e.fmt in (P.FMT_F16S, P.FMT_F16E4M3) and bool(e.cvt_b)
    if s2_after_a:
        steps.append(Step("S2", waits=("A",)))
    convert("convert B", "S2")
    if e._recompute_g and e._ieee_gelu is not None:
        steps.append(Step("S2", (e._ieee_gelu[1],), "gelu_out (recomputed)"))
    steps.append(Step("S2", records=("B",)))
    if e.fused_gemm1:
        steps.append(Step("S", (e._fused,), "GEMM1 + dgelu (sm90 fused)"))
    else:
        steps.append(Step("S", (Gemm(0),), "GEMM1 grad_gelu"))
    if e.gemm2 is not None and not e.gelu_in_gemm1:
        # grad_output converted (S2 already waits for it where convert B did)
        steps.append(Step("S2", (Gemm(1),), "GEMM2 grad_weight2", waits=() if s2_after_a else ("A",)))
    if e.lean:
        steps.append(Step("S2", records=("side",)))
        steps.append(Step("S", waits=("side",)))  # grad_linear1 overwrites the planes GEMM2 reads
    steps.append(Step("S", waits=("B",)))  # weight1 / hidden_states converted (and their scales final)
    if e.fused_gemm1:
        if e._fused_rescue is not None:  # tf32: grad_linear1's exponent decided; rerun if it moved
            steps.append(Step("S", (e._decide, e._fused_rescue), "f16 rescue"))
    else:
        steps.append(Step("S", (e._dgelu,), "dgelu"))
        if e._dgelu_rescue is not None:
            steps.append(Step("S", (e._dgelu_rescue,), "f16 rescue"))
    convert("convert late", "S")
    steps.append(Step("S", records=("D",)))
    if e._bias1 is not None:  # bandwidth-bound sums beside GEMM3 (compute-bound), before GEMM4 on S2
        steps.append(Step("S2", e._bias2, "grad_bias2", waits=("D",)))
        steps.append(Step("S2", (e._bias1,), "grad_bias1"))
    if e.gemm2 is not None and e.gelu_in_gemm1:  # gelu_out's codes and GEMM2's alpha are final
        steps.append(Step("S2", (Gemm(1),), "GEMM2 grad_weight2", waits=("D",)))
    if e.gemm3 is not None:
        steps.append(Step("S", (Gemm(2),), "GEMM3 grad_hidden", ready=True))
    if e.gemm4 is not None:
        if e.lean:
            steps.append(Step("S", (Gemm(3),), "GEMM4 grad_weight1"))
        else:
            steps.append(Step("S2", (Gemm(3),), "GEMM4 grad_weight1", waits=("D",)))
    return tuple(steps)


class Executor:
    """Runs an engine's stage graph: `enqueue` walks the steps on S and S2; `launch_graph` runs the same work as
    one re-pointed call graph (cupyffn/cuda/call_graph.py), captured once per `graph_key`."""

    def __init__(self, engine):
        # a weak reference: the engine owns its executor, and no cycle keeps an engine (streams, events, scratch)
        # alive until the garbage collector runs, which may be during someone's stream capture
        self.engine = weakref.proxy(engine)
        self._steps = {}  # (recompute gelu_out, gelu_in_gemm1) -> stages(engine)
        # eager calls as a re-pointed CUDA graph: per key (graph_key)
        self.call_graphs = {}
        self._recorder = None  # the CallGraph being captured: enqueue reports its kernel launches to it
        self._graph_stream = self._table = self._store_table = None

    def steps(self):
        """The steps of the engine's current mode (built on its first call)."""
        e = self.engine
        key = (bool(e._recompute_g and e._ieee_gelu is not None), e.gelu_in_gemm1)
        steps = self._steps.get(key)
        if steps is None:
            steps = self._steps[key] = stages(e)
        return steps

    def _launch(self, launch, stream_ptr):
        """One of our kernels (KernelLaunch, DgeluLaunch); while a call graph is captured, its node is noted."""
        launch(stream_ptr)
        if self._recorder is not None:
            self._recorder.record(launch, stream_ptr)

    def _gemm(self, index, plan, handle):
        """GEMM `index` (0..3); while a call graph is captured, as the form that reads its operand addresses from
        the call table's entry `index` (cublas.Gemm.indirect)."""
        if self._recorder is not None:
            plan.indirect(handle, self._table.ptr + ctypes.sizeof(_kernels.GemmPointers) * index)
        else:
            plan(handle)

    def enqueue(self, stream_ptr, serial=False, mark=None, grad_hidden_ready=0):
        """Issue the whole backward on `stream_ptr`, with the side stream S2 (module docstring).

        `serial`: everything on `stream_ptr`, in order; `mark(stage)` is then called after each step
        (the benchmark's per-stage profile). `grad_hidden_ready`: a raw event pointer (0: none)
        recorded on `stream_ptr` right after GEMM3, so a caller can use grad_hidden before GEMM4 ends.
        """
        from cupy_backends.cuda.api import runtime

        e = self.engine
        mark = mark or (lambda stage: None)
        streams = {"S": stream_ptr, "S2": stream_ptr if serial else e.side.ptr}
        handles = {"S": e._main, "S2": e._main if serial else getattr(e, "_sidecar", None)}
        events = e._events
        gemms = (e.gemm1, e.gemm2, e.gemm3, e.gemm4)

        def walk(steps):
            for step in steps:
                stream = streams[step.stream]
                if not serial:
                    for name in step.waits:
                        runtime.streamWaitEvent(stream, events[name].ptr, 0)
                for target in step.run:
                    if isinstance(target, Gemm):
                        self._gemm(target.index, gemms[target.index], handles[step.stream])
                    else:
                        self._launch(target, stream)
                if step.ready and grad_hidden_ready:
                    runtime.eventRecord(grad_hidden_ready, stream)
                if step.stage is not None:
                    mark(step.stage)
                if not serial:
                    for name in step.records:
                        runtime.eventRecord(events[name].ptr, stream)

        e._main.bind(stream_ptr)
        walk(FORK)
        try:
            walk(self.steps())
        finally:  # also on failure: nothing of this call may land after the caller's error handling
            walk(JOIN)

    # ------------------------------------------------------------------ the call graph (eager calls)
    def launch_graph(self, stream_ptr):
        """The call set by set_io, on `stream_ptr`, as a call graph: captured on the first call of its graph_key
        (on a private stream), then re-pointed and launched (cupyffn/cuda/call_graph.py)."""
        e = self.engine
        key = e.graph_key()
        graph = self.call_graphs.get(key)
        if graph is None:
            graph = self._capture_graph(stream_ptr)
            self.call_graphs[key] = graph
        values = self._store_table.args[1]
        for index, plan in enumerate((e.gemm1, e.gemm2, e.gemm3, e.gemm4)):
            entry = values.gemm[index]
            if plan is not None:
                entry.a, entry.b, entry.c = plan.a.value, plan.b.value, plan.c.value
        graph.launch(stream_ptr)

    def _capture_graph(self, stream_ptr):
        import cupy

        if self._table is None:
            try:
                self._table = cupy.cuda.alloc(ctypes.sizeof(_kernels.CallTable))
            except cupy.cuda.memory.OutOfMemoryError as e:
                raise MemoryError(f"cupyffn could not allocate its {ctypes.sizeof(_kernels.CallTable)}-byte call "
                                  f"table: {e}") from None
            store = _kernels.get_function("call_table", "store_call_table", self.engine.device_id)
            self._store_table = _kernels.KernelLaunch(store, ctypes.c_void_p(self._table.ptr), _kernels.CallTable())
            self._store_table.block = 32
            # The critical path (S: convert A, GEMM1 + dgelu, GEMM3) at the highest priority, the side stream's work
            # at the default: where both are ready at once the GPU starts GEMM1 first and fits convert B into the
            # last wave of its tiles, as the host's launch order makes it do without a graph. A graph without
            # priorities started convert B first at T = 8192, leaving GEMM1's last wave exposed (+17 us;
            # docs/decisions/018-call-graph.md).
            self._graph_stream = cupy.cuda.Stream(non_blocking=True, priority=_call_graph.greatest_stream_priority())
        graph = _call_graph.CallGraph()

        def body(cs):  # the table first: every GEMM of the graph follows its node
            self._launch(self._store_table, cs)
            self.enqueue(cs)

        self._recorder = graph
        try:
            graph.capture(body, self._graph_stream.ptr, upload_stream_ptr=stream_ptr)
        except BaseException:
            graph.destroy()
            raise
        finally:
            self._recorder = None
        return graph

    def destroy_graphs(self):
        for graph in self.call_graphs.values():
            graph.destroy()
        self.call_graphs = {}


# ---------------------------------------------------------------------- the benchmark's stage table
def stage_bytes(engine):
    """Bytes each memory-bound stage moves (for GB/s in the benchmark)."""
    out = {}
    layout = engine.plan.layout
    for stage, (names, _, _) in engine._convert.items():
        out[stage] = sum(4 * math.prod(engine.plan.dims(ROWS_COLS[n])) + layout.written(n) for n in names)
    write = layout.written("grad_linear1") if engine.planes else 4 * engine.T * engine.H
    if not engine.fused_gemm1:
        out["dgelu"] = 12 * engine.T * engine.H + write
    return out


def time_stages(engine, stream, reps, before_each=None):
    """GPU time of each stage (`Step.stage`) of `reps` calls of `engine` with every step serialized on `stream`
    (Executor.enqueue(serial=True), an event after each stage): {stage: [ms per rep]} in issue order; a stage
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
