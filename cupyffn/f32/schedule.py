"""The stage graph of one backward call as data (`stages`: a tuple of `Step`), what it runs (`StageContext`, one per
binding mode, and `StageResources`, the engine's streams, handles and events), its two-stream runner
(`StageRunner.enqueue`) and the call graph's capture and replay (`StageRunner.launch_graph`); the benchmark's stage
table walks the same steps (benchmarks/stages.py).

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
fuses GEMM1 and dgelu (cupyffn/f32/plan.py), GEMM1 + dgelu is one launch, then a one-thread scale decision and a
rescue launch; in memory mode with gelu_out formed in that epilogue, GEMM2 waits for the rescue launch:

    S : convert A ──► GEMM1 + dgelu + gelu_out ──► decide, rescue ──┬─► GEMM3 ──────────────────► join
    S2: convert B (hidden_states, weight1) ──────────────(B)─┘      └─► GEMM2 ──► GEMM4 ─────────┘

The lean layout (cupyffn/f32/layout.py): S waits for GEMM2 before dgelu, converts weight1 and hidden_states
after it ("convert late") and runs GEMM4 itself. With `serial=True` (a caller's capture holding the side stream,
or the per-stage profile), and in every call of a plan without two_streams (cupyffn/f32/plan.py TWO_STREAMS_TOKENS),
every step runs on S in this order and no event is waited on or recorded.
"""

import ctypes
from dataclasses import dataclass, field
from typing import NamedTuple

from ..cuda import kernels as _kernels
from ..core import precision as P
from ..cuda import call_graph as _call_graph

#: The events of a call: after the fork, after convert A, after convert B, after the step that finishes
#: grad_linear1, and S2's last work (the join; also the lean layout's wait for GEMM2).
EVENTS = ("start", "A", "B", "D", "side")


class StepGemm(NamedTuple):
    """A step's GEMM: gemm1..gemm4 by index (the call table's entry), on the handle of the step's stream."""

    index: int


