"""What a backward plan runs: the form of each GEMM, the fallbacks, the sm90 mechanisms, the K-chunks, the
scratch layout and the conversion stages, resolved from the plan's `EngineOptions` (cupyffn/f32/options.py).

Pure host code: no CuPy, no GPU. `Plan` takes two questions about the device as callables, so that a CPU test
can answer them: `sm90_supported()` (a compute capability 9.0 GPU: the sm_90a kernels run only there) and
`build_fp8(plan, gemm)` (cuBLASLt builds GEMM `gemm`'s e4m3 product, `plan.fp8_desc(gemm, ...)`: None, else the
reason it refuses; asked while the plan chooses the forms).
The engine (cupyffn/f32/engine.py) builds one `Plan`, then the launches (cupyffn/f32/launches.py) and the
stage schedule (cupyffn/f32/schedule.py) from it.

"tf32" on an H100/H200 (compute capability 9.0): GEMM1 and dgelu are one kernel (kernels_cu/gemm_sm90.cu,
`fused_gemm1`): the GELU derivative is applied in GEMM1's epilogue, which writes grad_linear1 as scaled fp16
and gathers its maximum; grad_gelu is never written (no T x H fp32 scratch). Its scale is decided by a
one-thread launch once convert B's exponents are final, then a fused rescue launch (a no-op unless the
exponent moved: then it runs GEMM1 again). It runs for FUSED_GEMM1_TOKENS: every T since the epilogue's
instruction count was cut (whole calls 0.90-0.975 of the cuBLAS route on 15 of the 16 workloads; before it, at
T >= 2048 the cuBLAS route's dgelu pass overlapping GEMM2 on the side stream had been worth more than the fusion;
docs/decisions/025-sm90-gemm1-dgelu-fusion.md). The plan's options override:
EngineOptions(fused_gemm1=False) never, True at every T (comparisons).
Memory mode without gelu_out (tf32, fused, weight gradients wanted; GELU_EPILOGUE_TOKENS; `gelu_in_gemm1` for
such a call, `gelu_epilogue_ok` for the plan): the fused epilogue also writes GEMM2's operand gelu_out =
0.5 x (1 + t) as scaled fp16 codes, from the linear1_out and tanh_inner it holds anyway (EPI_DGELU_F16G), instead
of convert B recomputing it, and GEMM2 runs after GEMM1's rescue launch instead of beside GEMM1 (the stage graph:
cupyffn/f32/schedule.py). A gelu_out the caller gives is always converted and used as given
(docs/decisions/002-honour-every-input.md): the plan holds the conversion lists of both ways (`convert_modes`)
and each call takes the one its inputs need.

Every GEMM whose K exceeds ksplit.MAX_K runs in K-chunks added in fp32 (cupyffn/gemm/ksplit.py); the
sm90 kernels sum the whole K in one accumulator, so a plan whose GEMM1 K exceeds it runs GEMM1 on cuBLAS.
With `epilogue_warps` (tf32, fused; EPILOGUE_WARPS_TOKENS: T >= 513) that epilogue runs in seven warps of its own,
fed each accumulator tile through shared memory while the consumer warps compute the next tile (the same bits).
The same kernel can serve the bf16x3 plan (epilogue writing grad_linear1's three bf16 planes; one launch, no
scale to decide), but measured slower over the whole call at every T, so only EngineOptions(fused_gemm1=True)
turns it on.
"""

from ..cuda import kernels as _kernels
from ..core import precision as P
from ..gemm import cublas, ksplit
from ..gemm import desc as gemm_desc
from . import options as _options
from .layout import Layout, pad16

#: Operand formats whose GEMM1 + dgelu the sm90 kernel can run: the tf32 plan's scaled fp16 and the bf16x3 plan's
#: planes (also fp16+fp8 below T = 1024, where it is the bf16x3 plan).
FUSABLE_FORMATS = (P.FMT_F16S, P.FMT_BF16X3)

