"""The GPU engine: scratch buffers, kernel launches and cuBLAS calls of one backward shape.

Work of one call (S = the caller's stream, S2 = the engine's side stream):

    S : convert A ─┬─► GEMM1 grad_gelu ──► dgelu ──┬─► GEMM3 grad_hidden ───────► join
                   │                     ▲         │                                ▲
    S2: convert B ─┴─► GEMM2 grad_weight2 ┘(B)      └─► GEMM4 grad_weight1 ─────────┘

`convert A` writes the operands of GEMM1 (grad_output, weight2) and `convert B` those of the rest
(gelu_out, hidden_states, weight1), each in one launch (tf32 at T <= 512: both in one launch on S,
CONVERT_AB_TOKENS); `dgelu` reads grad_gelu, linear1_out and
tanh_inner once and writes grad_linear1 straight in the format of GEMM3/GEMM4. GEMM1 and GEMM2,
and GEMM3 and GEMM4, are independent: at small T, where one GEMM leaves most of the GPU idle, they
run side by side. For "tf32" (fp16 operands) every gathering pass is followed by a small rescue
launch that converts again any tensor whose delayed scale did not fit (kernels_cu/convert.cu).

"tf32" on an H100/H200 (compute capability 9.0): GEMM1 and dgelu are one kernel (kernels_cu/gemm_sm90.cu,
`fused_gemm1`): the GELU derivative is applied in GEMM1's epilogue, which writes grad_linear1 as scaled fp16
and gathers its maximum; grad_gelu is never written (no T x H fp32 scratch). Its scale is decided by a
one-thread launch once convert B's exponents are final, then a fused rescue launch (a no-op unless the
exponent moved: then it runs GEMM1 again). It runs for FUSED_GEMM1_TOKENS: every T since the epilogue's
instruction count was cut (whole calls 0.90-0.975 of the cuBLAS route on 15 of the 16 workloads; before it, at
T >= 2048 the cuBLAS route's dgelu pass overlapping GEMM2 on the side stream had been worth more than the fusion;
docs/decisions/025-sm90-gemm1-dgelu-fusion.md). The plan's options (cupyffn/_options.py) override:
EngineOptions(fused_gemm1=False) never, True at every T (comparisons).
Memory mode without gelu_out (tf32, fused, weight gradients wanted; GELU_EPILOGUE_TOKENS; `gelu_in_gemm1` for
such a call, `gelu_epilogue_ok` for the plan): the fused epilogue also writes GEMM2's operand gelu_out =
0.5 x (1 + t) as scaled fp16 codes, from the linear1_out and tanh_inner it holds anyway (EPI_DGELU_F16G), instead
of convert B recomputing it, and GEMM2 runs after GEMM1's rescue launch instead of beside GEMM1:

    S : convert A ──► GEMM1 + dgelu + gelu_out ──► decide, rescue ──┬─► GEMM3 ──────────────────► join
    S2: convert B (hidden_states, weight1) ──────────────(B)─┘      └─► GEMM2 ──► GEMM4 ─────────┘

A gelu_out the caller gives is always converted and used as given (docs/decisions/002-honour-every-input.md):
the plan holds the launches of both ways and each call takes the one its inputs need (set_io).

Every GEMM whose K exceeds _ksplit.MAX_K runs in K-chunks added in fp32 (cupyffn/_ksplit.py); the
sm90 kernels sum the whole K in one accumulator, so a plan whose GEMM1 K exceeds it runs GEMM1 on cuBLAS.
With `epilogue_warps` (tf32, fused; EPILOGUE_WARPS_TOKENS: T >= 513) that epilogue runs in seven warps of its own,
fed each accumulator tile through shared memory while the consumer warps compute the next tile (the same bits).
The same kernel can serve the bf16x3 plan (epilogue writing grad_linear1's three bf16 planes; one launch, no
scale to decide), but measured slower over the whole call at every T, so only EngineOptions(fused_gemm1=True)
turns it on.

"Lean" layout (bf16x3 at large T, where three 16-bit planes of gelu_out and of grad_linear1 side
by side would break the memory budget): grad_linear1 reuses gelu_out's planes, so S waits for
GEMM2 before dgelu, and weight1/hidden_states are converted after dgelu into grad_gelu's buffer,
which is dead by then. At that size each GEMM fills the GPU, so nothing is lost by serializing.
"""

import ctypes
import math

from . import _call_graph, _cublas, _gemm, _kernels, _ksplit, _options, _plan_cache, _sm90_gemm
from . import _precision as P

_ALIGN = 256
#: Operand formats whose GEMM1 + dgelu the sm90 kernel can run: the tf32 plan's scaled fp16 and the bf16x3 plan's
#: planes (also fp16+fp8 below T = 2048, where it is the bf16x3 plan).
FUSABLE_FORMATS = (P.FMT_F16S, P.FMT_BF16X3)

# ---------------------------------------------------------------------- the measured windows
# What each option of cupyffn/_options.py left at None (auto) resolves to, through option_wanted: one table, each
# entry with its measurement and decision note.

#: Per format, T (first <= T <= last) at which the default (fused_gemm1 auto) fuses (module docstring); a format
#: not listed fuses only with EngineOptions(fused_gemm1=True). Whole calls on the H200, fused / cuBLAS route, same
#: run: tf32 0.90-0.975 on 15 of the 16 workloads, 1.36 on one T = 256 row whose twin of equal shape measured 0.94
#: (host noise); 0.89-0.99 at every T in a one-round A/B (docs/decisions/025-sm90-gemm1-dgelu-fusion.md).
#: bf16x3: 1.02-1.13 from T = 512 on, 0.97-0.98 at 256 (docs/decisions/042-bf16x3-fused-gemm1.md): the
#: three-plane epilogue costs more than the pass it replaces, so not listed.
FUSED_GEMM1_TOKENS = {P.FMT_F16S: (1, 2 ** 31 - 1)}


#: Per format, T (first <= T <= last) at which eager calls run as a call graph by default (call_graph auto;
#: cupyffn/_call_graph.py). Measured on the H200, tf32, same runs (docs/decisions/018-call-graph.md): at T <= 512 the
#: GPU work of a call (0.11-0.14 ms) is as long as the host's enqueue of its launches, so launched one by one the
#: call measured 0.112-0.18 ms at T = 256 depending on the host's state, as a graph 0.114-0.116 in every run; from
#: T = 1024 on the GPU outlasts the enqueue and the graph's own cost (its batched cuBLAS GEMMs, the table node:
#: 0.5-2.5%) is not paid back. bf16x3 and ieee: cuBLAS picks slower kernels for their batched GEMMs (whole calls
#: 1.3x), so not listed; bf16 measured even.
CALL_GRAPH_TOKENS = {P.FMT_F16S: (1, 512)}


#: Per format, T at which convert A and convert B are one launch (and one rescue launch) on S instead of two
#: launches on two streams (convert_ab auto; True at every T, False never). Convert B's gathering pass can run
#: beside convert A only after A's scale is decided (its last block caps gelu_out's exponent by grad_output's),
#: so launched apart the five matrices go through the GPU one group after the other, with a rescue launch
#: between; in one launch they share one grid and one decision (slots decided in order: grad_output's first).
#: GEMM1 + dgelu then waits for all five. Measured on the H200, whole calls, one launch / two, same run
#: (docs/decisions/019-convert-ab-one-launch.md): 0.928-0.930 at T = 256, 0.983 at 512, 1.00-1.03 from T = 1024 on
#: (there GEMM1 + dgelu, started after convert A, gains more from convert B filling its last wave).
CONVERT_AB_TOKENS = {P.FMT_F16S: (1, 512)}