class Step(NamedTuple):
    """One step of the stage graph: on `stream` ("S" or "S2"), wait for `waits` (names in EVENTS), run `run` (our
    kernel launches, or a StepGemm) in order, record grad_hidden_ready if `ready`, mark `stage` (the name of the
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


@dataclass(eq=False)
class StageContext:
    """What the calls of one binding mode run (GpuEngine.stage_context builds one per mode, once, from its plan and
    launches; a mode: whether GEMM1's epilogue forms gelu_out, and whether ieee memory mode recomputes it).

    fmt, fused_gemm1, lean: the plan's (cupyffn/f32/plan.py, layout.py); cvt_a, cvt_b: what convert A and
    convert B convert in this mode (Plan.convert_modes); gelu_in_gemm1: GEMM1's epilogue forms gelu_out;
    convert: {stage: (names, launch, rescue launch or None)}; ieee_gelu: the launch recomputing gelu_out in fp32 in
    ieee memory mode (None in every other mode); fused, fused_rescue, decide: the fused GEMM1 + dgelu's launches
    (None without it); dgelu, dgelu_rescue (None with it); bias1 (a launch) and bias2 (two launches): the bias
    gradients' (None without them); gemms: GEMM1..GEMM4's plans (None where the plan skips one); two_streams: the
    plan's (False: every call runs its steps on the caller's stream, as serial). `steps`:
    stages(self), built with the context so that a call only walks them.
    """

    fmt: int
    cvt_a: list
    cvt_b: list
    fused_gemm1: bool
    gelu_in_gemm1: bool
    lean: bool
    convert: dict
    ieee_gelu: object
    fused: object
    fused_rescue: object
    decide: object
    dgelu: object
    dgelu_rescue: object
    bias1: object
    bias2: tuple
    gemms: tuple
    two_streams: bool = True
    steps: tuple = field(init=False, repr=False)

    def __post_init__(self):
        self.steps = stages(self)


class StageResources(NamedTuple):
    """What every call of one engine runs on, fixed when it is built: `main` (the cuBLAS handle of S, bound to the
    caller's stream per call), `sidecar` (S2's, bound to the side stream; None without weight gradients, where no
    GEMM runs on S2), `side_ptr` (the side stream S2), `events` ({name in EVENTS: cupy Event}), `device_id`."""

    main: object
    sidecar: object
    side_ptr: int
    events: dict
    device_id: int


def stages(stage):
    """The steps of a call in the mode of `stage` (a StageContext), in issue order."""
    steps = []

    def convert(name, stream):
        if name in stage.convert:
            _, first, rescue = stage.convert[name]
            steps.append(Step(stream, (first,), name))
            if rescue is not None:
                steps.append(Step(stream, (rescue,), "f16 rescue"))

    _, gemm2, gemm3, gemm4 = stage.gemms
    convert("convert A", "S")
    steps.append(Step("S", records=("A",)))
    # convert B's rescue writes alpha2, which needs grad_output's scale (with gelu_in_gemm1 it writes no alpha;
    # convert B still follows A, which GEMM1 waits for, rather than halve A's bandwidth)
    s2_after_a = stage.fmt in (P.FMT_F16S, P.FMT_F16E4M3) and bool(stage.cvt_b)
    if s2_after_a:
        steps.append(Step("S2", waits=("A",)))
    convert("convert B", "S2")
    if stage.ieee_gelu is not None:
        steps.append(Step("S2", (stage.ieee_gelu,), "gelu_out (recomputed)"))
    steps.append(Step("S2", records=("B",)))
    if stage.fused_gemm1:
        steps.append(Step("S", (stage.fused,), "GEMM1 + dgelu (sm90 fused)"))
    else:
        steps.append(Step("S", (StepGemm(0),), "GEMM1 grad_gelu"))
    if gemm2 is not None and not stage.gelu_in_gemm1:
        # grad_output converted (S2 already waits for it where convert B did)
        steps.append(Step("S2", (StepGemm(1),), "GEMM2 grad_weight2", waits=() if s2_after_a else ("A",)))
    if stage.lean:
        steps.append(Step("S2", records=("side",)))
        steps.append(Step("S", waits=("side",)))  # grad_linear1 overwrites the planes GEMM2 reads
    steps.append(Step("S", waits=("B",)))  # weight1 / hidden_states converted (and their scales final)
    if stage.fused_gemm1:
        if stage.fused_rescue is not None:  # tf32: grad_linear1's exponent decided; rerun if it moved
            steps.append(Step("S", (stage.decide, stage.fused_rescue), "f16 rescue"))
    else:
        steps.append(Step("S", (stage.dgelu,), "dgelu"))
        if stage.dgelu_rescue is not None:
            steps.append(Step("S", (stage.dgelu_rescue,), "f16 rescue"))
    convert("convert late", "S")
    steps.append(Step("S", records=("D",)))
    if stage.bias1 is not None:  # bandwidth-bound sums beside GEMM3 (compute-bound), before GEMM4 on S2
        steps.append(Step("S2", stage.bias2, "grad_bias2", waits=("D",)))
        steps.append(Step("S2", (stage.bias1,), "grad_bias1"))
    if gemm2 is not None and stage.gelu_in_gemm1:  # gelu_out's codes and GEMM2's alpha are final
        steps.append(Step("S2", (StepGemm(1),), "GEMM2 grad_weight2", waits=("D",)))
    if gemm3 is not None:
        steps.append(Step("S", (StepGemm(2),), "GEMM3 grad_hidden", ready=True))
    if gemm4 is not None:
        if stage.lean:
            steps.append(Step("S", (StepGemm(3),), "GEMM4 grad_weight1"))
        else:
            steps.append(Step("S2", (StepGemm(3),), "GEMM4 grad_weight1", waits=("D",)))
    return tuple(steps)


class StageRunner:
    """Runs a StageContext's steps on one engine's StageResources: `enqueue` walks them on S and S2; `launch_graph`
    runs the same work as one re-pointed call graph (cupyffn/cuda/call_graph.py), captured once per key. It holds
    no reference to the engine (what a call runs comes with the call), so no cycle keeps an engine (streams,
    events, scratch) alive until the garbage collector runs, which may be during someone's stream capture."""

    def __init__(self, resources):
        self.resources = resources
        # eager calls as a re-pointed CUDA graph: per key (GpuEngine.graph_key)
        self.call_graphs = {}
        self._recorder = None  # the CallGraph being captured: enqueue reports its kernel launches to it
        self._graph_stream = self._table = self._store_table = None

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

    def enqueue(self, stage, stream_ptr, serial=False, mark=None, ready=0):
        """Issue the whole backward of `stage` (the StageContext of the call's mode) on `stream_ptr`, with the side
        stream S2 (module docstring).

        `serial`: everything on `stream_ptr`, in order; `mark(name)` is then called after each step that marks a
        stage (the benchmark's per-stage profile). `ready`: a raw event pointer (0: none) recorded on `stream_ptr`
        right after GEMM3, so a caller can use grad_hidden before GEMM4 ends (grad_hidden_ready).
        """
        from cupy_backends.cuda.api import runtime

        r = self.resources
        mark = mark or (lambda name: None)
        serial = serial or not stage.two_streams
        streams = {"S": stream_ptr, "S2": stream_ptr if serial else r.side_ptr}
        handles = {"S": r.main, "S2": r.main if serial else r.sidecar}
        events = r.events
        gemms = stage.gemms

        def walk(steps):
            for step in steps:
                stream = streams[step.stream]
                if not serial:
                    for name in step.waits:
                        runtime.streamWaitEvent(stream, events[name].ptr, 0)
                for target in step.run:
                    if isinstance(target, StepGemm):
                        self._gemm(target.index, gemms[target.index], handles[step.stream])
                    else:
                        self._launch(target, stream)
                if step.ready and ready:
                    runtime.eventRecord(ready, stream)
                if step.stage is not None:
                    mark(step.stage)
                if not serial:
                    for name in step.records:
                        runtime.eventRecord(events[name].ptr, stream)

        r.main.bind(stream_ptr)
        walk(FORK)
        try:
            walk(stage.steps)
        finally:  # also on failure: nothing of this call may land after the caller's error handling
            walk(JOIN)

    # ------------------------------------------------------------------ the call graph (eager calls)
    def launch_graph(self, stage, key, stream_ptr):
        """The call of `stage` (bound by GpuEngine.set_io) on `stream_ptr` as a call graph: captured on the first
        call of its `key` (GpuEngine.graph_key; on a private stream), then re-pointed and launched
        (cupyffn/cuda/call_graph.py)."""
        graph = self.call_graphs.get(key)
        if graph is None:
            graph = self._capture_graph(stage, stream_ptr)
            self.call_graphs[key] = graph
        values = self._store_table.args[1]
        for index, plan in enumerate(stage.gemms):
            entry = values.gemm[index]
            if plan is not None:
                entry.a, entry.b, entry.c = plan.a.value, plan.b.value, plan.c.value
        graph.launch(stream_ptr)

    def _capture_graph(self, stage, stream_ptr):
        import cupy

        if self._table is None:
            try:
                self._table = cupy.cuda.alloc(ctypes.sizeof(_kernels.CallTable))
            except cupy.cuda.memory.OutOfMemoryError as e:
                raise MemoryError(f"cupyffn could not allocate its {ctypes.sizeof(_kernels.CallTable)}-byte call "
                                  f"table: {e}") from None
            store = _kernels.get_function("call_table", "store_call_table", self.resources.device_id)
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
            self.enqueue(stage, cs)

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
