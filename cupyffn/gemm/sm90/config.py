"""The sm90 GEMM's variants as data: :class:`Sm90Config` (every compile-time choice of kernels_cu/gemm_sm90.cu),
:func:`can_implement` (the one statement of which variants exist), the functions that choose a config, and the
shared-memory arithmetic of kernels_cu/sm90/types.cuh.

Two kernels: ``gemm_sm90_kernel<OP, BN, EPI, PP, XS>``, the fused GEMM1 + GELU derivative of the tf32 plan (fp16
operands, scaled fp16 out, optionally gelu_out's codes too) and of the bf16x3 plan (bf16 operands, three bf16
planes out), B a weight as stored ([K, N]); and ``gemm_sm90_pair_kernel<BN, TA>``, the fp16+fp8 plan's f16+e4m3
pair (fp32 out), A [M, K] or [K, M]. Every variant :func:`can_implement` accepts is one an engine plan can run
(:func:`choose_dgelu_config`, :func:`choose_pair_config`, EngineOptions' explicit choices); the others were removed,
since code no plan runs is neither tested nor kept working (their measurements are in docs/decisions/).
"""

import dataclasses

#: Source file in kernels_cu/ (compiled for sm_90a only), with its headers kernels_cu/sm90/*.cuh.
SOURCE = "gemm_sm90.cu"

# kernels_cu/sm90/types.cuh's, checked at every build (budget_checks).
THREADS = 384      # kThreads: producer warpgroup + 2 consumer warpgroups
EW_THREADS = 512   # kEwThreads: with the epilogue warps, a fourth warpgroup
BLOCK_M = 128
BLOCK_K = 64
XT_COLS = 32       # kXtCols: columns of a staged epilogue's x/t group (docs/decisions/027-xt-whole-row-segments.md)
XS_STAGE_DROP = 1  # kXsStageDrop: pipeline stages the staged epilogue gives up for its slots
EW_STAGES = 4      # kEwStages: pipeline stages with the epilogue warps (docs/decisions/045-epilogue-warps.md)
EW_RING = 2        # kEwRing: x/t items in flight per epilogue warp
SMEM_LIMIT = 232448  # 227 KiB of dynamic shared memory per CTA

OP_F16 = 0
OP_BF16 = 1
OP_F16E4M3 = 2  # the fp16+fp8 pair in one kernel (gemm_sm90_pair_kernel)
OP_E4M3 = 100   # not a kernel operand code: the tensor-map kind of the pair's 8-bit operands (encode_tensor_map)
EPI_F32 = 0     # the pair's fp32 out
EPI_DGELU_F16 = 2   # fp16(alpha * acc * gelu'(x, t)): the tf32 plan's grad_linear1
EPI_DGELU_BF16X3 = 3  # three bf16 planes (hi, lo, hi) side by side in a row: the bf16x3 plan's grad_linear1
EPI_DGELU_F16G = 4  # EPI_DGELU_F16 and gelu_out = 0.5 x (1 + t) as fp16 codes too: GEMM2's operand

#: (block_n, pingpong) schedules: cooperative 128 x 128 and 128 x 256 tiles, ping-pong 128 x 128.
SCHEDULES = ((128, False), (256, False), (128, True))
#: The pair kernel's schedules: cooperative only (ping-pong measured 1.5-2.2x slower everywhere,
#: docs/decisions/024-sm90-pair-kernel-gemm1.md); 128 x 192 for outputs whose 128 x 128 and 128 x 256 tiles leave the
#: last wave of 132 SMs part empty (docs/decisions/064-pair-kernel-for-every-gemm.md).
PAIR_SCHEDULES = ((128, False), (192, False), (256, False))
#: How a dgelu epilogue reads linear1_out and tanh_inner (template parameter XS): "direct" (global loads in the
#: epilogue), "staged" (cp.async into shared memory during the mainloop: rows on 16-byte boundaries), "warps" (the
#: epilogue in seven warps of its own, fed each accumulator tile through shared memory: the cooperative 128 x 128
#: tile, one-plane fp16, rows as "staged").
EPILOGUES = ("direct", "staged", "warps")
WARPS = "warps"
WARPS_SCHEDULE = (128, False)
#: How the pair's fp16 A is laid out (template parameter TA): "mk" ([M, K], K contiguous) or "km" ([K, M], M
#: contiguous: grad_output / grad_linear1 as stored, the A of the weight gradients).
A_LAYOUTS = ("mk", "km")
#: The dgelu epilogues of each 16-bit operand type.
_DGELU_EPIS = {OP_F16: (EPI_DGELU_F16, EPI_DGELU_F16G), OP_BF16: (EPI_DGELU_BF16X3,)}


