"""Building and binding a backward plan's launches: our kernels (`Kernels`: convert, dgelu, the fused sm90 GEMM1 +
dgelu, fp16+fp8's split_e4m3) and the four GEMMs (`Gemms`: cuBLAS, cuBLASLt, the sm90 pair kernel).

Everything is built once per plan over its scratch (cupyffn/f32/layout.py) from its `Plan`
(cupyffn/f32/plan.py); a call only rewrites the pointers that changed (`Kernels.bind`, `Gemms.bind`,
`Gemms.set_outputs`, from `GpuEngine.set_io`). For "tf32" (fp16 operands) every gathering pass is followed by a
small rescue launch that converts again any tensor whose delayed scale did not fit (kernels_cu/convert.cu;
docs/decisions/009-delayed-fp16-scaling.md). The order they run in: cupyffn/f32/schedule.py.
"""

import ctypes

from ..cuda import kernels as _kernels
from ..core import precision as P
from ..gemm import cublas
from ..gemm import desc as gemm_desc
from ..gemm import sm90
from .bias_sums import BiasSums
from .layout import E4M3_USES, ROWS_COLS, Operand


def items(rows, cols):
    """Work items of an elementwise kernel over [rows, cols]: (row, chunk of 8 * BLOCK columns) pairs."""
    return rows * -(-cols // (8 * _kernels.BLOCK))


def vec_ok(ptr, ld, cols, itemsize=4):
    """The 8-wide path needs every row to start 16-byte aligned and to hold whole groups of 8."""
    return cols % 8 == 0 and ptr % 16 == 0 and (ld * itemsize) % 16 == 0


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
        job.block_count = max(1, min(items(op.rows, op.cols), round(total_blocks * size / sum(sizes))))
        begin += job.block_count
    launch = _kernels.KernelLaunch(kernel, jobs, state_ptr, consts_ptr)
    launch.grid = begin
    return launch


class Kernels:
    """Our kernels' launches of one plan (T > 0). `modes[gelu_in_gemm1]` = (convert, fused, fused_rescue, decide):
    convert {stage: (names, launch, rescue launch or None)} for "convert A", "convert B", "convert late", and the
    fused GEMM1 + dgelu's launches (None without it); `dgelu`, `dgelu_rescue` (None with the fused GEMM1);
    `ieee_gelu` (ieee memory mode's gelu_out recomputed in fp32: built on first use, `ieee_bytes` its buffer);
    `bias` (need_bias_grads: the bias gradients' launches and scratch, cupyffn/f32/bias_sums.py)."""

    def __init__(self, plan, base, state, consts, device_id):
        self.plan, self.ops = plan, plan.layout.ops
        self.T, self.D, self.H, self.fmt, self.planes = plan.T, plan.D, plan.H, plan.fmt, plan.planes
        self.base, self.device_id = base, device_id
        self._state, self._consts = state, consts
        vp = ctypes.c_void_p
        self._state_ptr = vp(state.data.ptr)
        self._consts_ptr = vp(consts.data.ptr)
        self.ieee_gelu = None  # (names, launch, None) once memory mode needs it (ieee only)
        self.ieee_g, self.ieee_bytes = None, 0
        self.bias = BiasSums(plan, device_id) if plan.need_bias_grads else None
        if self.fmt == P.FMT_F16E4M3:
            self._build_split_launches()
        else:
            self._build_launches()

    def addr(self, name):
        return self.base + self.ops[name].offset

    # ------------------------------------------------------------------ fp16+fp8: split_e4m3
    def split_spec(self, name):
        """The split_e4m3 job of operand `name`: every encoding the layout gave it (Layout._layout_f16e4m3)."""
        rows, cols = self.plan.dims(ROWS_COLS[name])
        spec = _kernels.SplitSpec(rows, cols, P.SLOT[name])
        if name in self.ops:
            spec.f16 = (self.addr(name), self.ops[name].dst_ld)
        if name + ".x3" in self.ops:
            op = self.ops[name + ".x3"]
            spec.x3 = (self.addr(name + ".x3"), op.dst_ld, op.part_stride, P.PATTERN[name])
        for orient in ("n", "t"):
            key = f"{name}.e4{orient}"
            if key in self.ops:
                op = self.ops[key]
                setattr(spec, "e4" + orient, (self.addr(key), op.dst_ld, op.kpad, self.plan.layout.e4m3_order[key]))
        return spec

    def _build_split_launches(self):
        """fp16+fp8: convert A / convert B / dgelu as split_e4m3 launches, each a gathering pass and a rescue
        pass (the fp16 scales, as for tf32)."""
        dev = self.device_id
        sms = _kernels.sm_count(dev)
        cvt_a, cvt_b = self.plan.convert_modes[False]
        convert = {}
        for stage, names, alpha_mask, counter in (("convert A", cvt_a, 0b0001, 0),
                                                  ("convert B", cvt_b, 0b0010, 1)):
            if not names:
                continue
            kernel, full = _kernels.split_kernel(0, dev)  # the variant of _kernels.SPLIT_VARIANT
            specs = [self.split_spec(n) for n in names]
            first = _kernels.split_launch(kernel, specs, full, 0, counter, 0, self._state_ptr, self._consts_ptr)
            rescue = _kernels.split_launch(kernel, specs, max(len(specs), 2 * sms), 1, counter, alpha_mask,
                                           self._state_ptr, self._consts_ptr)
            convert[stage] = (names, first, rescue)
        self.modes = {False: (convert, None, None, None)}
        kernel, full = _kernels.split_kernel(1, dev)
        spec = [self.split_spec("grad_linear1")]
        self.dgelu = _kernels.split_launch(kernel, spec, full, 0, 2, 0, self._state_ptr, self._consts_ptr)
        if self.bias is not None:  # one row of column sums per step's rows (split_e4m3.cu)
            self.dgelu.args[0].colsum = self.bias.dgelu_rows
        self.dgelu_rescue = _kernels.split_launch(kernel, spec, 2 * sms, 1, 2, 0b1100, self._state_ptr,
                                                  self._consts_ptr)

    def _bind_split(self, convert, l1, t, g, src):
        """fp16+fp8: this call's sources of the split_e4m3 jobs."""
        for names, *launches in convert.values():
            for launch in launches:
                for k, name in enumerate(names):
                    job = launch.args[0].job[k]
                    if name == "gelu_out" and g is None:  # memory mode: gelu_out from linear1_out
                        _kernels.split_set_sources(job, (l1.ptr, l1.ld), None if t is None else (t.ptr, t.ld), kind=1)
                    else:
                        m = src[name]
                        _kernels.split_set_sources(job, (m.ptr, m.ld), kind=0)
        for launch in (self.dgelu, self.dgelu_rescue):
            _kernels.split_set_sources(launch.args[0].job[0], (self.base, self.H), (l1.ptr, l1.ld),
                                       None if t is None else (t.ptr, t.ld))

    # ------------------------------------------------------------------ convert, dgelu, fused GEMM1
    def _build_launches(self):
        dev = self.device_id
        fmt = self.fmt
        f16 = fmt == P.FMT_F16S
        sms = _kernels.sm_count(dev)
        self.modes = {}
        for epilogue, (cvt_a, cvt_b) in self.plan.convert_modes.items():
            # stage -> (names, alpha mask of its rescue pass, arrival counter)
            # (convert_ab: one launch for both, whose rescue pass writes GEMM1's and GEMM2's alphas; gelu_out from
            # the epilogue: GEMM2's alpha is the fused rescue launch's, once gelu_out's exponent is decided)
            gemm2_alpha = 0 if epilogue else 0b0010
            stages = {"convert A": (cvt_a, 0b0001 | (gemm2_alpha if self.plan.convert_ab else 0), 0),
                      "convert B": (cvt_b, gemm2_alpha, 1),
                      "convert late": (self.plan.layout.cvt_late, 0, 3)}
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
            fused = self._build_fused_gemm1(epilogue) if self.plan.fused_gemm1 else (None, None, None)
            self.modes[epilogue] = (convert,) + fused
        if self.plan.fused_gemm1:
            self.dgelu = self.dgelu_rescue = None
            return
        expr = f"dgelu_kernel<{fmt}>"
        kernel = _kernels.get_function("dgelu", expr, dev)
        grid = max(1, min(items(self.T, self.H), sms * _kernels.blocks_per_sm("dgelu", expr, dev) * 2))
        if self.bias is not None:  # the gathering pass also leaves column sums (its grid: BiasSums.bind)
            sums = f"dgelu_sums_kernel<{fmt}>"
            self.dgelu = self._dgelu_launch(_kernels.get_function("dgelu", sums, dev), grid, rescue=0)
            self.dgelu.args[0].colsum = self.bias.dgelu_rows
        else:
            self.dgelu = self._dgelu_launch(kernel, grid, rescue=0)
        self.dgelu_rescue = self._dgelu_launch(kernel, min(grid, 2 * sms), rescue=1) if f16 else None

    def _build_fused_gemm1(self, gelu_epilogue):
        """The fused GEMM1 + dgelu (cupyffn/f32/plan.py) as (launch, rescue launch, decision): tf32, its gathering
        and rescue launches and the decision between them, also writing gelu_out's codes if `gelu_epilogue`;
        bf16x3, one launch (no scale to decide)."""
        # A: grad_output [T, planes * D]; B: weight2 [planes * D, H] as stored ("kn"); out: grad_linear1
        # [T, planes * H] (tf32: one fp16 plane; bf16x3: K tripled, planes (hi, lo, hi) side by side)
        p = self.planes
        where = (self.addr("grad_output"), p * self.D, self.addr("weight2"), self.H, "kn",
                 self.addr("grad_linear1"), p * self.H, self.T, self.H, p * self.D)
        if self.fmt == P.FMT_BF16X3:
            fused = sm90.DgeluLaunch(*where, state_ptr=None, consts_ptr=None, acc_scale_ptr=None, slot=0,
                                     rescue=False, alpha_mask=0, device_id=self.device_id,
                                     epi=sm90.EPI_DGELU_BF16X3)
            return fused, None, None
        slot = P.SLOT["grad_linear1"]
        common = dict(state_ptr=self._state.data.ptr, consts_ptr=self._consts.data.ptr,
                      acc_scale_ptr=self._consts.data.ptr + 4 * 2, slot=slot, device_id=self.device_id,
                      warps=self.plan.epilogue_warps)
        decided, alphas = 1 << slot, 0b1100  # grad_linear1's exponent; GEMM3's and GEMM4's alphas
        if gelu_epilogue:  # and gelu_out's (its partner, grad_output, is final); GEMM2's alpha
            g = self.ops["gelu_out"]
            common.update(gelu_ptr=self.addr("gelu_out"), ldg=g.dst_ld, gelu_slot=P.SLOT["gelu_out"])
            decided, alphas = decided | 1 << P.SLOT["gelu_out"], alphas | 0b0010
        fused = sm90.DgeluLaunch(*where, rescue=False, alpha_mask=0, **common)
        fused_rescue = sm90.DgeluLaunch(*where, rescue=True, alpha_mask=alphas, **common)
        decide = _kernels.get_function("dgelu", "f16_decide_kernel", self.device_id)
        decide = _kernels.KernelLaunch(decide, ctypes.c_void_p(self._state.data.ptr), ctypes.c_int(decided))
        decide.block = 32
        return fused, fused_rescue, decide

    def ensure_ieee_gelu(self):
        """ieee memory mode: GEMM2 reads gelu_out in fp32, so recompute it into scratch (built on first use)."""
        if self.ieee_gelu is not None:
            return
        import cupy

        try:
            self.ieee_g = cupy.cuda.alloc(4 * self.T * self.H)
        except cupy.cuda.memory.OutOfMemoryError as e:
            raise MemoryError(f"cupyffn needs {4 * self.T * self.H} bytes to recompute gelu_out (memory mode): {e}") from None
        self.ieee_bytes += 4 * self.T * self.H
        kernel = _kernels.get_function("convert", "convert_kernel<0>", self.device_id)
        full = _kernels.sm_count(self.device_id) * _kernels.blocks_per_sm("convert", "convert_kernel<0>", self.device_id) * 2
        target = (Operand("gelu_out", self.T, self.H, True, 1), self.ieee_g.ptr)  # fp32, row stride H
        launch = self._convert_launch(kernel, ["gelu_out"], full, rescue=0, counter=1, alpha_mask=0,
                                      targets={"gelu_out": target})
        self.ieee_gelu = (["gelu_out"], launch, None)

    def _convert_launch(self, kernel, names, total_blocks, rescue, counter, alpha_mask, targets=None):
        """A convert launch for `names`; `targets` maps a name to (geometry, address) outside the scratch layout."""
        placed = [(targets[n] if targets else (self.ops[n], self.addr(n))) + (P.PATTERN[n], P.SLOT[n]) for n in names]
        return convert_launch(kernel, placed, total_blocks, rescue, counter, alpha_mask, self._state_ptr,
                              self._consts_ptr)

    def _dgelu_launch(self, kernel, grid, rescue):
        job = _kernels.DgeluJob()
        job.grad_gelu = self.base
        job.grad_gelu_ld = self.H
        if self.planes:
            op = self.ops["grad_linear1"]
            job.dst = self.addr("grad_linear1")
            job.dst_ld = op.dst_ld
            job.part_stride = op.part_stride
        else:  # ieee: grad_linear1 overwrites grad_gelu in place
            job.dst = self.base
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

    # ------------------------------------------------------------------ per call
    def bind(self, mode, l1, t, g, src):
        """Point mode `mode`'s launches (and ieee's gelu_out recomputation) at this call's sources: `src` {name:
        Matrix view}, linear1_out `l1`, tanh_inner `t` and gelu_out `g` (None: memory mode)."""
        convert, fused, fused_rescue, _ = self.modes[mode]
        if self.fmt == P.FMT_F16E4M3:
            return self._bind_split(convert, l1, t, g, src)
        stages = list(convert.values())
        if self.ieee_gelu is not None:
            stages.append(self.ieee_gelu)
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
                        ok = vec_ok(l1.ptr, l1.ld, l1.cols) and (t is None or vec_ok(t.ptr, t.ld, t.cols))
                    else:
                        m = src[name]
                        job.kind, job.src, job.src_ld, job.src2, job.src2_ld = 0, m.ptr, m.ld, 0, 0
                        ok = vec_ok(m.ptr, m.ld, m.cols)
                    dst_item = 4 if not self.planes else 2
                    job.vec = int(ok and vec_ok(job.dst, job.dst_ld, job.cols, dst_item)
                                  and (job.part_stride * dst_item) % 16 == 0)
        if self.plan.fused_gemm1:
            for launch in (fused, fused_rescue):
                if launch is not None:
                    launch.set_activations(l1.ptr, l1.ld, t.ptr if t is not None else 0, t.ld if t is not None else 0)
        for launch in (self.dgelu, self.dgelu_rescue):
            if launch is None:
                continue
            job = launch.args[0]
            job.x, job.x_ld = l1.ptr, l1.ld
            job.t, job.t_ld = (t.ptr, t.ld) if t is not None else (0, 0)  # 0: recomputed in the kernel
            job.vec = int(vec_ok(l1.ptr, l1.ld, self.H) and (t is None or vec_ok(t.ptr, t.ld, self.H))
                          and vec_ok(self.base, self.H, self.H)
                          and vec_ok(job.dst, job.dst_ld, self.H, 2 if self.planes else 4)
                          and (job.part_stride * 2) % 16 == 0)


class Gemms:
    """The four GEMMs of one plan (T > 0; `gemm1`..`gemm4`, None where the plan skips it or GEMM1 is fused), each
    in its form: `PairGemm` for f16+e4m3 on cuBLAS (the e4m3 cross terms, `fp8[g]` built when the plan chose the
    forms, then fp16 hi*hi with beta 1), `Sm90PairGemm` for the sm90 pair kernel, else one cublasGemmEx over the
    operands' planes stacked along K (fp32 as given for ieee)."""

    def __init__(self, plan, base, consts, fp8, device_id, addr):
        self.plan, self.ops = plan, plan.layout.ops
        self.base, self.device_id, self.addr = base, device_id, addr
        self._consts = consts
        self.gemm1 = self.gemm2 = self.gemm3 = self.gemm4 = None
        consts = consts.data.ptr
        split = plan.fmt == P.FMT_F16E4M3  # operands in several encodings: ops[name + ".x3"] are the bf16 planes
        for index, g in enumerate(("gemm1", "gemm2", "gemm3", "gemm4")):
            if g not in plan.forms or (g == "gemm1" and plan.fused_gemm1):
                continue
            form = plan.forms[g]
            alpha = consts + 4 * (2 + index)
            (a, a_or), (b, b_or) = E4M3_USES[g]
            if form.name == "f16+e4m3" and g in plan.sm90_pair:
                gemm = self._sm90_pair_plan(g, alpha, a, a_or, b, b_or)
            elif form.name == "f16+e4m3":
                f16 = self._gemm16(g, 1, cublas.R_16F)
                f16.alpha.value = alpha
                self._point(f16, g, a, b, 1)
                fp8[g].alpha.value, fp8[g].beta.value = alpha, consts
                fp8[g].a.value, fp8[g].b.value = self.addr(f"{a}.e4{a_or}"), self.addr(f"{b}.e4{b_or}")
                gemm = gemm_desc.PairGemm(fp8[g], f16, consts + 4, f16.name)
            else:
                gemm = self._gemm16(g, form.planes, gemm_desc.OPERAND_TYPE[form.fmt])
                # beside fp16+fp8's scaled encodings the bf16 planes carry no scale: alpha 1, not GEMM g's
                gemm.alpha.value, gemm.beta.value = (consts + 4 if split else alpha), consts
                if split:
                    a, b = a + ".x3", b + ".x3"
                if form.planes:
                    self._point(gemm, g, a, b, form.planes)
                elif g in ("gemm3", "gemm4"):  # ieee reads grad_linear1 in place (the other pointers: bind)
                    gemm.a.value, gemm.lda.value = self.base, plan.H
            setattr(self, g, gemm)
        if self.gemm1 is not None:
            gemm_desc.set_output(self.gemm1, self.base)

    def _gemm16(self, g, planes, dtype):
        """The 16-bit (or fp32) GEMM `g` over operands with `planes` planes stacked along K (Plan.gemm16_desc)."""
        # every form, fp32 SGEMM included (its error grows with K too: docs/decisions/001-k-chunks.md)
        gemm, _ = gemm_desc.build(self.plan.gemm16_desc(g, planes, dtype), self.device_id,
                                  backends=(gemm_desc.CUBLAS,), max_k=self.plan.max_k,
                                  one_ptr=self._consts.data.ptr + 4)
        return gemm

    def _point(self, gemm, g, a, b, planes):
        """Operand pointers and leading dimensions of a 16-bit GEMM over the scratch operands a, b."""
        oa, ob = self.ops[a], self.ops[b]
        gemm.a.value, gemm.b.value = self.addr(a), self.addr(b)
        if g in ("gemm2", "gemm4"):  # A is [T, planes * cols] read as [planes * T, cols] transposed
            gemm.lda.value = oa.cols
        else:  # grad_output / grad_linear1 [T, planes * cols]
            gemm.lda.value = planes * oa.cols
        gemm.ldb.value = ob.cols

    def _sm90_pair_plan(self, g, alpha_ptr, a, a_or, b, b_or):
        """GEMM g's f16+e4m3 form as one sm90 pair launch over the scratch operands: the fp16 A ([T, cols] read
        MN-major for the weight gradients) and B ([K, N] as stored) and the e4m3 pairs (E4M3_USES)."""
        m, n, k = self.plan.mnk(g)
        a8, b8 = f"{a}.e4{a_or}", f"{b}.e4{b_or}"
        k8 = self.ops[a8].dst_ld  # bytes per row of a pair: 2 * K padded to 16, the same for both
        block_n, pingpong = sm90.choose_pair_config(m, n, _kernels.sm_count(self.device_id))
        launch = sm90.PairLaunch(
            self.addr(a), self.ops[a].dst_ld, "km" if g in ("gemm2", "gemm4") else "mk", self.addr(b),
            self.ops[b].dst_ld, "kn", self.addr(a8), k8, self.addr(b8), self.ops[b8].dst_ld, m, n, k, k8,
            device_id=self.device_id, alpha_ptr=alpha_ptr, pair_scale=P.E4M3_PAIR_SCALE, block_n=block_n,
            pingpong=pingpong, ldc=n, raster=sm90.choose_pair_raster(m, n))
        return gemm_desc.Sm90PairGemm(launch, f"{g} f16+e4m3 (sm90 pair kernel)")

    # ------------------------------------------------------------------ per call
    def bind(self, dy, x, w1, w2, g, ieee_g):
        """ieee (fp32 operands read as given): this call's operand pointers; `ieee_g` gelu_out recomputed in fp32
        scratch where `g` is None (memory mode)."""
        self.gemm1.a.value, self.gemm1.lda.value = dy.ptr, dy.ld
        self.gemm1.b.value, self.gemm1.ldb.value = w2.ptr, w2.ld
        if self.gemm2 is not None:
            self.gemm2.a.value, self.gemm2.lda.value = dy.ptr, dy.ld
            if g is not None:
                self.gemm2.b.value, self.gemm2.ldb.value = g.ptr, g.ld
            else:  # gelu_out recomputed into fp32 scratch
                self.gemm2.b.value, self.gemm2.ldb.value = ieee_g.ptr, self.plan.H
            self.gemm4.b.value, self.gemm4.ldb.value = x.ptr, x.ld
        if self.gemm3 is not None:
            self.gemm3.b.value, self.gemm3.ldb.value = w1.ptr, w1.ld

    def set_outputs(self, outputs, accumulate):
        """This call's output pointers and the weight gradients' beta (0, or 1 when accumulating)."""
        grad_hidden, grad_w1, grad_w2 = outputs
        beta = self._consts.data.ptr + (4 if accumulate else 0)
        if self.gemm3 is not None:
            gemm_desc.set_output(self.gemm3, grad_hidden)
        if self.gemm2 is not None:
            gemm_desc.set_output(self.gemm2, grad_w2)
            gemm_desc.set_output(self.gemm4, grad_w1)
            gemm_desc.set_beta(self.gemm2, beta, accumulate)
            gemm_desc.set_beta(self.gemm4, beta, accumulate)
