"""The GPU engine of one backward shape: its state (scale state, constants, scratch), streams, events, cuBLAS
handles, the per-call binding (`set_io`) and its lifetime (`close`).

`GpuEngine` is composed of the parts that hold the rest: its `Plan` (what runs, with the scratch layout:
cupyffn/f32/plan.py, cupyffn/f32/layout.py), its `Kernels` and `Gemms` (the launches, built once:
cupyffn/f32/launches.py) and its `StageRunner` (the stage graph on two streams, and the call graph:
cupyffn/f32/schedule.py), which runs the `StageContext` of the call's binding mode on the engine's
`StageResources`. What every GPU engine shares (ordering, lifetime, the side stream under a caller's
capture, the graph cache) is its base, cupyffn/cuda/stream_engine.py; the executor that runs it,
cupyffn/api/execute.py.
"""

from ..core import plans as _plans
from ..core import precision as P
from ..cuda.stream_engine import StreamEngine
from ..gemm import cublas, cublaslt
from ..gemm import desc as gemm_desc
from ..gemm import sm90
from . import options as _options
from .launches import Gemms, Kernels
from .layout import ALIGN
from .plan import Plan
from .schedule import EVENTS, StageContext, StageResources, StageRunner


class GpuEngine(StreamEngine):
    """Everything one (T, D, H, precision, device) backward needs on the GPU, built once. What it runs is its
    `plan`'s (with `layout`), `kernels`' and `gemms`'; `stage` is the StageContext of the mode of the call bound
    last (cupyffn/f32/schedule.py)."""

    what = "GeluFFNBackward plan"

    def __init__(self, tokens, dim, hidden_dim, precision, device_id, need_grad_hidden=True,
                 need_weight_grads=True, options=_options.DEFAULT, need_bias_grads=False):
        import cupy

        self.need_grad_hidden = need_grad_hidden
        self.need_weight_grads = need_weight_grads
        self.need_bias_grads = need_bias_grads
        self._handles = []
        self.plan = self.kernels = self.gemms = None
        with cupy.cuda.Device(device_id):
            self._alloc_stream_ptr = cupy.cuda.get_current_stream().ptr
            if _plans.is_capturing(self._alloc_stream_ptr):  # the zero fills below would join that capture
                raise RuntimeError("cupyffn cannot build a backward plan while CuPy's current stream is being captured "
                                   "into a CUDA graph: build it (or make one call) before the capture begins")
            StreamEngine.__init__(self, device_id)
            self._allocate_state()
            self._fp8 = {}  # gemm -> its e4m3 cuBLASLt plan (fp16+fp8), built while the plan chooses the forms
            self.plan = Plan(tokens, dim, hidden_dim, precision, need_grad_hidden, need_weight_grads, options,
                             sm90_supported=lambda: sm90.device_supported(device_id),
                             build_fp8=self._build_fp8, need_bias_grads=need_bias_grads)
            self.layout = self.plan.layout
            # what the door reads of the plan (cupyffn/api/routes.py, cupyffn/api/backward_plan.py)
            self.call_graph, self.fused_gemm1 = self.plan.call_graph, self.plan.fused_gemm1
            self.gemm_forms = self.plan.gemm_forms
            self._allocate()
            self.side = cupy.cuda.Stream(non_blocking=True)
            events = {name: cupy.cuda.Event(disable_timing=True) for name in EVENTS}
            self._accumulate = False
            main = cublas.acquire(device_id)
            self._handles.append(main)
            sidecar = None
            if need_weight_grads:
                sidecar = cublas.acquire(device_id)
                self._handles.append(sidecar)
                sidecar.bind(self.side.ptr)
            self.resources = StageResources(main, sidecar, self.side.ptr, events, device_id)
            self.runner = StageRunner(self.resources)
            if self._fp8:  # the e4m3 GEMMs' cuBLASLt handles now, not inside a call a caller may be capturing
                for handle in self._handles:
                    cublaslt.lt_handle(handle)
            if tokens > 0:
                self.kernels = Kernels(self.plan, self.scratch.ptr, self.scale_state, self._consts, device_id)
                self.gemms = Gemms(self.plan, self.scratch.ptr, self._consts, self._fp8, device_id, self.kernels.addr)
            self._stages = {}  # (gelu_out recomputed in fp32, gelu_in_gemm1) -> StageContext: stage_context
            # T = 0: nothing is launched
            self.stage = self.stage_context(False, False) if self.kernels is not None else None
            # the zero-filled state and constants were enqueued on the current stream
            self.constructed(self._alloc_stream_ptr)

    # ------------------------------------------------------------------ state and memory
    def _build_fp8(self, plan, g):
        """GEMM g's e4m3 cross terms on cuBLASLt (Plan.fp8_desc, with the pair's A scale in the constants): None,
        or why no backend builds it (the plan then runs bf16x3 for g)."""
        try:
            self._fp8[g], _ = gemm_desc.build(plan.fp8_desc(g, a_scale=self._consts.data.ptr + 4 * 8), self.device_id,
                                              backends=(gemm_desc.CUBLASLT,), max_k=plan.max_k,
                                              one_ptr=self._consts.data.ptr + 4)
        except gemm_desc.Unsupported as e:
            return str(e)
        return None

    @property
    def scratch_bytes(self):
        """Device scratch this engine holds: the layout's, the bias gradients' partial sums, and ieee memory mode's
        gelu_out once built."""
        if self.kernels is None:
            return self.layout.scratch_bytes
        bias = self.kernels.bias.nbytes if self.kernels.bias is not None else 0
        return self.layout.scratch_bytes + self.kernels.ieee_bytes + bias

    @property
    def workspace_bytes(self):
        """cuBLAS workspaces of this engine's handles (they stay with the handle pool)."""
        return cublas.WORKSPACE_BYTES * (2 if self.need_weight_grads else 1)

    def _allocate_state(self):
        """fp16 scale state and the constants: consts[0] = 0, [1] = 1, [2 + g] = alpha of GEMM g,
        [8] = the e4m3 pair's A scale (kernels_cu/common.cuh lists [0..5])."""
        import cupy

        from ..cuda import kernels as _kernels

        try:
            self.scale_state = cupy.zeros(4 * _kernels.STATE_SLOTS, dtype=cupy.int32)
            # [8]: on a 16-byte boundary, where cuBLASLt wants a scale pointer (see cublaslt.LtMatmul)
            self._consts = cupy.asarray([0, 1, 1, 1, 1, 1, 0, 0, P.E4M3_PAIR_SCALE, 0, 0, 0], dtype=cupy.float32)
        except cupy.cuda.memory.OutOfMemoryError as e:
            raise MemoryError(f"cupyffn could not allocate its 160-byte scale state: {e}") from None

    def _allocate(self):
        import cupy

        nbytes = self.layout.scratch_bytes
        try:
            self.scratch = cupy.cuda.alloc(max(nbytes, ALIGN))
            if self.plan.fmt == P.FMT_F16E4M3:  # the e4m3 pairs' K padding must read as zeros
                from cupy_backends.cuda.api import runtime

                runtime.memsetAsync(self.scratch.ptr, 0, max(nbytes, ALIGN), self._alloc_stream_ptr)
        except cupy.cuda.memory.OutOfMemoryError as e:
            raise MemoryError(
                f"cupyffn needs {nbytes} bytes ({nbytes / 2**20:.1f} MiB) of device scratch "
                f"for T={self.plan.T}, D={self.plan.D}, H={self.plan.H}, precision={self.plan.precision.name!r} and "
                f"could not allocate it: {e}") from None

    # ------------------------------------------------------------------ per call
    def stage_context(self, ieee_gelu, gelu_in_gemm1):
        """The StageContext of one binding mode, built on its first call and kept (a call only looks it up): gelu_out
        recomputed in fp32 by Kernels.ieee_gelu (ieee memory mode, `ieee_gelu`), and gelu_out formed in GEMM1's
        epilogue (a memory-mode call of a plan with gelu_epilogue_ok, `gelu_in_gemm1`) or converted by convert B
        (every other call): the launches of Kernels.modes[gelu_in_gemm1] and Plan.convert_modes[gelu_in_gemm1]."""
        key = (ieee_gelu, gelu_in_gemm1)
        stage = self._stages.get(key)
        if stage is None:
            plan, kernels, bias = self.plan, self.kernels, self.kernels.bias
            convert, fused, fused_rescue, decide = kernels.modes[gelu_in_gemm1]
            cvt_a, cvt_b = plan.convert_modes[gelu_in_gemm1]
            g = self.gemms
            stage = self._stages[key] = StageContext(
                fmt=plan.fmt, cvt_a=cvt_a, cvt_b=cvt_b, fused_gemm1=plan.fused_gemm1, gelu_in_gemm1=gelu_in_gemm1,
                lean=plan.layout.lean, convert=convert, ieee_gelu=kernels.ieee_gelu[1] if ieee_gelu else None,
                fused=fused, fused_rescue=fused_rescue, decide=decide, dgelu=kernels.dgelu,
                dgelu_rescue=kernels.dgelu_rescue, bias1=bias.bias1 if bias is not None else None,
                bias2=bias.bias2 if bias is not None else None, gemms=(g.gemm1, g.gemm2, g.gemm3, g.gemm4),
                two_streams=plan.two_streams)
        return stage

    def rebuild_stages(self):
        """Drop the stage contexts and call graphs built so far and rebuild the current mode's from Kernels.modes as
        they are now (for a measurement that removes launches from them: dev/rescue_cost.py; the launches left are
        bound already)."""
        self.runner.destroy_graphs()
        key = (self.stage.ieee_gelu is not None, self.stage.gelu_in_gemm1)
        self._stages = {}
        self.stage = self.stage_context(*key)

    def io_key(self, call, outputs):
        """What `bind` points the launches at: the inputs' geometry, the outputs' pointers and accumulate."""
        return call.inputs, outputs.pointers, bool(call.request.accumulate)

    def bind(self, call, outputs):
        """Point the launches at `call`'s arrays and at `outputs` (cupyffn/core/results.py Outputs; set_io)."""
        self.set_io(call.inputs, outputs.pointers, call.request.accumulate)

    def eager(self, stream_ptr, ready=0):
        """An eager call: one re-pointed call graph launch where the plan runs one (not when grad_hidden_ready is
        asked for: the graph records no event of the caller's), else the launches one by one."""
        if self.call_graph and not ready:
            self.launch_graph(stream_ptr)
        else:
            self.enqueue(stream_ptr, ready=ready)

    def set_io(self, inputs, outputs, accumulate):
        """Point the prebuilt launches at this call's arrays (Matrix views) and outputs (device pointers:
        grad_hidden_states, grad_weight1, grad_weight2, then grad_bias1, grad_bias2 with need_bias_grads)."""
        dy, x, w1, w2, l1, t, g = inputs
        src = {"grad_output": dy, "hidden_states": x, "weight1": w1, "weight2": w2, "gelu_out": g}
        plan = self.plan
        recompute = g is None and self.need_weight_grads  # memory mode: gelu_out from linear1_out
        if recompute and not plan.planes:
            self.kernels.ensure_ieee_gelu()
        # a given gelu_out is used as given; only a missing one may be formed in GEMM1's epilogue
        self.stage = self.stage_context(bool(recompute and self.kernels.ieee_gelu is not None),
                                        bool(recompute and plan.gelu_epilogue_ok))
        self.kernels.bind(self.stage.gelu_in_gemm1, l1, t, g, src)
        if plan.fmt != P.FMT_F16E4M3 and not plan.planes:
            self.gemms.bind(dy, x, w1, w2, g, self.kernels.ieee_g)
        self._accumulate = bool(accumulate)
        self.gemms.set_outputs(outputs[:3], accumulate)
        if self.need_bias_grads:
            self.kernels.bias.bind(dy, outputs[3], outputs[4], accumulate, self.kernels.dgelu)

    def enqueue(self, stream_ptr, serial=False, ready=0, mark=None):
        """Issue the whole backward on `stream_ptr` and the side stream (schedule.StageRunner.enqueue); `ready`: the
        raw event recorded right after GEMM3."""
        self.runner.enqueue(self.stage, stream_ptr, serial=serial, mark=mark, ready=ready)

    def graph_key(self):
        """What a call graph bakes in besides addresses: the beta of the weight gradients (cuBLAS takes its address
        when captured), for ieee whether memory mode recomputes gelu_out (one more launch), and whether GEMM1's
        epilogue forms gelu_out (other launches)."""
        return self._accumulate, self.stage.ieee_gelu is not None, self.stage.gelu_in_gemm1

    def launch_graph(self, stream_ptr):
        """The call set by set_io as one re-pointed call graph launch (schedule.StageRunner.launch_graph)."""
        self.runner.launch_graph(self.stage, self.graph_key(), stream_ptr)

    def allocates_for(self, call):
        """Whether binding `call` would allocate (ieee memory mode's gelu_out buffer, on first use)."""
        built = self.kernels is not None and self.kernels.ieee_gelu is not None
        return call.inputs.gelu_out is None and self.need_weight_grads and not self.plan.planes and not built

    def _release(self):
        """After the last call (StreamEngine.close): the graphs, the cuBLAS handles, the scratch."""
        self.runner.destroy_graphs()
        for h in self._handles:
            cublas.release(h)
        self._handles = []
        self.scratch = None