# ---------------------------------------------------------------------- the measured windows
#: The last T a window can name (T is below 2^31).
_LAST = 2 ** 31 - 1

# What each option of cupyffn/f32/options.py left at None (auto) resolves to, through option_wanted: one table,
# each entry with its measurement and decision note.

#: Per format, T (first <= T <= last) at which the default (fused_gemm1 auto) fuses (module docstring); a format
#: not listed fuses only with EngineOptions(fused_gemm1=True). Whole calls on the H200, fused / cuBLAS route, same
#: run: tf32 0.90-0.975 on 15 of the 16 workloads, 1.36 on one T = 256 row whose twin of equal shape measured 0.94
#: (host noise); 0.89-0.99 at every T in a one-round A/B (docs/decisions/025-sm90-gemm1-dgelu-fusion.md).
#: bf16x3: 1.02-1.13 from T = 512 on, 0.97-0.98 at 256 (docs/decisions/042-bf16x3-fused-gemm1.md): the
#: three-plane epilogue costs more than the pass it replaces, so not listed.
FUSED_GEMM1_TOKENS = {P.FMT_F16S: (1, _LAST)}


#: Per format, T (first <= T <= last) at which eager calls run as a call graph by default (call_graph auto;
#: cupyffn/cuda/call_graph.py). Measured on the H200, tf32, same runs (docs/decisions/018-call-graph.md): at
#: T <= 512 the GPU work of a call (0.11-0.14 ms) is as long as the host's enqueue of its launches, so launched one
#: by one the call measured 0.112-0.18 ms at T = 256 depending on the host's state, as a graph 0.114-0.116 in every
#: run; from T = 1024 on the GPU outlasts the enqueue and the graph's own cost (its batched cuBLAS GEMMs, the table
#: node: 0.5-2.5%) is not paid back. bf16x3 and ieee: cuBLAS picks slower kernels for their batched GEMMs (whole
#: calls 1.3x), so not listed; bf16 measured even.
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

#: Per format, T at which the independent work runs on the engine's side stream beside the caller's (GEMM2 beside
#: GEMM1, GEMM4 beside GEMM3, convert B beside convert A: two_streams auto; True at every T, False never: every step
#: on the caller's stream in issue order). Small GEMMs leave most of the GPU idle, so two side by side fill it
#: (docs/decisions/013-two-streams.md: 4-15% at T = 256). fp16+fp8 from T = 4096 on runs one stream: there its GEMMs
#: each fill the GPU, and two persistent sm90 pair kernels (or one beside a cuBLAS GEMM) share it worse than they
#: run one after the other. Measured on the H100, whole calls, one stream / two, same run
#: (docs/decisions/064-pair-kernel-for-every-gemm.md): every pair GEMM on the sm90 kernel 0.995 at T = 4096, 0.988 at
#: 4904, 0.977 at 8192; but 1.04 at 1024, 1.01 at 2048 and 3142.
TWO_STREAMS_TOKENS = {P.FMT_F32: (0, _LAST), P.FMT_BF16: (0, _LAST), P.FMT_BF16X3: (0, _LAST),
                      P.FMT_F16S: (0, _LAST), P.FMT_F16E4M3: (0, 4095)}


#: Per format, T at which the fused GEMM1 also writes gelu_out's fp16 codes for GEMM2 (module docstring;
#: gelu_epilogue auto; True wherever the fused tf32 GEMM1 runs, False never). Measured on the H200, whole calls
#: against the same plan converting gelu_out, same run (docs/decisions/041-gelu-out-in-epilogue.md): 0.973-0.995 at
#: T = 4096-8192; 1.02-1.07 at T = 256-3142, where the saved conversion is smaller than what the epilogue's second
#: output costs and GEMM2 no longer overlaps GEMM1's last wave.
GELU_EPILOGUE_TOKENS = {P.FMT_F16S: (4096, _LAST)}