@dataclasses.dataclass(frozen=True)
class Sm90Config:
    """One variant of kernels_cu/gemm_sm90.cu: every compile-time choice.

    op: OP_F16 or OP_BF16 (gemm_sm90_kernel, a dgelu epilogue) or OP_F16E4M3 (gemm_sm90_pair_kernel, fp32 out);
    block_n, pingpong: the schedule (SCHEDULES; the pair: PAIR_SCHEDULES); epi: the EPI_* code; epilogue: how a
    dgelu epilogue gets x and t (EPILOGUES; the pair: "direct"); a_layout: the pair's A ("mk" or "km"; "mk" for
    gemm_sm90_kernel); trace: compiled with the per-tile timestamps (kernels_cu/sm90/trace.cuh; dev/sm90_trace.py),
    never in the product. Only the configs :func:`can_implement` accepts exist.
    """

    op: int
    block_n: int
    pingpong: bool = False
    epi: int = EPI_F32
    epilogue: str = "direct"
    a_layout: str = "mk"
    trace: bool = False

    @property
    def xs(self):
        """Template parameter XS: 0 direct, 1 staged, 2 the epilogue warps."""
        return EPILOGUES.index(self.epilogue)

    @property
    def expression(self):
        """The NVRTC name expression of the kernel template instantiation."""
        if self.op == OP_F16E4M3:
            return f"gemm_sm90_pair_kernel<{self.block_n}, {A_LAYOUTS.index(self.a_layout)}>"
        return f"gemm_sm90_kernel<{self.op}, {self.block_n}, {self.epi}, {int(self.pingpong)}, {self.xs}>"

    @property
    def nvrtc_options(self):
        """NVRTC options; CuPy adds its include paths and its own -arch=sm_90 (NVRTC then still compiles for
        sm_90a: a plain sm_90 pass would reject wgmma, so a successful build is an sm_90a one)."""
        return ("-arch=sm_90a", "--std=c++17") + (("-DCUPYFFN_SM90_TRACE=1",) if self.trace else ())

    @property
    def threads(self):
        return EW_THREADS if self.epilogue == WARPS else THREADS

    @property
    def smem_bytes(self):
        """Dynamic shared memory a launch needs (the kernel traps if given less)."""
        if self.epilogue == WARPS:
            return ew_smem_bytes()
        return xs_smem_bytes(self.block_n) if self.epilogue == "staged" else smem_bytes(self.block_n)