#: Per format, T at which the fused GEMM1 also writes gelu_out's fp16 codes for GEMM2 (module docstring;
#: gelu_epilogue auto; True wherever the fused tf32 GEMM1 runs, False never). Measured on the H200, whole calls
#: against the same plan converting gelu_out, same run (docs/decisions/041-gelu-out-in-epilogue.md): 0.973-0.995 at
#: T = 4096-8192; 1.02-1.07 at T = 256-3142, where the saved conversion is smaller than what the epilogue's second
#: output costs and GEMM2 no longer overlaps GEMM1's last wave.
GELU_EPILOGUE_TOKENS = {P.FMT_F16S: (4096, 2 ** 31 - 1)}


#: Per format, T at which the fused GEMM1's epilogue runs in warps of its own (kernels_cu/gemm_sm90.cu, XS = 2: the
#: accumulator tile handed through shared memory, the epilogue overlapping the next tile's mainloop) instead of the
#: staged epilogue of choose_config's schedule (epilogue_warps auto; True wherever the fused tf32 GEMM1 runs,
#: False never). Bit for bit the same outputs. Measured on the H200, the fused kernel alone with gelu_out, against the
#: engine's schedule, two runs (docs/decisions/045-epilogue-warps.md): 0.91-0.97 at T = 512-8192,
#: 0.98-1.07 at T = 256, where the 96 tiles leave nothing to overlap (one tile per CTA); from T = 513 on a CTA has
#: more than one 128 x 128 tile (H = 6144: more tiles than SMs).
EPILOGUE_WARPS_TOKENS = {P.FMT_F16S: (513, 2 ** 31 - 1)}


#: fp16+fp8: the GEMMs whose f16+e4m3 form runs as one launch of the sm90 pair kernel (kernels_cu/gemm_sm90.cu
#: gemm_sm90_pair_kernel: no fp32 output written and read again between the two products) instead of cuBLAS's
#: e4m3 + fp16 pair. Measured on the H200, GEMMs alone (docs/decisions/024-sm90-pair-kernel-gemm1.md): GEMM1 0.74x of
#: cuBLAS's pair at T = 8192 (0.78-0.81x of bf16x3 at T = 2048-8192); GEMM3 0.99x at T = 8192 but 1.09-1.17x at
#: T = 2048-4096; GEMM2 and GEMM4 (A read MN-major) 1.05-1.36x. sm90_pair auto: these; True: every pair GEMM;
#: False: none.
SM90_PAIR_GEMMS = ("gemm1",)


def option_wanted(choice, windows, fmt, tokens):
    """Whether a switch of the plan's EngineOptions (cupyffn/_options.py), of value `choice`, asks for its mechanism
    in a plan of format `fmt` at `tokens`: True always, False never, None (auto) where `windows` ({format: (first,
    last)}: FUSED_GEMM1_TOKENS, GELU_EPILOGUE_TOKENS, EPILOGUE_WARPS_TOKENS, CALL_GRAPH_TOKENS, CONVERT_AB_TOKENS)
    has first <= tokens <= last. The caller adds what the mechanism itself needs."""
    if choice is not None:
        return choice
    window = windows.get(fmt)
    return window is not None and window[0] <= tokens <= window[1]