#: Per format, T at which the fused GEMM1's epilogue runs in warps of its own (kernels_cu/gemm_sm90.cu, XS = 2: the
#: accumulator tile handed through shared memory, the epilogue overlapping the next tile's mainloop) instead of the
#: staged epilogue of choose_config's schedule (epilogue_warps auto; True wherever the fused tf32 GEMM1 runs,
#: False never). Bit for bit the same outputs. Measured on the H200, the fused kernel alone with gelu_out, against the
#: engine's schedule, two runs (docs/decisions/045-epilogue-warps.md): 0.91-0.97 at T = 512-8192,
#: 0.98-1.07 at T = 256, where the 96 tiles leave nothing to overlap (one tile per CTA); from T = 513 on a CTA has
#: more than one 128 x 128 tile (H = 6144: more tiles than SMs).
EPILOGUE_WARPS_TOKENS = {P.FMT_F16S: (513, _LAST)}


#: fp16+fp8: per GEMM, the windows of T ((first, last), ...) in which its f16+e4m3 form runs as one launch of the
#: sm90 pair kernel (kernels_cu/gemm_sm90.cu gemm_sm90_pair_kernel: the e4m3 and fp16 stages into one accumulator, no
#: fp32 output written and read again between the two products) instead of cuBLAS's e4m3 + fp16 pair. Measured on
#: the H100, whole calls at the official T against cuBLAS's pair for GEMM2-4 (docs/decisions/064-pair-kernel-for-every-
#: gemm.md; GEMM1: 024): GEMM2 and GEMM4 (A read MN-major, 128 x 192 tiles) 0.90x of the call at T = 1024 (with the
#: pair form), 0.965-0.975x at 2048 (with GEMM3); all three, with one stream from T = 4096 on (TWO_STREAMS_TOKENS),
#: 0.97x at 4096, 1.00x at 4904, 0.98x at 8192; but at T = 3142, two streams, 1.03-1.06x (a persistent kernel shares
#: the GPU badly with the GEMM beside it on the other stream), so cuBLAS's pair there; GEMM3 alone 1.0-1.2x of
#: cuBLAS's pair but at T = 2048 (128 x 192 tiles: one wave). sm90_pair auto: these; True: every pair GEMM at every T;
#: False: none.
SM90_PAIR_TOKENS = {"gemm1": ((0, _LAST),), "gemm2": ((0, 2048), (4096, _LAST)),
                    "gemm3": ((2048, 2048), (4096, _LAST)), "gemm4": ((0, 2048), (4096, _LAST))}

#: fp16+fp8: per GEMM, the T (first, last) at which cuBLAS's two products (e4m3 cross terms, then fp16 onto the same
#: fp32 output) beat bf16x3; None: nowhere (GEMM1, whose [T, H] output they write twice). A pair GEMM that the sm90
#: kernel does not run (SM90_PAIR_TOKENS, the GPU, the options) outside its window runs bf16x3. Measured on the H100,
#: GEMMs alone (064): GEMM2 and GEMM4 1.10-1.57x of bf16x3 below T = 2048, 0.73-0.94x from there; GEMM3 0.74-0.94x
#: from T = 256 on; GEMM1 1.04-1.12x at T = 2048-4904.
CUBLAS_PAIR_TOKENS = {"gemm1": None, "gemm2": (2048, _LAST), "gemm3": (256, _LAST), "gemm4": (2048, _LAST)}

#: The backward's GEMMs in launch order (their index: the call table's entry, the alpha's slot).
GEMM_ORDER = ("gemm1", "gemm2", "gemm3", "gemm4")
#: What each 16-bit (or fp32) GEMM computes (its GemmDesc's name).
GEMM_NAMES = {"gemm1": "grad_gelu = grad_output @ weight2", "gemm2": "grad_weight2 = grad_output^T @ gelu_out",
              "gemm3": "grad_hidden = grad_linear1 @ weight1",
              "gemm4": "grad_weight1 = grad_linear1^T @ hidden_states"}