def _why_not(config):
    """None if kernels_cu/gemm_sm90.cu has `config`'s variant, else why not (a sentence)."""
    c = config
    if not isinstance(c.trace, bool) or not isinstance(c.pingpong, bool):
        return f"pingpong and trace must be bools, got {c.pingpong!r}, {c.trace!r}"
    if c.op == OP_F16E4M3:
        if (c.block_n, c.pingpong) not in PAIR_SCHEDULES:
            return f"the pair kernel runs the schedules {PAIR_SCHEDULES} (block_n, pingpong), got {(c.block_n, c.pingpong)}"
        if c.epi != EPI_F32 or c.epilogue != "direct" or c.a_layout not in A_LAYOUTS:
            return (f"the pair kernel writes fp32 (epi EPI_F32, epilogue 'direct') with a_layout one of {A_LAYOUTS}, "
                    f"got epi {c.epi!r}, epilogue {c.epilogue!r}, a_layout {c.a_layout!r}")
        return None
    if c.op not in _DGELU_EPIS:
        return f"op must be OP_F16, OP_BF16 or OP_F16E4M3, got {c.op!r}"
    if (c.block_n, c.pingpong) not in SCHEDULES:
        return f"(block_n, pingpong) must be one of {SCHEDULES}, got {(c.block_n, c.pingpong)}"
    if c.epi not in _DGELU_EPIS[c.op]:
        return f"operand code {c.op} has the dgelu epilogues {_DGELU_EPIS[c.op]}, got epi {c.epi!r}"
    if c.epilogue not in EPILOGUES or c.a_layout != "mk":
        return f"epilogue must be one of {EPILOGUES} and a_layout 'mk', got {c.epilogue!r}, {c.a_layout!r}"
    if c.epilogue == WARPS and ((c.block_n, c.pingpong) != WARPS_SCHEDULE or c.epi == EPI_DGELU_BF16X3):
        return (f"epilogue 'warps' runs the cooperative 128 x 128 tile {WARPS_SCHEDULE} with a one-plane fp16 "
                f"epilogue, got {(c.block_n, c.pingpong)}, epi {c.epi}")
    if c.epi == EPI_DGELU_F16G and c.block_n == 256:
        # its staged variant spills (tests/test_kernels_compile.py fails on spills); choose_config takes 128 x 128
        return "gelu_out (EPI_DGELU_F16G) has no 128 x 256 variant: pass block_n=128"
    return None


def can_implement(config):
    """Whether kernels_cu/gemm_sm90.cu has `config`'s variant (check_config says why not)."""
    return _why_not(config) is None


def check_config(config):
    """`config`, or ValueError naming what kernels_cu/gemm_sm90.cu does not have."""
    why = _why_not(config)
    if why is not None:
        raise ValueError(f"no sm90 GEMM variant {config}: {why}")
    return config


def _variants():
    for op in (OP_F16, OP_BF16):
        for epi in _DGELU_EPIS[op]:
            for block_n, pingpong in SCHEDULES:
                for epilogue in EPILOGUES:
                    yield Sm90Config(op, block_n, pingpong, epi, epilogue)
    for block_n, pingpong in PAIR_SCHEDULES:
        for a_layout in A_LAYOUTS:
            yield Sm90Config(OP_F16E4M3, block_n, pingpong, a_layout=a_layout)


#: Every variant (untraced), each compiled on first use.
VARIANTS = tuple(c for c in _variants() if can_implement(c))


# ---- choosing ----------------------------------------------------------------------------------------
def choose_config(m, n, sms, tanh_inner=True, gelu_out=False):
    """The (block_n, pingpong) of a fused GEMM1 + dgelu of an [m, n] output on `sms` multiprocessors.

    With tanh_inner given: the 128 x 128 tile if it fills the last wave better than 128 x 256 by more than 2%,
    as ping-pong where each CTA gets two or three tiles (sms < tiles <= 3 sms: the two consumers take turns,
    one's epilogue under the other's mainloop), cooperative otherwise; else 128 x 256 cooperative.
    Memory mode (tanh_inner recomputed): the 128 x 128 cooperative tile everywhere (64 accumulators per thread
    leave ptxas the registers for tanhf's temporaries; the 128-accumulator variants must serialize it).
    Measured, every schedule at T = 256 ... 8192, H = 6144 on the H200 (docs/decisions/031-schedule-per-t.md): the
    rule's choice is the fastest or within 3.1% of it at every T.
    gelu_out (EPI_DGELU_F16G, which has no 128 x 256 variant): 128 x 128 ping-pong where the rule says 128 x 256 (in
    the same sweep, dgelu alone, 1.003x of 128 x 256 at T = 8192 and 1.04x at T = 4096; 128 x 128 cooperative 1.008x
    and 1.07x)."""
    if not tanh_inner:
        return (128, False)

    if _wave_fill(m, n, 128, sms) > _wave_fill(m, n, 256, sms) + 0.02:
        return (128, sms < _tiles(m, n, 128) <= 3 * sms)
    return (128, True) if gelu_out else (256, False)