def _align(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _items(rows, cols):
    """Work items of an elementwise kernel over [rows, cols]: (row, chunk of 8 * BLOCK columns) pairs."""
    return rows * -(-cols // (8 * _kernels.BLOCK))


def convert_launch(kernel, targets, total_blocks, rescue, counter, alpha_mask, state_ptr, consts_ptr):
    """One convert_kernel launch (convert.cu). `targets`: per matrix (geometry, dst address, plane pattern,
    scale slot); blocks are shared out in proportion to the matrices' sizes. Source pointers are set per call."""
    jobs = _kernels.ConvertJobs()
    jobs.count = len(targets)
    jobs.rescue = rescue
    jobs.counter = counter
    jobs.slot_mask = sum(1 << slot for *_, slot in targets)
    jobs.alpha_mask = alpha_mask
    sizes = [op.rows * op.cols for op, *_ in targets]
    begin = 0
    for job, (op, dst, pattern, slot), size in zip(jobs.job, targets, sizes):
        job.dst = dst
        job.dst_ld = op.dst_ld
        job.part_stride = op.part_stride
        job.rows = op.rows
        job.cols = op.cols
        job.pattern = pattern
        job.slot = slot
        job.block_begin = begin
        job.block_count = max(1, min(_items(op.rows, op.cols), round(total_blocks * size / sum(sizes))))
        begin += job.block_count
    launch = _kernels.KernelLaunch(kernel, jobs, state_ptr, consts_ptr)
    launch.grid = begin
    return launch


def _pad16(k):
    """K rounded up to a multiple of 16 (the e4m3 pairs' halves; cuBLASLt FP8 wants K and ld multiples of 16)."""
    return (k + 15) // 16 * 16


def _vec_ok(ptr, ld, cols, itemsize=4):
    """The 8-wide path needs every row to start 16-byte aligned and to hold whole groups of 8."""
    return cols % 8 == 0 and ptr % 16 == 0 and (ld * itemsize) % 16 == 0


class _Operand:
    """Where a converted GEMM operand lives and how the conversion kernel writes it."""

    def __init__(self, name, rows, cols, interleaved, planes):
        self.name = name
        self.rows, self.cols = rows, cols
        self.planes = planes
        # Activations [T, cols] keep their planes side by side in a row ([T, planes * cols]); weights
        # stack them as blocks ([planes * rows, cols]). Both put K-stacking in reach of one GEMM.
        self.dst_ld = planes * cols if interleaved else cols
        self.part_stride = cols if interleaved else rows * cols
        self.nbytes = 2 * planes * rows * cols
        self.offset = None  # set by the layout


class GpuEngine:
    """Everything one (T, D, H, precision, device) backward needs on the GPU, built once."""

    def __init__(self, tokens, dim, hidden_dim, precision, device_id, need_grad_hidden=True,
                 need_weight_grads=True, options=_options.DEFAULT):
        import cupy

        if not isinstance(options, _options.EngineOptions):
            raise TypeError(f"options must be a cupyffn._options.EngineOptions; got {options!r}")
        self.T, self.D, self.H = tokens, dim, hidden_dim
        self.options = options  # every mechanism choice this plan makes (cupyffn/_options.py)
        self.max_k = options.max_k  # the longest K one GEMM accumulator sums (_ksplit; None: unbounded)
        self.precision = precision
        self.device_id = device_id
        self.need_grad_hidden = need_grad_hidden
        self.need_weight_grads = need_weight_grads
        self._closed = False
        self._handles = []
        with cupy.cuda.Device(device_id):
            self._alloc_stream_ptr = cupy.cuda.get_current_stream().ptr
            if _plan_cache.is_capturing(self._alloc_stream_ptr):  # the zero fills below would join that capture
                raise RuntimeError("cupyffn cannot build a backward plan while CuPy's current stream is being captured "
                                   "into a CUDA graph: build it (or make one call) before the capture begins")
            self._allocate_state()
            self._choose_forms()
            self.fused_gemm1 = self._fused_gemm1_ok()
            self.gelu_epilogue_ok = self._gelu_epilogue_ok()
            self.gelu_in_gemm1 = False  # this call's: the epilogue forms gelu_out (memory mode; _select_mode)
            self.epilogue_warps = self._epilogue_warps_ok()
            self._layout()
            self._allocate()
            self._side = cupy.cuda.Stream(non_blocking=True)
            (self._ev_start, self._ev_a, self._ev_b, self._ev_d, self._ev_side,
             self._ev_done) = (cupy.cuda.Event(disable_timing=True) for _ in range(6))
            self._last_stream_ptr = None
            self.side_in_capture = False  # a captured call made the side stream join a caller's capture
            self.side_capture_stream = 0  # ... on this stream of the caller's (its capture holds the side stream)
            self._ieee_gelu = None  # (names, launch, None) once memory mode needs it (ieee only)
            self._recompute_g = False
            self._accumulate = False
            # eager calls as a re-pointed CUDA graph (launch_graph, cupyffn/_call_graph.py): per key (graph_key)
            self.call_graph = False  # decided once the GEMMs are built (_call_graph_ok)
            self._call_graphs = {}
            self._recorder = None  # the CallGraph being captured: enqueue reports its kernel launches to it
            self._graph_stream = self._table = self._store_table = None
            self._main = _cublas.acquire(device_id)
            self._handles.append(self._main)
            if need_weight_grads:
                self._sidecar = _cublas.acquire(device_id)
                self._handles.append(self._sidecar)
                self._sidecar.bind(self._side.ptr)
            if self._fp8:  # the e4m3 GEMMs' cuBLASLt handles now, not inside a call a caller may be capturing
                for handle in self._handles:
                    handle.lt
            if tokens > 0:
                self._build_launches()
                self._build_gemms()
            self.call_graph = self._call_graph_ok()
            self._select_mode(False)
            # The zero-filled state and constants were enqueued on the current stream: the first call
            # on any other stream waits for them (order_after_previous).
            self.record_done(self._alloc_stream_ptr)
            self._last_stream_ptr = self._alloc_stream_ptr

    # ------------------------------------------------------------------ layout and memory
    def _choose_forms(self):
        """The form of each GEMM this plan runs: the recipe's table at T, bf16x3 where the pair does not fit
        (_precision.pair_fits) or cuBLASLt offers no algorithm for its e4m3 GEMM (built here, once)."""
        present = ["gemm1"] + (["gemm2", "gemm4"] if self.need_weight_grads else []) + \
            (["gemm3"] if self.need_grad_hidden else [])
        forms = P.effective_forms(self.precision, self.T, self.D, self.H)
        self.forms = {g: forms[g] for g in sorted(present)}
        self._fp8 = {}
        self.form_notes = {}  # gemm -> why it fell back to bf16x3
        self.sm90_pair = set()  # GEMMs whose pair runs as the sm90 kernel (no cuBLASLt plan)
        if self.precision.fmt == P.FMT_F16E4M3 and self.T > 0:
            on_sm90 = self._sm90_pair_gemms()
            for g, form in self.forms.items():
                if form.name != "f16+e4m3":
                    continue
                if g in on_sm90:
                    self.sm90_pair.add(g)
                    continue
                if g == "gemm1":  # cuBLAS's two products are slower than bf16x3 there (FORM_TABLE)
                    self.forms[g] = P.FORMS["bf16x3"]
                    self.form_notes[g] = ("GEMM1's pair runs only as the sm90 pair kernel, which this plan does not "
                                          "use (EngineOptions(sm90_pair=False), not a compute capability 9.0 GPU, "
                                          "or D or H not a multiple of 8)")
                    continue
                try:
                    self._fp8[g], _ = _gemm.build(self._fp8_desc(g), self.device_id, backends=(_gemm.CUBLASLT,),
                                                  max_k=self.max_k, one_ptr=self._consts.data.ptr + 4)
                except _gemm.Unsupported as e:
                    self.forms[g] = P.FORMS["bf16x3"]
                    self.form_notes[g] = str(e)
        # The operand format this plan converts to: the recipe's, except that a fp16+fp8 plan whose GEMMs all
        # run bf16x3 is the bf16x3 plan (its kernels and its lean layout).
        names = {f.name for f in self.forms.values()}
        uniform = P.FORMS[names.pop()] if len(names) == 1 else None
        if self.precision.fmt == P.FMT_F16E4M3 and uniform is not None and uniform.name == "bf16x3":
            self.fmt, self.planes = uniform.fmt, uniform.planes
        else:
            self.fmt, self.planes = self.precision.fmt, self.precision.planes

    def _fused_gemm1_ok(self):
        """GEMM1 + dgelu as one sm90 kernel (module docstring): the tf32 plan's fp16 or the bf16x3 plan's bf16
        operands, a compute capability 9.0 GPU, rows of 16-byte multiples for the TMA unit (D, H multiples of 8)."""
        # a format FUSED_GEMM1_TOKENS does not list fuses only when asked to (True)
        wanted = option_wanted(self.options.fused_gemm1, FUSED_GEMM1_TOKENS, self.fmt, self.T)
        return (wanted and self.fmt in FUSABLE_FORMATS and self.T > 0 and self._sm90_fits()
                and not _ksplit.chunked(max(self.planes, 1) * self.D, self.max_k))  # one accumulator sums all of K

    def _gelu_epilogue_ok(self):
        """Whether the fused GEMM1 can write gelu_out's codes for GEMM2 in calls without gelu_out (memory mode;
        GELU_EPILOGUE_TOKENS; options.gelu_epilogue: auto, True, False): the tf32 plan's fused GEMM1, in a plan that
        computes the weight gradients."""
        wanted = option_wanted(self.options.gelu_epilogue, GELU_EPILOGUE_TOKENS, self.fmt, self.T)
        return wanted and self.fused_gemm1 and self.fmt == P.FMT_F16S and self.need_weight_grads

    def _epilogue_warps_ok(self):
        """Whether the tf32 plan's fused GEMM1 runs its epilogue in warps of its own (EPILOGUE_WARPS_TOKENS;
        options.epilogue_warps: auto, True, False)."""
        wanted = option_wanted(self.options.epilogue_warps, EPILOGUE_WARPS_TOKENS, self.fmt, self.T)
        return wanted and self.fused_gemm1 and self.fmt == P.FMT_F16S

    def _sm90_fits(self):
        """Whether the sm90 kernels can run this plan's GEMMs: a compute capability 9.0 GPU, 16-bit rows of 16-byte
        multiples for the TMA unit (D, H multiples of 8; the e4m3 pairs' rows always are), T below 2^31."""
        return (self.D % 8 == 0 and self.H % 8 == 0 and self.T < 2 ** 31
                and _sm90_gemm.device_supported(self.device_id))

    def _sm90_pair_gemms(self):
        """The GEMMs whose f16+e4m3 form runs as one sm90 pair kernel (SM90_PAIR_GEMMS; options.sm90_pair: auto, True
        every pair GEMM (comparisons), False none), where the kernel can run (_sm90_fits)."""
        choice = self.options.sm90_pair
        if choice is False or not self._sm90_fits():
            return set()
        gemms = set(P.GEMMS) if choice else set(SM90_PAIR_GEMMS)
        # the kernel sums all of K (and the pair's doubled K) in one accumulator
        return {g for g in gemms if not _ksplit.chunked(2 * _pad16(self._mnk(g)[2]), self.max_k)}

    def _convert_ab_ok(self):
        """convert A and B as one launch (CONVERT_AB_TOKENS; options.convert_ab: auto, True, False)."""
        wanted = option_wanted(self.options.convert_ab, CONVERT_AB_TOKENS, self.fmt, self.T)
        return wanted and self.fmt == P.FMT_F16S and len(self.cvt_a + self.cvt_b) <= _kernels.MAX_JOBS

    def _call_graph_ok(self):
        """Whether eager calls run as a call graph. Possible for every plan but fp16+fp8 (its cuBLASLt GEMMs take
        their output address on the host; cuBLASLt has no device pointer table). options.call_graph: auto (default)
        where CALL_GRAPH_TOKENS lists the plan's format and T, True wherever possible, False never."""
        wanted = option_wanted(self.options.call_graph, CALL_GRAPH_TOKENS, self.fmt, self.T)
        return wanted and self.T > 0 and self.fmt != P.FMT_F16E4M3 and not self.k_chunked

    @property
    def k_chunked(self):
        """{gemm: chunks} of the GEMMs this plan runs in more than one K-chunk (cupyffn/_ksplit.py)."""
        out = {}
        for g, plan in ((g, getattr(self, g, None)) for g in ("gemm1", "gemm2", "gemm3", "gemm4")):
            if plan is not None and _gemm.chunk_count(plan) > 1:
                out[g] = _gemm.chunk_count(plan)
        return out

    @property
    def gemm_forms(self):
        """{gemm: form name} this plan runs."""
        return {g: f.name for g, f in self.forms.items()}

    # gemm -> its A and B operands with the orientation of their e4m3 pair ("n": K is the operand's column
    # dimension, "t": its row dimension; the layout is in kernels_cu/split_e4m3.cu's header)
    _E4M3_USES = {"gemm1": (("grad_output", "n"), ("weight2", "t")),
                  "gemm2": (("grad_output", "t"), ("gelu_out", "t")),
                  "gemm3": (("grad_linear1", "n"), ("weight1", "t")),
                  "gemm4": (("grad_linear1", "t"), ("hidden_states", "t"))}

    def _dims(self, letters):
        return P.dims(letters, self.T, self.D, self.H)

    def _mnk(self, g):
        return self._dims(P.GEMM_MNK[g])

    def _fp8_desc(self, g):
        m, n, k = self._mnk(g)
        kp = _pad16(k)
        return _gemm.GemmDesc(f"{g} e4m3 cross terms", m, n, 2 * kp, _cublas.R_8F_E4M3, _cublas.R_8F_E4M3,
                              b_trans=True, lda=2 * kp, ldb=2 * kp, ldc=n,
                              a_scale=self._consts.data.ptr + 4 * 8)

    def _layout(self):
        T, D, H = self.T, self.D, self.H
        wg, gh = self.need_weight_grads, self.need_grad_hidden
        self.gg_bytes = 0 if self.fused_gemm1 else 4 * T * H  # the fused GEMM1 never writes grad_gelu
        ops = {}
        if self.fmt == P.FMT_F16E4M3:
            return self._layout_f16e4m3()
        if self.planes:
            p = self.planes
            ops["grad_output"] = _Operand("grad_output", T, D, True, p)
            ops["weight2"] = _Operand("weight2", D, H, False, p)
            if wg:
                ops["gelu_out"] = _Operand("gelu_out", T, H, True, p)
                ops["hidden_states"] = _Operand("hidden_states", T, D, True, p)
            if gh:
                ops["weight1"] = _Operand("weight1", H, D, False, p)
            ops["grad_linear1"] = _Operand("grad_linear1", T, H, True, p)
        self.ops = ops
        late = [n for n in ("weight1", "hidden_states") if n in ops]
        self.lean = (self.fmt == P.FMT_BF16X3 and wg
                     and self.gg_bytes >= sum(_align(ops[n].nbytes) for n in late))
        offset = _align(self.gg_bytes)  # grad_gelu first, at offset 0
        for name, op in ops.items():
            if self.lean and name in late:
                continue
            if self.lean and name == "grad_linear1":
                continue
            op.offset = offset
            offset += _align(op.nbytes)
        if self.lean:
            ops["grad_linear1"].offset = ops["gelu_out"].offset
            inner = 0
            for name in late:
                ops[name].offset = inner
                inner += _align(ops[name].nbytes)
        self.scratch_bytes = offset
        present = lambda names: [n for n in names if n in ops]  # noqa: E731
        self.cvt_a = present(("grad_output", "weight2"))
        self.cvt_b = present(("gelu_out",) if self.lean else ("gelu_out", "hidden_states", "weight1"))
        self.convert_ab = self._convert_ab_ok()
        # per mode (gelu_out formed in GEMM1's epilogue or not): what convert A and convert B write
        self._cvt_modes = {}
        for epilogue in (False, True) if self.gelu_epilogue_ok else (False,):
            a, b = list(self.cvt_a), [n for n in self.cvt_b if not (epilogue and n == "gelu_out")]
            self._cvt_modes[epilogue] = (a + b, []) if self.convert_ab else (a, b)
        self.cvt_late = late if self.lean else []

    _ROWS_COLS = {"grad_output": "TD", "weight2": "DH", "gelu_out": "TH", "hidden_states": "TD", "weight1": "HD",
                  "grad_linear1": "TH"}
    _ACTIVATIONS = ("grad_output", "gelu_out", "hidden_states", "grad_linear1")

    def _layout_f16e4m3(self):
        """fp16+fp8: each operand in the encodings its GEMMs' forms read (ops[name] = fp16, ops[name + ".x3"]
        = bf16x3 planes, ops[name + ".e4n" / ".e4t"] = e4m3 pairs, natural / transposed), all in one scratch
        after grad_gelu. The e4m3 padding columns must be zero: _allocate zero-fills the scratch once."""
        need = {}
        for g, form in self.forms.items():
            (a, a_or), (b, b_or) = self._E4M3_USES[g]
            for name, orient, order in ((a, a_or, 0), (b, b_or, 1)):
                enc = need.setdefault(name, {})
                if form.name == "bf16x3":
                    enc["x3"] = None
                else:
                    enc["f16"] = None
                    enc["e4" + orient] = order
        ops = {}
        self.e4m3_order = {}
        for name in ("grad_output", "weight2", "gelu_out", "hidden_states", "weight1", "grad_linear1"):
            if name not in need:
                continue
            rows, cols = self._dims(self._ROWS_COLS[name])
            inter = name in self._ACTIVATIONS
            enc = need[name]
            if "f16" in enc:
                ops[name] = _Operand(name, rows, cols, inter, 1)
            if "x3" in enc:
                ops[name + ".x3"] = _Operand(name, rows, cols, inter, 3)
            for orient in ("n", "t"):
                if "e4" + orient in enc:
                    op = _Operand(name, rows, cols, False, 1)
                    k = cols if orient == "n" else rows
                    op.kpad = _pad16(k)
                    op.dst_ld = 2 * op.kpad
                    op.nbytes = (rows if orient == "n" else cols) * op.dst_ld
                    ops[f"{name}.e4{orient}"] = op
                    self.e4m3_order[f"{name}.e4{orient}"] = enc["e4" + orient]
        self.ops = ops
        self.lean = False
        self.convert_ab = False
        offset = _align(self.gg_bytes)
        for op in ops.values():
            op.offset = offset
            offset += _align(op.nbytes)
        self.scratch_bytes = offset
        present = [n for n in ("grad_output", "weight2", "gelu_out", "hidden_states", "weight1") if n in need]
        self.cvt_a = [n for n in present if n in ("grad_output", "weight2")]
        self.cvt_b = [n for n in present if n not in ("grad_output", "weight2")]
        self._cvt_modes = {False: (self.cvt_a, self.cvt_b)}
        self.cvt_late = []

    @property
    def workspace_bytes(self):
        """cuBLAS workspaces of this engine's handles (they stay with the handle pool)."""
        return _cublas.WORKSPACE_BYTES * (2 if self.need_weight_grads else 1)

    def _allocate_state(self):
        """fp16 scale state and the constants: consts[0] = 0, [1] = 1, [2 + g] = alpha of GEMM g,
        [8] = the e4m3 pair's A scale (kernels_cu/common.cuh lists [0..5])."""
        import cupy

        try:
            self._state = cupy.zeros(4 * _kernels.STATE_SLOTS, dtype=cupy.int32)
            # [8]: on a 16-byte boundary, where cuBLASLt wants a scale pointer (see _cublaslt.LtMatmul)
            self._consts = cupy.asarray([0, 1, 1, 1, 1, 1, 0, 0, P.E4M3_PAIR_SCALE, 0, 0, 0], dtype=cupy.float32)
        except cupy.cuda.memory.OutOfMemoryError as e:
            raise MemoryError(f"cupyffn could not allocate its 160-byte scale state: {e}") from None

    def _allocate(self):
        import cupy

        try:
            self._scratch = cupy.cuda.alloc(max(self.scratch_bytes, _ALIGN))
            if self.fmt == P.FMT_F16E4M3:  # the e4m3 pairs' K padding must read as zeros
                from cupy_backends.cuda.api import runtime

                runtime.memsetAsync(self._scratch.ptr, 0, max(self.scratch_bytes, _ALIGN), self._alloc_stream_ptr)
        except cupy.cuda.memory.OutOfMemoryError as e:
            raise MemoryError(
                f"cupyffn needs {self.scratch_bytes} bytes ({self.scratch_bytes / 2**20:.1f} MiB) of device scratch "
                f"for T={self.T}, D={self.D}, H={self.H}, precision={self.precision.name!r} and could not allocate "
                f"it: {e}") from None
        self._base = self._scratch.ptr

    def _addr(self, name):
        return self._base + self.ops[name].offset

    # ------------------------------------------------------------------ kernels and GEMMs
    def _split_spec(self, name):
        """The split_e4m3 job of operand `name`: every encoding the layout gave it (_layout_f16e4m3)."""
        rows, cols = self._dims(self._ROWS_COLS[name])
        spec = _kernels.SplitSpec(rows, cols, P.SLOT[name])
        if name in self.ops:
            spec.f16 = (self._addr(name), self.ops[name].dst_ld)
        if name + ".x3" in self.ops:
            op = self.ops[name + ".x3"]
            spec.x3 = (self._addr(name + ".x3"), op.dst_ld, op.part_stride, P.PATTERN[name])
        for orient in ("n", "t"):
            key = f"{name}.e4{orient}"
            if key in self.ops:
                op = self.ops[key]
                setattr(spec, "e4" + orient, (self._addr(key), op.dst_ld, op.kpad, self.e4m3_order[key]))
        return spec

    def _build_split_launches(self):
        """fp16+fp8: convert A / convert B / dgelu as split_e4m3 launches, each a gathering pass and a rescue
        pass (the fp16 scales, as for tf32)."""
        dev = self.device_id
        sms = _kernels.sm_count(dev)
        vp = ctypes.c_void_p
        self._state_ptr = vp(self._state.data.ptr)
        self._consts_ptr = vp(self._consts.data.ptr)
        self._convert = {}
        for stage, names, alpha_mask, counter in (("convert A", self.cvt_a, 0b0001, 0),
                                                  ("convert B", self.cvt_b, 0b0010, 1)):
            if not names:
                continue
            kernel, full = _kernels.split_kernel(0, dev)  # the variant of _kernels.SPLIT_VARIANT
            specs = [self._split_spec(n) for n in names]
            first = _kernels.split_launch(kernel, specs, full, 0, counter, 0, self._state_ptr, self._consts_ptr)
            rescue = _kernels.split_launch(kernel, specs, max(len(specs), 2 * sms), 1, counter, alpha_mask,
                                           self._state_ptr, self._consts_ptr)
            self._convert[stage] = (names, first, rescue)
        self._modes = {False: (self.cvt_a, self.cvt_b, self._convert, None, None, None)}
        kernel, full = _kernels.split_kernel(1, dev)
        spec = [self._split_spec("grad_linear1")]
        self._dgelu = _kernels.split_launch(kernel, spec, full, 0, 2, 0, self._state_ptr, self._consts_ptr)
        self._dgelu_rescue = _kernels.split_launch(kernel, spec, 2 * sms, 1, 2, 0b1100, self._state_ptr,
                                                   self._consts_ptr)

    def _set_io_split(self, l1, t, g, src):
        """fp16+fp8: this call's sources of the split_e4m3 jobs."""
        for names, *launches in self._convert.values():
            for launch in launches:
                for k, name in enumerate(names):
                    job = launch.args[0].job[k]
                    if name == "gelu_out" and g is None:  # memory mode: gelu_out from linear1_out
                        _kernels.split_set_sources(job, (l1.ptr, l1.ld), None if t is None else (t.ptr, t.ld), kind=1)
                    else:
                        m = src[name]
                        _kernels.split_set_sources(job, (m.ptr, m.ld), kind=0)
        for launch in (self._dgelu, self._dgelu_rescue):
            _kernels.split_set_sources(launch.args[0].job[0], (self._base, self.H), (l1.ptr, l1.ld),
                                       None if t is None else (t.ptr, t.ld))

    def _build_launches(self):
        if self.fmt == P.FMT_F16E4M3:
            return self._build_split_launches()
        dev = self.device_id
        fmt = self.fmt
        f16 = fmt == P.FMT_F16S
        vp = ctypes.c_void_p
        self._state_ptr = vp(self._state.data.ptr)
        self._consts_ptr = vp(self._consts.data.ptr)
        sms = _kernels.sm_count(dev)
        self._modes = {}
        for epilogue, (cvt_a, cvt_b) in self._cvt_modes.items():
            # stage -> (names, alpha mask of its rescue pass, arrival counter)
            # (convert_ab: one launch for both, whose rescue pass writes GEMM1's and GEMM2's alphas; gelu_out from
            # the epilogue: GEMM2's alpha is the fused rescue launch's, once gelu_out's exponent is decided)
            gemm2_alpha = 0 if epilogue else 0b0010
            stages = {"convert A": (cvt_a, 0b0001 | (gemm2_alpha if self.convert_ab else 0), 0),
                      "convert B": (cvt_b, gemm2_alpha, 1),
                      "convert late": (self.cvt_late, 0, 3)}
            convert = {}
            for stage, (names, alpha_mask, counter) in stages.items():
                if not names:
                    continue
                expr = f"convert_kernel<{fmt}>"
                kernel = _kernels.get_function("convert", expr, dev)
                full = sms * _kernels.blocks_per_sm("convert", expr, dev) * 2
                first = self._convert_launch(kernel, names, full, rescue=0, counter=counter, alpha_mask=0)
                rescue = None
                if f16:  # a small grid: when nothing needs converting again its blocks only read a flag
                    rescue = self._convert_launch(kernel, names, 2 * sms, rescue=1, counter=counter,
                                                  alpha_mask=alpha_mask)
                convert[stage] = (names, first, rescue)
            fused = self._build_fused_gemm1(epilogue) if self.fused_gemm1 else (None, None, None)
            self._modes[epilogue] = (cvt_a, cvt_b, convert) + fused
        if self.fused_gemm1:
            self._dgelu = self._dgelu_rescue = None
            return
        expr = f"dgelu_kernel<{fmt}>"
        kernel = _kernels.get_function("dgelu", expr, dev)
        grid = max(1, min(_items(self.T, self.H), sms * _kernels.blocks_per_sm("dgelu", expr, dev) * 2))
        self._dgelu = self._dgelu_launch(kernel, grid, rescue=0)
        self._dgelu_rescue = self._dgelu_launch(kernel, min(grid, 2 * sms), rescue=1) if f16 else None

    def _build_fused_gemm1(self, gelu_epilogue):
        """The fused GEMM1 + dgelu (module docstring) as (launch, rescue launch, decision): tf32, its gathering and
        rescue launches and the decision between them, also writing gelu_out's codes if `gelu_epilogue`; bf16x3,
        one launch (no scale to decide)."""
        # A: grad_output [T, planes * D]; B: weight2 [planes * D, H] as stored ("kn"); out: grad_linear1
        # [T, planes * H] (tf32: one fp16 plane; bf16x3: K tripled, planes (hi, lo, hi) side by side)
        p = self.planes
        where = (self._addr("grad_output"), p * self.D, self._addr("weight2"), self.H, "kn",
                 self._addr("grad_linear1"), p * self.H, self.T, self.H, p * self.D)
        if self.fmt == P.FMT_BF16X3:
            fused = _sm90_gemm.DgeluLaunch(*where, state_ptr=None, consts_ptr=None, acc_scale_ptr=None, slot=0,
                                           rescue=False, alpha_mask=0, device_id=self.device_id,
                                           epi=_sm90_gemm.EPI_DGELU_BF16X3)
            return fused, None, None
        slot = P.SLOT["grad_linear1"]
        common = dict(state_ptr=self._state.data.ptr, consts_ptr=self._consts.data.ptr,
                      acc_scale_ptr=self._consts.data.ptr + 4 * 2, slot=slot, device_id=self.device_id,
                      warps=self.epilogue_warps)
        decided, alphas = 1 << slot, 0b1100  # grad_linear1's exponent; GEMM3's and GEMM4's alphas
        if gelu_epilogue:  # and gelu_out's (its partner, grad_output, is final); GEMM2's alpha
            g = self.ops["gelu_out"]
            common.update(gelu_ptr=self._addr("gelu_out"), ldg=g.dst_ld, gelu_slot=P.SLOT["gelu_out"])
            decided, alphas = decided | 1 << P.SLOT["gelu_out"], alphas | 0b0010
        fused = _sm90_gemm.DgeluLaunch(*where, rescue=False, alpha_mask=0, **common)
        fused_rescue = _sm90_gemm.DgeluLaunch(*where, rescue=True, alpha_mask=alphas, **common)
        decide = _kernels.get_function("dgelu", "f16_decide_kernel", self.device_id)
        decide = _kernels.KernelLaunch(decide, ctypes.c_void_p(self._state.data.ptr), ctypes.c_int(decided))
        decide.block = 32
        return fused, fused_rescue, decide

    def _select_mode(self, gelu_epilogue):
        """Take the launches of one mode (_build_launches): gelu_out formed in GEMM1's epilogue (a memory-mode call of
        a plan with gelu_epilogue_ok) or converted by convert B (every other call)."""
        self.gelu_in_gemm1 = bool(gelu_epilogue)
        modes = getattr(self, "_modes", None)
        if modes is None:  # T = 0: nothing is launched
            self.cvt_a, self.cvt_b = self._cvt_modes[False]
            return
        (self.cvt_a, self.cvt_b, self._convert, self._fused, self._fused_rescue,
         self._decide) = modes[self.gelu_in_gemm1]

    def _ensure_ieee_gelu(self):
        """ieee memory mode: GEMM2 reads gelu_out in fp32, so recompute it into scratch (built on first use)."""
        if self._ieee_gelu is not None:
            return
        import cupy

        try:
            self._ieee_g = cupy.cuda.alloc(4 * self.T * self.H)
        except cupy.cuda.memory.OutOfMemoryError as e:
            raise MemoryError(f"cupyffn needs {4 * self.T * self.H} bytes to recompute gelu_out (memory mode): {e}") from None
        self.scratch_bytes += 4 * self.T * self.H
        kernel = _kernels.get_function("convert", "convert_kernel<0>", self.device_id)
        full = _kernels.sm_count(self.device_id) * _kernels.blocks_per_sm("convert", "convert_kernel<0>", self.device_id) * 2
        target = (_Operand("gelu_out", self.T, self.H, True, 1), self._ieee_g.ptr)  # fp32, row stride H
        launch = self._convert_launch(kernel, ["gelu_out"], full, rescue=0, counter=1, alpha_mask=0,
                                      targets={"gelu_out": target})
        self._ieee_gelu = (["gelu_out"], launch, None)

    def _convert_launch(self, kernel, names, total_blocks, rescue, counter, alpha_mask, targets=None):
        """A convert launch for `names`; `targets` maps a name to (geometry, address) outside the scratch layout."""
        placed = [(targets[n] if targets else (self.ops[n], self._addr(n))) + (P.PATTERN[n], P.SLOT[n]) for n in names]
        return convert_launch(kernel, placed, total_blocks, rescue, counter, alpha_mask, self._state_ptr,
                              self._consts_ptr)

    def _dgelu_launch(self, kernel, grid, rescue):
        job = _kernels.DgeluJob()
        job.grad_gelu = self._base
        job.grad_gelu_ld = self.H
        if self.planes:
            op = self.ops["grad_linear1"]
            job.dst = self._addr("grad_linear1")
            job.dst_ld = op.dst_ld
            job.part_stride = op.part_stride
        else:  # ieee: grad_linear1 overwrites grad_gelu in place
            job.dst = self._base
            job.dst_ld = self.H
        job.rows = self.T
        job.cols = self.H
        job.pattern = P.PATTERN["grad_linear1"]
        job.slot = P.SLOT["grad_linear1"]
        job.rescue = rescue
        job.counter = 2
        job.alpha_mask = 0b1100
        launch = _kernels.KernelLaunch(kernel, job, self._state_ptr, self._consts_ptr)
        launch.grid = grid
        return launch

    def _gemm16(self, g, planes, dtype):
        """The 16-bit (or fp32) GEMM `g` over operands with `planes` planes stacked along K (engine layouts)."""
        m, n, k = self._mnk(g)
        kp = max(planes, 1)
        trans = g in ("gemm2", "gemm4")  # the weight gradients read their A operand (T rows) transposed
        names = {"gemm1": "grad_gelu = grad_output @ weight2", "gemm2": "grad_weight2 = grad_output^T @ gelu_out",
                 "gemm3": "grad_hidden = grad_linear1 @ weight1", "gemm4": "grad_weight1 = grad_linear1^T @ hidden_states"}
        desc = _gemm.GemmDesc(names[g], m, n, kp * k, dtype, dtype, a_trans=trans, ldc=n)
        # every form, fp32 SGEMM included (its error grows with K too: docs/decisions/001-k-chunks.md)
        plan, _ = _gemm.build(desc, self.device_id, backends=(_gemm.CUBLAS,), max_k=self.max_k,
                              one_ptr=self._consts.data.ptr + 4)
        return plan

    def _point(self, plan, g, a, b, planes):
        """Operand pointers and leading dimensions of a 16-bit GEMM over the scratch operands a, b."""
        oa, ob = self.ops[a], self.ops[b]
        plan.a.value, plan.b.value = self._addr(a), self._addr(b)
        if g in ("gemm2", "gemm4"):  # A is [T, planes * cols] read as [planes * T, cols] transposed
            plan.lda.value = oa.cols
        else:  # grad_output / grad_linear1 [T, planes * cols]
            plan.lda.value = planes * oa.cols
        plan.ldb.value = ob.cols

    def _build_gemms(self):
        """Each GEMM in its form: PairGemm for f16+e4m3 (the e4m3 cross terms, then fp16 hi*hi with beta 1),
        else one cublasGemmEx over the operands' planes stacked along K (fp32 as given for ieee)."""
        consts = self._consts.data.ptr
        split = self.fmt == P.FMT_F16E4M3  # operands in several encodings: ops[name + ".x3"] are the bf16 planes
        self.gemm1 = self.gemm2 = self.gemm3 = self.gemm4 = None
        for index, g in enumerate(("gemm1", "gemm2", "gemm3", "gemm4")):
            if g not in self.forms or (g == "gemm1" and self.fused_gemm1):
                continue
            form = self.forms[g]
            alpha = consts + 4 * (2 + index)
            (a, a_or), (b, b_or) = self._E4M3_USES[g]
            if form.name == "f16+e4m3" and g in self.sm90_pair:
                plan = self._sm90_pair_plan(g, alpha, a, a_or, b, b_or)
            elif form.name == "f16+e4m3":
                f16 = self._gemm16(g, 1, _cublas.R_16F)
                f16.alpha.value = alpha
                self._point(f16, g, a, b, 1)
                fp8 = self._fp8[g]
                fp8.alpha.value, fp8.beta.value = alpha, consts
                fp8.a.value, fp8.b.value = self._addr(f"{a}.e4{a_or}"), self._addr(f"{b}.e4{b_or}")
                plan = _gemm.PairGemm(fp8, f16, consts + 4, f16.name)
            else:
                plan = self._gemm16(g, form.planes, _gemm.OPERAND_TYPE[form.fmt])
                # beside fp16+fp8's scaled encodings the bf16 planes carry no scale: alpha 1, not GEMM g's
                plan.alpha.value, plan.beta.value = (consts + 4 if split else alpha), consts
                if split:
                    a, b = a + ".x3", b + ".x3"
                if form.planes:
                    self._point(plan, g, a, b, form.planes)
                elif g in ("gemm3", "gemm4"):  # ieee reads grad_linear1 in place (the other pointers: set_io)
                    plan.a.value, plan.lda.value = self._base, self.H
            setattr(self, g, plan)
        if self.gemm1 is not None:
            _gemm.set_output(self.gemm1, self._base)

    def _sm90_pair_plan(self, g, alpha_ptr, a, a_or, b, b_or):
        """GEMM g's f16+e4m3 form as one sm90 pair launch over the scratch operands: the fp16 A ([T, cols] read
        MN-major for the weight gradients) and B ([K, N] as stored) and the e4m3 pairs (_E4M3_USES)."""
        m, n, k = self._mnk(g)
        a8, b8 = f"{a}.e4{a_or}", f"{b}.e4{b_or}"
        k8 = self.ops[a8].dst_ld  # bytes per row of a pair: 2 * K padded to 16, the same for both
        block_n, pingpong = _sm90_gemm.choose_pair_config(m, n, _kernels.sm_count(self.device_id))
        launch = _sm90_gemm.PairLaunch(
            self._addr(a), self.ops[a].dst_ld, "km" if g in ("gemm2", "gemm4") else "mk", self._addr(b),
            self.ops[b].dst_ld, "kn", self._addr(a8), k8, self._addr(b8), self.ops[b8].dst_ld, m, n, k, k8,
            device_id=self.device_id, alpha_ptr=alpha_ptr, pair_scale=P.E4M3_PAIR_SCALE, block_n=block_n,
            pingpong=pingpong, ldc=n)
        return _gemm.Sm90PairGemm(launch, f"{g} f16+e4m3 (sm90 pair kernel)")

    # ------------------------------------------------------------------ per call
    def set_io(self, inputs, outputs, accumulate):
        """Point the prebuilt launches at this call's arrays (Matrix views) and outputs (device pointers)."""
        dy, x, w1, w2, l1, t, g = inputs
        src = {"grad_output": dy, "hidden_states": x, "weight1": w1, "weight2": w2, "gelu_out": g}
        self._recompute_g = g is None and self.need_weight_grads  # memory mode: gelu_out from linear1_out
        # a given gelu_out is used as given; only a missing one may be formed in GEMM1's epilogue
        self._select_mode(self._recompute_g and self.gelu_epilogue_ok)
        if self.fmt == P.FMT_F16E4M3:
            self._set_io_split(l1, t, g, src)
            return self._set_outputs(outputs, accumulate)
        if self._recompute_g and not self.planes:
            self._ensure_ieee_gelu()
        stages = list(self._convert.values())
        if self._ieee_gelu is not None:
            stages.append(self._ieee_gelu)
        for names, *launches in stages:
            for launch in launches:
                if launch is None:
                    continue
                jobs = launch.args[0]
                for k, name in enumerate(names):
                    job = jobs.job[k]
                    if name == "gelu_out" and g is None:
                        job.kind, job.src, job.src_ld = 1, l1.ptr, l1.ld
                        job.src2, job.src2_ld = (t.ptr, t.ld) if t is not None else (0, 0)
                        ok = _vec_ok(l1.ptr, l1.ld, l1.cols) and (t is None or _vec_ok(t.ptr, t.ld, t.cols))
                    else:
                        m = src[name]
                        job.kind, job.src, job.src_ld, job.src2, job.src2_ld = 0, m.ptr, m.ld, 0, 0
                        ok = _vec_ok(m.ptr, m.ld, m.cols)
                    dst_item = 4 if not self.planes else 2
                    job.vec = int(ok and _vec_ok(job.dst, job.dst_ld, job.cols, dst_item)
                                  and (job.part_stride * dst_item) % 16 == 0)
        if self.fused_gemm1:
            for launch in (self._fused, self._fused_rescue):
                if launch is not None:
                    launch.set_activations(l1.ptr, l1.ld, t.ptr if t is not None else 0, t.ld if t is not None else 0)
        for launch in (self._dgelu, self._dgelu_rescue):
            if launch is None:
                continue
            job = launch.args[0]
            job.x, job.x_ld = l1.ptr, l1.ld
            job.t, job.t_ld = (t.ptr, t.ld) if t is not None else (0, 0)  # 0: recomputed in the kernel
            job.vec = int(_vec_ok(l1.ptr, l1.ld, self.H) and (t is None or _vec_ok(t.ptr, t.ld, self.H))
                          and _vec_ok(self._base, self.H, self.H)
                          and _vec_ok(job.dst, job.dst_ld, self.H, 2 if self.planes else 4)
                          and (job.part_stride * 2) % 16 == 0)
        if not self.planes:
            self.gemm1.a.value, self.gemm1.lda.value = dy.ptr, dy.ld
            self.gemm1.b.value, self.gemm1.ldb.value = w2.ptr, w2.ld
            if self.gemm2 is not None:
                self.gemm2.a.value, self.gemm2.lda.value = dy.ptr, dy.ld
                if g is not None:
                    self.gemm2.b.value, self.gemm2.ldb.value = g.ptr, g.ld
                else:  # gelu_out recomputed into fp32 scratch
                    self.gemm2.b.value, self.gemm2.ldb.value = self._ieee_g.ptr, self.H
                self.gemm4.b.value, self.gemm4.ldb.value = x.ptr, x.ld
            if self.gemm3 is not None:
                self.gemm3.b.value, self.gemm3.ldb.value = w1.ptr, w1.ld
        self._set_outputs(outputs, accumulate)

    def _set_outputs(self, outputs, accumulate):
        grad_hidden, grad_w1, grad_w2 = outputs
        self._accumulate = bool(accumulate)
        beta = self._consts.data.ptr + (4 if accumulate else 0)
        if self.gemm3 is not None:
            _gemm.set_output(self.gemm3, grad_hidden)
        if self.gemm2 is not None:
            _gemm.set_output(self.gemm2, grad_w2)
            _gemm.set_output(self.gemm4, grad_w1)
            _gemm.set_beta(self.gemm2, beta, accumulate)
            _gemm.set_beta(self.gemm4, beta, accumulate)

    def _launch(self, launch, stream_ptr):
        """One of our kernels (KernelLaunch, DgeluLaunch); while a call graph is captured, its node is noted."""
        launch(stream_ptr)
        if self._recorder is not None:
            self._recorder.record(launch, stream_ptr)

    def _gemm(self, index, plan, handle):
        """GEMM `index` (0..3); while a call graph is captured, as the form that reads its operand addresses from
        the call table's entry `index` (_cublas.Gemm.indirect)."""
        if self._recorder is not None:
            plan.indirect(handle, self._table.ptr + ctypes.sizeof(_kernels.GemmPointers) * index)
        else:
            plan(handle)

    def _convert_stage(self, stage, stream_ptr, mark):
        if stage in self._convert:
            _, first, rescue = self._convert[stage]
            self._launch(first, stream_ptr)
            mark(stage)
            if rescue is not None:
                self._launch(rescue, stream_ptr)
                mark("f16 rescue")

    def enqueue(self, stream_ptr, serial=False, mark=None, grad_hidden_ready=0):
        """Issue the whole backward on `stream_ptr`, with the side stream S2 (module docstring).

        `serial`: everything on `stream_ptr`, in order; `mark(stage)` is then called after each step
        (the benchmark's per-stage profile). `grad_hidden_ready`: a raw event pointer (0: none)
        recorded on `stream_ptr` right after GEMM3, so a caller can use grad_hidden before GEMM4 ends.
        """
        from cupy_backends.cuda.api import runtime

        mark = mark or (lambda stage: None)
        S = stream_ptr
        S2 = S if serial else self._side.ptr
        side = self._main if serial else getattr(self, "_sidecar", None)

        def record(event, stream):
            if not serial:
                runtime.eventRecord(event.ptr, stream)

        def wait(stream, event):
            if not serial:
                runtime.streamWaitEvent(stream, event.ptr, 0)

        self._main.bind(S)
        record(self._ev_start, S)
        wait(S2, self._ev_start)
        try:
            self._convert_stage("convert A", S, mark)
            record(self._ev_a, S)
            s2_after_a = self.fmt in (P.FMT_F16S, P.FMT_F16E4M3) and bool(self.cvt_b)
            if s2_after_a:
                # convert B's rescue writes alpha2, which needs grad_output's scale (with gelu_in_gemm1 it writes no
                # alpha; convert B still follows A, which GEMM1 waits for, rather than halve A's bandwidth)
                wait(S2, self._ev_a)
            self._convert_stage("convert B", S2, mark)
            if self._recompute_g and self._ieee_gelu is not None:
                self._launch(self._ieee_gelu[1], S2)
                mark("gelu_out (recomputed)")
            record(self._ev_b, S2)
            if self.fused_gemm1:
                self._launch(self._fused, S)
                mark("GEMM1 + dgelu (sm90 fused)")
            else:
                self._gemm(0, self.gemm1, self._main)
                mark("GEMM1 grad_gelu")
            if self.gemm2 is not None and not self.gelu_in_gemm1:
                if not s2_after_a:  # grad_output converted (S2 already waits for it where convert B did)
                    wait(S2, self._ev_a)
                self._gemm(1, self.gemm2, side)
                mark("GEMM2 grad_weight2")
            if self.lean:
                record(self._ev_side, S2)
                wait(S, self._ev_side)  # grad_linear1 overwrites the planes GEMM2 reads
            wait(S, self._ev_b)  # weight1 / hidden_states converted (and their scales final)
            if self.fused_gemm1:
                if self._fused_rescue is not None:  # tf32: grad_linear1's exponent decided; rerun if it moved
                    self._launch(self._decide, S)
                    self._launch(self._fused_rescue, S)
                    mark("f16 rescue")
            else:
                self._launch(self._dgelu, S)
                mark("dgelu")
                if self._dgelu_rescue is not None:
                    self._launch(self._dgelu_rescue, S)
                    mark("f16 rescue")
            self._convert_stage("convert late", S, mark)
            record(self._ev_d, S)
            if self.gemm2 is not None and self.gelu_in_gemm1:  # gelu_out's codes and GEMM2's alpha are final
                wait(S2, self._ev_d)
                self._gemm(1, self.gemm2, side)
                mark("GEMM2 grad_weight2")
            if self.gemm3 is not None:
                self._gemm(2, self.gemm3, self._main)
                if grad_hidden_ready:
                    runtime.eventRecord(grad_hidden_ready, S)
                mark("GEMM3 grad_hidden")
            if self.gemm4 is not None:
                if self.lean:
                    self._gemm(3, self.gemm4, self._main)
                else:
                    wait(S2, self._ev_d)
                    self._gemm(3, self.gemm4, side)
                mark("GEMM4 grad_weight1")
        finally:  # also on failure: nothing of this call may land after the caller's error handling
            record(self._ev_side, S2)
            wait(S, self._ev_side)

    # ------------------------------------------------------------------ the call graph (eager calls)
    def graph_key(self):
        """What a call graph bakes in besides addresses: the beta of the weight gradients (cuBLAS takes its address
        when captured), for ieee whether memory mode recomputes gelu_out (one more launch), and whether GEMM1's
        epilogue forms gelu_out (other launches)."""
        return self._accumulate, bool(self._recompute_g and self._ieee_gelu is not None), self.gelu_in_gemm1

    def launch_graph(self, stream_ptr):
        """The call set by set_io, on `stream_ptr`, as a call graph: captured on the first call of its graph_key
        (on a private stream), then re-pointed and launched (cupyffn/_call_graph.py)."""
        key = self.graph_key()
        graph = self._call_graphs.get(key)
        if graph is None:
            graph = self._capture_graph(stream_ptr)
            self._call_graphs[key] = graph
        values = self._store_table.args[1]
        for index, g in enumerate(("gemm1", "gemm2", "gemm3", "gemm4")):
            plan, entry = getattr(self, g), values.gemm[index]
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
            store = _kernels.get_function("call_table", "store_call_table", self.device_id)
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

    def allocates_for(self, inputs):
        """Whether set_io(inputs, ...) would allocate (ieee memory mode's gelu_out buffer, on first use)."""
        return inputs[6] is None and self.need_weight_grads and not self.planes and self._ieee_gelu is None

    # Ordering and lifetime. Every eager call on a stream other than the previous call's first waits
    # for `_ev_done` (order_after_previous), and the side stream joins back into the caller's stream
    # before `_ev_done` is recorded (enqueue's finally), so the last `_ev_done` follows all work of
    # every earlier call on every stream: close() waits on that one event. Calls during a caller's
    # CUDA stream capture neither wait on `_ev_done` nor record it (an event recorded outside the
    # capture may not be waited on inside it, and one recorded inside cannot be synchronized on).
    def side_stream_free(self):
        """False while the side stream still belongs to a caller's capture: it joins at a captured call
        and stays in capture mode until the caller ends the capture, so an eager call meanwhile must not
        use it (its waits and launches would land in, and break, that capture), nor may a call captured
        on another stream (a second capture open at the same time: joining it would break both). A
        captured call on `side_capture_stream` is in the capture that holds it (a stream is in one
        capture at a time, and that capture cannot end before the side stream rejoins it). Call with
        the plan's lock held, when `side_in_capture` is set."""
        if _plan_cache.is_capturing(self._side.ptr):
            return False
        self.side_in_capture = False
        return True

    def order_after_previous(self, stream_ptr):
        """Make `stream_ptr` wait for the previous call if that ran on another stream (shared scratch)."""
        from cupy_backends.cuda.api import runtime

        if self._last_stream_ptr is not None and stream_ptr != self._last_stream_ptr:
            runtime.streamWaitEvent(stream_ptr, self._ev_done.ptr, 0)
        self._last_stream_ptr = stream_ptr

    def record_done(self, stream_ptr):
        """Mark the end of a call on `stream_ptr` (also after a failed call: its partial work counts)."""
        from cupy_backends.cuda.api import runtime

        runtime.eventRecord(self._ev_done.ptr, stream_ptr)

    def stage_bytes(self):
        """Bytes each memory-bound stage moves (for GB/s in the benchmark)."""
        out = {}

        def written(name):  # every encoding of operand `name` (fp16+fp8: several buffers)
            return sum(op.nbytes for key, op in self.ops.items() if key.split(".")[0] == name)

        for stage, (names, _, _) in self._convert.items():
            out[stage] = sum(4 * math.prod(self._dims(self._ROWS_COLS[n])) + written(n) for n in names)
        write = written("grad_linear1") if self.planes else 4 * self.T * self.H
        if not self.fused_gemm1:
            out["dgelu"] = 12 * self.T * self.H + write
        return out

    def close(self):
        """Wait for all of this engine's eager calls (the last `_ev_done`, see above), then give back its
        scratch and cuBLAS handles. Graph replays are not tracked: a plan a caller's graph captured is
        pinned and not closed (_plan_cache).

        Waiting (rather than passing an event on to whoever reuses the handles and memory) keeps the
        ordering local; a plan is closed when it is evicted or collected, by then its work is done.
        """
        if self._closed:
            return
        self._closed = True
        try:
            from cupy_backends.cuda.api import runtime

            runtime.eventSynchronize(self._ev_done.ptr)
        finally:
            for graph in self._call_graphs.values():
                graph.destroy()
            self._call_graphs = {}
            for h in self._handles:
                _cublas.release(h)
            self._handles = []
            self._scratch = None
