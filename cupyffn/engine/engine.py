"""The GPU engine of one backward shape: its state (scale state, constants, scratch), streams, events, cuBLAS
handles, the per-call binding (`set_io`) and its lifetime (`close`).

`GpuEngine` is composed of the parts that hold the rest: its `Plan` (what runs, with the scratch layout:
cupyffn/engine/plan.py, cupyffn/engine/layout.py), its `Kernels` and `Gemms` (the launches, built once:
cupyffn/engine/launches.py) and its `Executor` (the stage graph on two streams, and the call graph:
cupyffn/engine/schedule.py). What every GPU engine shares (ordering, lifetime, the side stream under a caller's
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
from .schedule import EVENTS, Executor, stage_bytes


def _of(part, name, doc=None):
    """A read-only attribute of the engine that is `name` of its part `part` (None while that part is)."""
    return property(lambda self: getattr(getattr(self, part), name, None), doc=doc)


class GpuEngine(StreamEngine):
    """Everything one (T, D, H, precision, device) backward needs on the GPU, built once."""

    what = "GeluFFNBackward plan"

    # the plan's decisions (cupyffn/engine/plan.py), read where the engine is
    options = _of("plan", "options")
    T, D, H = _of("plan", "T"), _of("plan", "D"), _of("plan", "H")
    precision = _of("plan", "precision")
    forms, form_notes, sm90_pair = _of("plan", "forms"), _of("plan", "form_notes"), _of("plan", "sm90_pair")
    fmt, planes = _of("plan", "fmt"), _of("plan", "planes")
    fused_gemm1, epilogue_warps = _of("plan", "fused_gemm1"), _of("plan", "epilogue_warps")
    gelu_epilogue_ok, convert_ab = _of("plan", "gelu_epilogue_ok"), _of("plan", "convert_ab")
    call_graph, gemm_forms = _of("plan", "call_graph"), _of("plan", "gemm_forms")
    k_chunked = _of("plan", "k_chunked", "{gemm: chunks} of the GEMMs run in more than one K-chunk.")
    ops, lean = _of("layout", "ops"), _of("layout", "lean")
    # the launches (cupyffn/engine/launches.py; None at T = 0)
    gemm1, gemm2, gemm3, gemm4 = (_of("gemms", g) for g in ("gemm1", "gemm2", "gemm3", "gemm4"))
    _dgelu, _dgelu_rescue = _of("kernels", "dgelu"), _of("kernels", "dgelu_rescue")
    _ieee_gelu = _of("kernels", "ieee_gelu")
    _bias = _of("kernels", "bias")
    _bias1 = property(lambda self: self._bias.bias1 if self._bias is not None else None)
    _bias2 = property(lambda self: self._bias.bias2 if self._bias is not None else None)
    _call_graphs = _of("_executor", "call_graphs")

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
            self.gelu_in_gemm1 = False  # this call's: the epilogue forms gelu_out (memory mode; _select_mode)
            self._allocate()
            self.side = cupy.cuda.Stream(non_blocking=True)
            self._events = {name: cupy.cuda.Event(disable_timing=True) for name in EVENTS}
            self._recompute_g = False
            self._accumulate = False
            self._executor = Executor(self)
            self._main = cublas.acquire(device_id)
            self._handles.append(self._main)
            if need_weight_grads:
                self._sidecar = cublas.acquire(device_id)
                self._handles.append(self._sidecar)
                self._sidecar.bind(self.side.ptr)
            if self._fp8:  # the e4m3 GEMMs' cuBLASLt handles now, not inside a call a caller may be capturing
                for handle in self._handles:
                    cublaslt.lt_handle(handle)
            if tokens > 0:
                self.kernels = Kernels(self.plan, self._base, self._state, self._consts, device_id)
                self.gemms = Gemms(self.plan, self._base, self._consts, self._fp8, device_id, self.kernels.addr)
            self._select_mode(False)
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
            self._state = cupy.zeros(4 * _kernels.STATE_SLOTS, dtype=cupy.int32)
            # [8]: on a 16-byte boundary, where cuBLASLt wants a scale pointer (see cublaslt.LtMatmul)
            self._consts = cupy.asarray([0, 1, 1, 1, 1, 1, 0, 0, P.E4M3_PAIR_SCALE, 0, 0, 0], dtype=cupy.float32)
        except cupy.cuda.memory.OutOfMemoryError as e:
            raise MemoryError(f"cupyffn could not allocate its 160-byte scale state: {e}") from None

    def _allocate(self):
        import cupy

        nbytes = self.layout.scratch_bytes
        try:
            self._scratch = cupy.cuda.alloc(max(nbytes, ALIGN))
            if self.fmt == P.FMT_F16E4M3:  # the e4m3 pairs' K padding must read as zeros
                from cupy_backends.cuda.api import runtime

                runtime.memsetAsync(self._scratch.ptr, 0, max(nbytes, ALIGN), self._alloc_stream_ptr)
        except cupy.cuda.memory.OutOfMemoryError as e:
            raise MemoryError(
                f"cupyffn needs {nbytes} bytes ({nbytes / 2**20:.1f} MiB) of device scratch "
                f"for T={self.T}, D={self.D}, H={self.H}, precision={self.precision.name!r} and could not allocate "
                f"it: {e}") from None
        self._base = self._scratch.ptr

    # ------------------------------------------------------------------ per call
    def _select_mode(self, gelu_epilogue):
        """Take the launches of one mode (Plan.convert_modes, Kernels.modes): gelu_out formed in GEMM1's epilogue (a
        memory-mode call of a plan with gelu_epilogue_ok) or converted by convert B (every other call)."""
        self.gelu_in_gemm1 = bool(gelu_epilogue)
        self.cvt_a, self.cvt_b = self.plan.convert_modes[self.gelu_in_gemm1]
        if self.kernels is None:  # T = 0: nothing is launched
            return
        self._convert, self._fused, self._fused_rescue, self._decide = self.kernels.modes[self.gelu_in_gemm1]

    def io_key(self, call, pointers):
        """What `bind` points the launches at: the inputs' geometry, the outputs' pointers and accumulate."""
        return call.inputs, tuple(pointers), bool(call.request.accumulate)

    def bind(self, call, pointers):
        """Point the launches at `call`'s arrays and the outputs at `pointers` (set_io)."""
        self.set_io(call.inputs, pointers, call.request.accumulate)

    def eager(self, stream_ptr, ready=0):
        """An eager call: one re-pointed call graph launch where the plan runs one (not when grad_hidden_ready is
        asked for: the graph records no event of the caller's), else the launches one by one."""
        if self.call_graph and not ready:
            self.launch_graph(stream_ptr)
        else:
            self.enqueue(stream_ptr, grad_hidden_ready=ready)

    def set_io(self, inputs, outputs, accumulate):
        """Point the prebuilt launches at this call's arrays (Matrix views) and outputs (device pointers:
        grad_hidden_states, grad_weight1, grad_weight2, then grad_bias1, grad_bias2 with need_bias_grads)."""
        dy, x, w1, w2, l1, t, g = inputs
        src = {"grad_output": dy, "hidden_states": x, "weight1": w1, "weight2": w2, "gelu_out": g}
        self._recompute_g = g is None and self.need_weight_grads  # memory mode: gelu_out from linear1_out
        # a given gelu_out is used as given; only a missing one may be formed in GEMM1's epilogue
        self._select_mode(self._recompute_g and self.gelu_epilogue_ok)
        if self._recompute_g and not self.planes:
            self.kernels.ensure_ieee_gelu()
        self.kernels.bind(self.gelu_in_gemm1, l1, t, g, src)
        if self.fmt != P.FMT_F16E4M3 and not self.planes:
            self.gemms.bind(dy, x, w1, w2, g, self.kernels.ieee_g)
        self._accumulate = bool(accumulate)
        self.gemms.set_outputs(outputs[:3], accumulate)
        if self.need_bias_grads:
            self._bias.bind(dy, outputs[3], outputs[4], accumulate, self.kernels.dgelu)

    def enqueue(self, stream_ptr, serial=False, ready=0, mark=None, grad_hidden_ready=0):
        """Issue the whole backward on `stream_ptr` and the side stream (schedule.Executor.enqueue); `ready` or
        `grad_hidden_ready`: the raw event recorded right after GEMM3."""
        self._executor.enqueue(stream_ptr, serial=serial, mark=mark, grad_hidden_ready=ready or grad_hidden_ready)

    def graph_key(self):
        """What a call graph bakes in besides addresses: the beta of the weight gradients (cuBLAS takes its address
        when captured), for ieee whether memory mode recomputes gelu_out (one more launch), and whether GEMM1's
        epilogue forms gelu_out (other launches)."""
        return self._accumulate, bool(self._recompute_g and self._ieee_gelu is not None), self.gelu_in_gemm1

    def launch_graph(self, stream_ptr):
        """The call set by set_io as one re-pointed call graph launch (schedule.Executor.launch_graph)."""
        self._executor.launch_graph(stream_ptr)

    def allocates_for(self, call):
        """Whether binding `call` would allocate (ieee memory mode's gelu_out buffer, on first use)."""
        return call.inputs[6] is None and self.need_weight_grads and not self.planes and self._ieee_gelu is None

    def stage_bytes(self):
        """Bytes each memory-bound stage moves (for GB/s in the benchmark)."""
        return stage_bytes(self)

    def _release(self):
        """After the last call (StreamEngine.close): the graphs, the cuBLAS handles, the scratch."""
        self._executor.destroy_graphs()
        for h in self._handles:
            cublas.release(h)
        self._handles = []
        self._scratch = None