def in_window(tokens, window):
    """Whether `tokens` lies in `window` ((first, last), both included; None: no window)."""
    return window is not None and window[0] <= tokens <= window[1]


def option_wanted(choice, windows, fmt, tokens):
    """Whether a switch of the plan's EngineOptions (cupyffn/f32/options.py), of value `choice`, asks for its
    mechanism in a plan of format `fmt` at `tokens`: True always, False never, None (auto) where `windows` ({format:
    (first, last)}: FUSED_GEMM1_TOKENS, GELU_EPILOGUE_TOKENS, EPILOGUE_WARPS_TOKENS, CALL_GRAPH_TOKENS,
    CONVERT_AB_TOKENS) has first <= tokens <= last. The caller adds what the mechanism itself needs."""
    if choice is not None:
        return choice
    return in_window(tokens, windows.get(fmt))


def call_graph_wanted(precision, tokens, choice=None):
    """Whether a backward plan of `precision` at `tokens` asks for a call graph (options.call_graph `choice`: None
    auto, True, False): the route table's graph column (cupyffn/api/routes.py), decided before the plan is built.
    fp16+fp8's cuBLASLt GEMMs take their output address on the host, so never there; the built plan adds that K
    fits one chunk (`Plan.call_graph`)."""
    return option_wanted(choice, CALL_GRAPH_TOKENS, precision.fmt, tokens) and tokens > 0 and \
        precision.fmt != P.FMT_F16E4M3