def choose_dgelu_config(m, n, sms, epi, *, tanh_inner, rows_16b, warps=False):
    """The variant of the engine's fused GEMM1 + dgelu (DgeluLaunch) of an [m, n] output on `sms` multiprocessors,
    epilogue `epi`: choose_config's schedule with the staged epilogue where the rows of linear1_out and tanh_inner
    start on 16-byte boundaries (`rows_16b`), else the direct one; with `warps` (tanh_inner given, rows_16b, a
    one-plane epilogue: EngineOptions.epilogue_warps) the epilogue warps instead (the same bits,
    docs/decisions/045-epilogue-warps.md)."""
    op = OP_BF16 if epi == EPI_DGELU_BF16X3 else OP_F16
    if warps and tanh_inner and rows_16b and epi != EPI_DGELU_BF16X3:
        return check_config(Sm90Config(op, *WARPS_SCHEDULE, epi, WARPS))
    if warps and tanh_inner and epi != EPI_DGELU_BF16X3:  # rows off 16 bytes: direct, on the warps' schedule
        block_n, pingpong = WARPS_SCHEDULE
    else:
        block_n, pingpong = choose_config(m, n, sms, tanh_inner=tanh_inner, gelu_out=epi == EPI_DGELU_F16G)
    return check_config(Sm90Config(op, block_n, pingpong, epi, "staged" if rows_16b else "direct"))