class Plan:
    """What one (T, D, H, precision) backward runs, decided once on the host (module docstring).

    forms ({gemm: Form}), form_notes (why a GEMM fell back to bf16x3), sm90_pair (the pair GEMMs run as the sm90
    pair kernel), fmt / planes (the operand format the plan converts to), fused_gemm1, gelu_epilogue_ok,
    epilogue_warps, layout (cupyffn/f32/layout.py), convert_ab, two_streams, convert_modes ({gelu_out from GEMM1's epilogue:
    (convert A's names, convert B's names)}), k_chunked ({gemm: chunks}), call_graph.
    """

    def __init__(self, tokens, dim, hidden_dim, precision, need_grad_hidden=True, need_weight_grads=True,
                 options=_options.DEFAULT, sm90_supported=lambda: False, build_fp8=lambda plan, gemm: None,
                 need_bias_grads=False):
        if not isinstance(options, _options.EngineOptions):
            raise TypeError(f"options must be a cupyffn.f32.options.EngineOptions; got {options!r}")
        self.T, self.D, self.H = tokens, dim, hidden_dim
        self.options = options  # every mechanism choice this plan makes (cupyffn/f32/options.py)
        self.precision = precision
        self.need_grad_hidden = need_grad_hidden
        self.need_weight_grads = need_weight_grads
        self.need_bias_grads = need_bias_grads
        self._sm90_supported = sm90_supported
        self._choose_forms(build_fp8)
        self.fused_gemm1 = self._fused_gemm1_ok()
        self.gelu_epilogue_ok = self._gelu_epilogue_ok()
        self.epilogue_warps = self._epilogue_warps_ok()
        self.layout = Layout(self)
        self.convert_ab = self._convert_ab_ok()
        self.two_streams = option_wanted(self.options.two_streams, TWO_STREAMS_TOKENS, self.fmt, self.T)
        # per mode (gelu_out formed in GEMM1's epilogue or not): what convert A and convert B write
        lay = self.layout
        if self.fmt == P.FMT_F16E4M3:
            self.convert_modes = {False: (lay.cvt_a, lay.cvt_b)}
        else:
            self.convert_modes = {}
            for epilogue in (False, True) if self.gelu_epilogue_ok else (False,):
                a, b = list(lay.cvt_a), [n for n in lay.cvt_b if not (epilogue and n == "gelu_out")]
                self.convert_modes[epilogue] = (a + b, []) if self.convert_ab else (a, b)
        self.k_chunked = self._k_chunked()
        self.call_graph = self._call_graph_ok()

    @property
    def max_k(self):
        """The longest K one GEMM accumulator sums (cupyffn/gemm/ksplit.py; None: unbounded): the options'."""
        return self.options.max_k

    @property
    def gemm_forms(self):
        """{gemm: form name} this plan runs."""
        return {g: f.name for g, f in self.forms.items()}

    def dims(self, letters):
        return P.dims(letters, self.T, self.D, self.H)

    def mnk(self, g):
        return self.dims(P.GEMM_MNK[g])

    # ------------------------------------------------------------------ forms and fallbacks
    def _choose_forms(self, build_fp8):
        """The form of each GEMM this plan runs: the recipe's table at T, bf16x3 where the pair does not fit
        (P.pair_fits) or cuBLASLt offers no algorithm for its e4m3 GEMM (`build_fp8`, asked here, once)."""
        present = ["gemm1"] + (["gemm2", "gemm4"] if self.need_weight_grads else []) + \
            (["gemm3"] if self.need_grad_hidden else [])
        forms = P.effective_forms(self.precision, self.T, self.D, self.H)
        self.forms = {g: forms[g] for g in sorted(present)}
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
                if not in_window(self.T, CUBLAS_PAIR_TOKENS[g]):  # cuBLAS's pair is slower than bf16x3
                    self.forms[g] = P.FORMS["bf16x3"]
                    self.form_notes[g] = (f"{g}'s pair at T = {self.T} runs only as the sm90 pair kernel "
                                          "(CUBLAS_PAIR_TOKENS), which this plan does not use for it "
                                          "(SM90_PAIR_TOKENS, EngineOptions(sm90_pair=False), not a compute "
                                          "capability 9.0 GPU, or D or H not a multiple of 8)")
                    continue
                refusal = build_fp8(self, g)
                if refusal is not None:
                    self.forms[g] = P.FORMS["bf16x3"]
                    self.form_notes[g] = refusal
        # The operand format this plan converts to: the recipe's, except that a fp16+fp8 plan whose GEMMs all
        # run bf16x3 is the bf16x3 plan (its kernels and its lean layout).
        names = {f.name for f in self.forms.values()}
        uniform = P.FORMS[names.pop()] if len(names) == 1 else None
        if self.precision.fmt == P.FMT_F16E4M3 and uniform is not None and uniform.name == "bf16x3":
            self.fmt, self.planes = uniform.fmt, uniform.planes
        else:
            self.fmt, self.planes = self.precision.fmt, self.precision.planes

    def fp8_desc(self, g, a_scale=None):
        """GEMM g's e4m3 cross terms (the f16+e4m3 form on cuBLASLt): K doubled over the pairs, padded to 16;
        `a_scale` the device pointer to the pair's A scale (E4M3_PAIR_SCALE)."""
        m, n, k = self.mnk(g)
        kp = pad16(k)
        return gemm_desc.GemmDesc(f"{g} e4m3 cross terms", m, n, 2 * kp, cublas.R_8F_E4M3,
                                  cublas.R_8F_E4M3, b_trans=True, lda=2 * kp, ldb=2 * kp, ldc=n,
                                  a_scale=a_scale)

    def gemm16_desc(self, g, planes, dtype):
        """The 16-bit (or fp32) GEMM `g` over operands with `planes` planes stacked along K (the layouts)."""
        m, n, k = self.mnk(g)
        kp = max(planes, 1)
        trans = g in ("gemm2", "gemm4")  # the weight gradients read their A operand (T rows) transposed
        return gemm_desc.GemmDesc(GEMM_NAMES[g], m, n, kp * k, dtype, dtype, a_trans=trans, ldc=n)

    # ------------------------------------------------------------------ the sm90 mechanisms
    def _fused_gemm1_ok(self):
        """GEMM1 + dgelu as one sm90 kernel (module docstring): the tf32 plan's fp16 or the bf16x3 plan's bf16
        operands, a compute capability 9.0 GPU, rows of 16-byte multiples for the TMA unit (D, H multiples of 8)."""
        # a format FUSED_GEMM1_TOKENS does not list fuses only when asked to (True); grad_bias1's column sums are
        # formed by the dgelu pass, not by the fused epilogue (docs/decisions/050-biases-in-the-split-precisions.md)
        wanted = option_wanted(self.options.fused_gemm1, FUSED_GEMM1_TOKENS, self.fmt, self.T)
        return (wanted and not self.need_bias_grads and self.fmt in FUSABLE_FORMATS and self.T > 0
                and self._sm90_fits()
                and not ksplit.chunked(max(self.planes, 1) * self.D, self.max_k))  # one accumulator sums all of K

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
        return self.D % 8 == 0 and self.H % 8 == 0 and self.T < 2 ** 31 and self._sm90_supported()

    def _sm90_pair_gemms(self):
        """The GEMMs whose f16+e4m3 form runs as one sm90 pair kernel (SM90_PAIR_TOKENS; options.sm90_pair: auto, True
        every pair GEMM (comparisons), False none), where the kernel can run (_sm90_fits)."""
        choice = self.options.sm90_pair
        if choice is False or not self._sm90_fits():
            return set()
        gemms = set(P.GEMMS) if choice else {g for g, windows in SM90_PAIR_TOKENS.items()
                                              if any(in_window(self.T, w) for w in windows)}
        # the kernel sums all of K (and the pair's doubled K) in one accumulator
        return {g for g in gemms if not ksplit.chunked(2 * pad16(self.mnk(g)[2]), self.max_k)}

    # ------------------------------------------------------------------ launches and calls
    def _convert_ab_ok(self):
        """convert A and B as one launch (CONVERT_AB_TOKENS; options.convert_ab: auto, True, False)."""
        wanted = option_wanted(self.options.convert_ab, CONVERT_AB_TOKENS, self.fmt, self.T)
        lay = self.layout
        return wanted and self.fmt == P.FMT_F16S and len(lay.cvt_a + lay.cvt_b) <= _kernels.MAX_JOBS

    def _k_chunked(self):
        """{gemm: chunks} of the GEMMs this plan runs in more than one K-chunk (cupyffn/gemm/ksplit.py): what
        gemm.desc.build makes of the descriptions the launches build (fp16+fp8's cuBLAS pair: the most of its two
        products'; the sm90 kernels and the fused GEMM1 sum their whole K)."""
        out = {}
        if self.T <= 0:  # nothing is built
            return out
        for g in GEMM_ORDER:
            if g not in self.forms or (g == "gemm1" and self.fused_gemm1):
                continue
            form = self.forms[g]
            if form.name == "f16+e4m3" and g in self.sm90_pair:
                continue
            if form.name == "f16+e4m3":
                ks = (self.fp8_desc(g).k, self.gemm16_desc(g, 1, cublas.R_16F).k)
            else:
                ks = (self.gemm16_desc(g, form.planes, gemm_desc.OPERAND_TYPE[form.fmt]).k,)
            chunks = max(max(len(ksplit.chunks(k, self.max_k)), 1) for k in ks)
            if chunks > 1:
                out[g] = chunks
        return out

    def _call_graph_ok(self):
        """Whether eager calls run as a call graph. Possible for every plan but fp16+fp8 (its cuBLASLt GEMMs take
        their output address on the host; cuBLASLt has no device pointer table). options.call_graph: auto (default)
        where CALL_GRAPH_TOKENS lists the plan's format and T, True wherever possible, False never."""
        wanted = option_wanted(self.options.call_graph, CALL_GRAPH_TOKENS, self.fmt, self.T)
        return wanted and self.T > 0 and self.fmt != P.FMT_F16E4M3 and not self.k_chunked