def choose_pair_config(m, n, sms):
    """The (block_n, pingpong) of a pair kernel launch of an [m, n] output on `sms` multiprocessors: the tile width
    whose waves take the least time, counting every wave as full (waves x block_n), the wider tile where two tie
    (fewer tiles re-read fewer operands); always cooperative (ping-pong is 1.5-2.2x slower everywhere: the pair's
    e4m3 stages bring the same bytes per stage in half the MMA time, so delivery rules). Measured on the H100
    per GEMM and token count (docs/decisions/064-pair-kernel-for-every-gemm.md, 024)."""
    costs = {block_n: -(-_tiles(m, n, block_n) // sms) * block_n for block_n, _ in PAIR_SCHEDULES}
    return min(costs, key=lambda block_n: (costs[block_n], -block_n)), False


#: Tile order of a pair launch whose output has at least as many rows as columns (GemmArgs::raster: bands of this many
#: tile rows; 0, down each column, for the wide ones). Measured on the H100, GEMMs alone
#: (docs/decisions/064-pair-kernel-for-every-gemm.md): GEMM4 ([H, D]: 48 tile rows) 0.93-0.96x of the column order at
#: T = 1024-4904, GEMM1 at T = 8192 0.97x, GEMM2 ([D, H]: 12 tile rows) 1.00-1.05x with bands, so not there.
PAIR_RASTER = 8


def choose_pair_raster(m, n):
    """The tile order (GemmArgs::raster) of a pair launch of an [m, n] output: bands of PAIR_RASTER tile rows where
    m >= n, else the column order (0)."""
    return PAIR_RASTER if m >= n else 0


def _tiles(m, n, block_n):
    """Output tiles of BLOCK_M x block_n over an [m, n] output."""
    return -(-m // BLOCK_M) * -(-n // block_n)


def _wave_fill(m, n, block_n, sms):
    """How full the waves of those tiles keep `sms` multiprocessors (1.0: the last wave is full too)."""
    tiles = _tiles(m, n, block_n)
    return tiles / (-(-tiles // sms) * sms)


# ---- shared memory (kernels_cu/sm90/types.cuh) -------------------------------------------------------
def stage_bytes(block_n):
    """Bytes of one pipeline stage (stage_bytes_for): the 16-bit (or e4m3: the same bytes) tiles of A and B."""
    return (BLOCK_M + block_n) * BLOCK_K * 2


def stages_for(block_n):
    """Pipeline stages (stages_for): as many as fit in 200 KiB."""
    return (200 * 1024) // stage_bytes(block_n)


def smem_bytes(block_n):
    """Dynamic shared memory of one CTA (smem_bytes_for): the stages, 1 KiB of alignment slack, 2 mbarriers a stage."""
    s = stages_for(block_n)
    return s * stage_bytes(block_n) + 1024 + 2 * 8 * s


def xt_slot_bytes():
    """Bytes of one x/t slot of the staged epilogue (kXtSlotBytes): x and t of a 64 x XT_COLS group."""
    return 2 * 64 * XT_COLS * 4


def xs_stages_for(block_n):
    """Pipeline stages with the staged epilogue (xs_stages_for): XS_STAGE_DROP fewer, to make room for the slots."""
    return stages_for(block_n) - XS_STAGE_DROP


def xt_slots_for(block_n):
    """x/t slots per consumer of the staged epilogue (xt_slots_for): what is left of 224 KiB, halved."""
    return (224 * 1024 - xs_stages_for(block_n) * stage_bytes(block_n)) // (2 * xt_slot_bytes())


def xs_smem_bytes(block_n):
    """Dynamic shared memory of one CTA with the staged epilogue (xs_smem_bytes_for)."""
    s = xs_stages_for(block_n)
    return s * stage_bytes(block_n) + 2 * xt_slots_for(block_n) * xt_slot_bytes() + 1024 + 2 * 8 * s


def budget_checks():
    """C++ static_asserts that the arithmetic here is kernels_cu/sm90/types.cuh's (tile, stages, slots, rings, shared
    memory of every schedule and epilogue): appended to the source the launcher compiles, so a build in which the two
    disagree fails (launch.py module; tests/test_kernels_compile.py)."""
    bns = sorted({bn for bn, _ in SCHEDULES + PAIR_SCHEDULES})
    checks = [f"sm90::kThreads == {THREADS} && sm90::kBM == {BLOCK_M} && sm90::kBK == {BLOCK_K}",
              f"sm90::kXtSlotBytes == {xt_slot_bytes()} && sm90::kXtCols == {XT_COLS} && "
              f"sm90::kXsStageDrop == {XS_STAGE_DROP}",
              f"sm90::kEwThreads == {EW_THREADS} && sm90::kEwStages == {EW_STAGES} && sm90::kEwRing == {EW_RING} && "
              f"sm90::ew_smem_bytes_for() == {ew_smem_bytes()}"]
    checks += [f"sm90::stages_for({bn}) == {stages_for(bn)} && sm90::smem_bytes_for({bn}) == {smem_bytes(bn)}"
               for bn in bns]
    checks += [f"sm90::xs_stages_for({bn}) == {xs_stages_for(bn)} && sm90::xt_slots_for({bn}) == {xt_slots_for(bn)} "
               f"&& sm90::xs_smem_bytes_for({bn}) == {xs_smem_bytes(bn)}" for bn in sorted({bn for bn, _ in SCHEDULES})]
    return "".join(f'\nstatic_assert({c}, "cupyffn/gemm/sm90/config.py disagrees with types.cuh");' for c in checks)


def ew_smem_bytes():
    """Dynamic shared memory of one CTA with the epilogue warps (ew_smem_bytes_for): EW_STAGES stages of the
    128 x 128 tile, the fp32 accumulator tile, 7 warps' rings of EW_RING items of 2 KiB, and the mbarriers."""
    return EW_STAGES * stage_bytes(128) + BLOCK_M * 128 * 4 + 7 * EW_RING * 2048 + 1024 + 8 * (2 * EW_STAGES + 2)
