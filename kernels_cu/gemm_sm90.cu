// Hopper (sm_90a) GEMM: C[M,N] = A[M,K] @ B[N,K]^T with 16-bit operands (fp16 or bf16), fp32
// accumulation in registers, and an epilogue chosen at compile time.
//
//   A: [M, K] row-major (K contiguous). B: [N, K] row-major (K contiguous, template parameter BT = 0:
//   both operands K-major, "TN", the layout wgmma reads from 128-byte-swizzled shared memory without
//   transposes), or B: [K, N] row-major (N contiguous, BT = 1: a weight as it is stored, e.g. GEMM1's
//   weight2 [D, H]; TMA loads 64 x 64 boxes and wgmma reads them MN-major, imm-trans-b = 1).
//
// Structure (technique as in CUTLASS's sm90 warp-specialized kernels and public write-ups of
// hand-written wgmma GEMMs; this code is our own):
//   * 384 threads = 3 warpgroups. Warpgroup 0 is the producer: one thread issues TMA bulk tensor
//     copies (cp.async.bulk.tensor.2d) of a 128 x 64 tile of A and a BN x 64 tile of B per stage,
//     completing on the stage's "full" mbarrier. Warpgroups 1 and 2 are consumers: they issue
//     wgmma.mma_async m64nBNk16 from shared memory (4 per 64-wide K step and 64 rows), keep one group
//     in flight, and release a stage on its "empty" mbarrier once the group that read it is done.
//     Schedules (template parameter PP): cooperative (both consumers on one tile, 64 rows each) or
//     ping-pong (each consumer owns whole 128 x 128 tiles in turn: one stores while the other computes).
//   * setmaxnreg hands the producer's registers to the consumers (40 / 232 per thread).
//   * Persistent: the grid is at most one CTA (or cluster, below) per SM; CTAs walk the output tiles with a
//     stride of the grid, in the order GemmArgs::raster gives (M fastest down whole columns, or in bands
//     of R tile rows: group_coords). The pipeline runs on across tile boundaries, so the producer loads
//     the next tile while the consumers store.
//   * Optionally clusters of two CTAs on vertically adjacent tiles that share B by TMA multicast
//     (gemm_sm90_cluster2_kernel; see gemm_sm90_body).
//   * Out-of-bounds rows/columns/K of a tile are zero-filled by TMA; the epilogue stores only
//     in-bounds elements.
//
// The fp16+fp8 plan's pair (gemm_sm90_pair_kernel, OP = kOpF16E4M3): the same pipeline runs first the e4m3
// stages of the cross terms, then the fp16 ones, into one accumulator (see gemm_sm90_body); fp32 out.
//
// Epilogues (template parameter EPI):
//   kEpiF32         C = alpha * acc (+ C if accumulate), fp32 [M, N] with leading dimension ldc; alpha is
//                   *acc_scale where given (the engine's device constant), else GemmArgs::alpha
//   kEpiDgeluBf16   C = bf16(acc * gelu'(x, t)) (bits, uint16), x = linear1_out, t = tanh_inner
//                   (fp32 [M, N]); t == nullptr recomputes t from x (memory mode)
//   kEpiDgeluF16    C = fp16(alpha * acc * gelu'(x, t)), alpha a power of two chosen by the caller, or
//                   2^state[slot] from the engine's fp16 scale state (the "tf32" plan)
//   kEpiDgeluF16G   kEpiDgeluF16, and GEMM2's operand as a second output: gelu_out = 0.5 x (1 + t) (the
//                   forward's formula, in its order) as fp16 codes of gelu_out * 2^state[g_slot] (or g_alpha) in
//                   g [M, N] (leading dimension ldg), max |gelu_out| folded into g_amax: the "tf32" plan forms
//                   gelu_out from the x and t it holds anyway instead of converting the caller's copy
//   kEpiDgeluBf16x3 g = acc * gelu'(x, t) as three bf16 planes side by side in each row of C: columns
//                   [0, N) hi = bf16(g), [N, 2N) lo = bf16(g - hi), [2N, 3N) hi again (ldc >= 3N): the
//                   bf16x3 plan's grad_linear1, the A operand (hi, lo, hi) of GEMM3 and GEMM4 (K tripled)
//   Both dgelu epilogues can also fold max |g| (finite g, before alpha) into a device word (GemmArgs::amax),
//   multiply acc by a device scale first (GemmArgs::acc_scale: GEMM1's alpha), and run as the engine's
//   rescue launch (GemmArgs::rescue; kernels_cu/convert.cu explains gathering and rescue passes).
//
// How a dgelu epilogue gets x and t (template parameter XS):
//   XS = 0 ("direct") loads them from global memory in the epilogue, 8 bytes per thread and fragment:
//          few bytes in flight per SM, so the epilogue runs at a fraction of HBM bandwidth.
//   XS = 1 ("staged") copies them with cp.async into a per-consumer ring of shared-memory slots, one
//          slot per "group" (64 rows x kXtCols columns of the consumer's block, x and t): the first
//          kXtSlots groups are requested when the tile starts (they land during its mainloop), each
//          later one as soon as the epilogue frees a slot. Each warp copies the 16 rows of its own
//          accumulator fragment as whole row segments (64-128 contiguous bytes per row, where the
//          fragment layout gives 32: DRAM and L2 serve whole sectors, not scattered halves of lines),
//          and only that warp reads them back (swizzled: no bank conflicts), so a warp waits for its
//          own copies (cp.async.wait_group + __syncwarp): no block barrier, no cross-warp hand-off,
//          nothing that can deadlock. It costs CUPYFFN_XS_STAGE_DROP pipeline stages to make room.
//   XS = 2 ("warps": cooperative 128 x 128 tiles only) hands each accumulator tile through shared memory to seven
//          epilogue warps (warps 1-3 of the producer warpgroup and a fourth warpgroup: 512 threads), which run the
//          epilogue (x and t through rings of their own) while the consumers compute the next tile. 4 stages; no
//          setmaxnreg (every warp keeps the launch's 128 registers). See ew_epilogue.
//
// Constraints (checked by cupyffn/_sm90_gemm.py): K >= 1; lda, ldb multiples of 8 elements and A, B
// 16-byte aligned (TMA; the pair's e4m3 rows: multiples of 16 bytes, k8 a positive multiple of 16); ldc, ldx, ldt even (pairs of columns are stored/loaded together) and C, x, t
// 16-byte aligned; the staged epilogue also needs ldx, ldt multiples of 4 (16-byte row starts), and with
// kEpiDgeluF16G ldg == ldc (it addresses gelu_out's rows with ldc). Compile for sm_90a (wgmma, setmaxnreg): cupyffn/_sm90_gemm.py does.

#include "common.cuh"

#define kEpiF32 0
#define kEpiDgeluBf16 1
#define kEpiDgeluF16 2
#define kEpiDgeluBf16x3 3
#define kEpiDgeluF16G 4
#define kOpF16 0
#define kOpBf16 1
#define kOpF16E4M3 2

namespace sm90 {

// Measurement only (tools/sm90_trace.py --probe 3): the consumers wait for and release every stage without
// issuing its wgmma, so the mainloop's time is the data movement alone.
#if defined(CUPYFFN_SM90_TRACE) && CUPYFFN_SM90_EPI_PROBE == 3
constexpr bool kProbeNoMma = true;
#else
constexpr bool kProbeNoMma = false;
#endif
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kBM = 128;       // rows of a CTA tile (64 per consumer warpgroup)
constexpr int kBK = 64;        // K per stage: 64 16-bit elements = one 128-byte swizzle row

// A CUtensorMap: 128 opaque bytes built on the host by cuTensorMapEncodeTiled, passed by value as a
// __grid_constant__ parameter (so its address is a valid generic address for the TMA unit).
struct __align__(64) TmaDesc {
  unsigned long long opaque[16];
};

struct GemmArgs {
  void* c;        // kEpiF32: float*; else 16-bit codes
  const float* x; // linear1_out (dgelu epilogues)
  const float* t; // tanh_inner (dgelu epilogues); nullptr: recomputed from x
  long long ldc;
  long long ldx;
  long long ldt;
  int m;
  int n;
  int k;
  float alpha;    // kEpiDgeluF16: scale applied before rounding to fp16; kEpiF32: C's scale (unless acc_scale)
  unsigned* amax; // dgelu epilogues: if not nullptr, max |g| over the finite g (unscaled) is folded into
                  // *amax by atomicMax on the float's bits (non-negative floats order like their bits)
  // The engine's device-side scales (the "tf32" plan; common.cuh's scale state), all optional:
  const float* acc_scale;  // dgelu epilogues: g = (*acc_scale * acc) * gelu' (GEMM1's alpha 2^-(e_a + e_b))
  int* state;     // kEpiDgeluF16: alpha = 2^state[slot] instead of `alpha`
  float* consts;  // rescue launch: block 0 writes the alphas of alpha_mask's GEMMs (common.cuh write_alphas)
  int slot;       // the output's scale slot
  int rescue;     // 1: the rescue launch: runs only if state flags `slot` for conversion again
  int alpha_mask;
  int xt_pairs;   // direct epilogue: 1 if x and t rows hold 8-byte aligned column pairs (else one float at a time)
  int raster;     // order of the output tiles: 0 down each column, R > 0 in bands of R tile(-group) rows (group_coords)
  // kOpF16E4M3 (gemm_sm90_pair_kernel): C = scale * (pair_scale * A8 B8^T + A B^T) (+ C), the e4m3 stages first
  float pair_scale;  // the e4m3 product's weight against the fp16 one (a power of two: exact)
  int k8;            // K of the e4m3 operands (bytes per row in use; 0: no e4m3 stages)
  int accumulate;    // kEpiF32: 1 adds to C (the weight gradients' beta = 1), 0 overwrites it
  // kEpiDgeluF16G: the second output, gelu_out as fp16 codes (GEMM2's B operand)
  unsigned short* g;
  long long ldg;
  unsigned* g_amax;  // if not nullptr: max |gelu_out| (finite, unscaled) folded in as amax is
  int g_slot;        // with state: gelu_out's scale slot (scale 2^state[g_slot]); without: scale g_alpha
  float g_alpha;
  // BT = 2 (B fp32 [K, N], converted to fp16 in the kernel): B's codes are fp16(b * 2^state[b_slot]) with state
  // (b_slot >= 0), else fp16(b * b_alpha); max |b| over the finite b folded into b_amax if not nullptr
  unsigned* b_amax;
  int b_slot;
  float b_alpha;
};
static_assert(sizeof(GemmArgs) == 176, "GemmArgs layout is mirrored in cupyffn/_sm90_gemm.py");
static_assert(sizeof(TmaDesc) == 128, "a CUtensorMap is 128 bytes");

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}

// ---- mbarrier -----------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Returns once the phase of parity `parity` has completed (a fresh barrier counts its phase before
// phase 0 as completed: waiting for parity 1 returns at once). Parity alone tells phases apart only
// if the waiter is at most one phase ahead of the barrier: the schedules below make sure of that.
// A wait that never ends (a pipeline bug) traps after kHangNs of wall time (the clock is read once
// per 4096 failed polls): a launch error the caller sees within seconds instead of a process that
// hangs (a poll count alone gives no time bound: one try_wait may suspend the thread for a while).
constexpr unsigned long long kHangNs = 2000000000ull;  // 2 s; a legitimate wait lasts one GEMM at most

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  unsigned done, polls = 0;
  unsigned long long since = 0;
  for (;;) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    if (done) return;
    if ((++polls & 4095u) == 0) {
      const unsigned long long now = global_ns();
      if (since == 0) {
        since = now;
      } else if (now - since > kHangNs) {
        __trap();
      }
    }
  }
}

// Named barriers 1 and 2 (0 is __syncthreads): the ping-pong consumers' turns, see the kernel.
__device__ __forceinline__ void named_bar_sync(unsigned id, unsigned threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_bar_arrive(unsigned id, unsigned threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- clusters -----------------------------------------------------------------------------------
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// Every thread of every CTA of the cluster: memory operations before it (mbarrier inits, remote arrivals)
// are visible to all of them after it. Not .aligned: the producer warpgroup arrives from divergent code.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// Arrives on the mbarrier at shared-memory offset `bar` of the CTA of cluster rank `rank` (itself included).
// The default semantics (.release at CTA scope), as for a local arrive: what it orders is this warp's reads of
// the stage, done (wgmma.wait_group) before the arrive. An explicit .release.cluster costs a cluster-scope
// fence per stage and warp: measured 1.5-2.4x slower kernels (docs/decisions/033-clusters-b-multicast.md).
__device__ __forceinline__ void mbar_arrive_cluster(unsigned bar, unsigned rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}

// A consumer warp is done with a stage: with CL = 2 both CTAs' producers write into it (A and one half of B
// here, the other half from the peer), so both must hear it.
template <int CL>
__device__ __forceinline__ void release_stage(unsigned empty) {
  if constexpr (CL == 1) {
    mbar_arrive(empty);
  } else {
#pragma unroll
    for (unsigned r = 0; r < (unsigned)CL; ++r) mbar_arrive_cluster(empty, r);
  }
}

// ---- TMA ----------------------------------------------------------------------------------------
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TmaDesc* map, unsigned bar, int inner, int outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(inner), "r"(outer), "r"(bar)
      : "memory");
}

// The same copy delivered to the same shared-memory offset of every CTA in `cta_mask` (bit r: cluster rank r),
// each completing the bytes it receives on its own mbarrier at offset `bar`.
__device__ __forceinline__ void tma_load_2d_multicast(unsigned dst, const TmaDesc* map, unsigned bar, int inner, int outer,
                                                      unsigned short cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(inner), "r"(outer), "r"(bar), "h"(cta_mask)
      : "memory");
}

// A box of B: to this CTA alone (CL = 1), or multicast to every CTA of the cluster.
template <int CL>
__device__ __forceinline__ void tma_load_b(unsigned dst, const TmaDesc* map, unsigned bar, int inner, int outer) {
  if constexpr (CL == 1) {
    tma_load_2d(dst, map, bar, inner, outer);
  } else {
    tma_load_2d_multicast(dst, map, bar, inner, outer, (unsigned short)((1u << CL) - 1u));
  }
}

__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// ---- wgmma --------------------------------------------------------------------------------------
// Shared-memory matrix descriptor (sm90 GMMA descriptor): start address >> 4 in bits 0-13, leading
// byte offset >> 4 in bits 16-29 (unused for swizzled K-major; 1 by convention), stride byte offset
// >> 4 in bits 32-45 (1024 B: one 8-row x 128 B swizzle atom to the next), layout in bits 62-63
// (1 = 128-byte swizzle). Tiles start on 1024-byte boundaries (base offset 0); stepping K by 16
// elements inside the 128-byte row adds 32 bytes to the start address.
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
         (1ull << 62);
}

// The same for an MN-major operand (B given as [K, N], N contiguous: BT = 1): the stage holds BN / 64
// TMA boxes of 64 K-rows x 64 N-elements (128 B), 8 KiB each, 128-byte swizzled. The canonical MN-major
// SW128 layout (as CUTLASS's make_gmma_desc<Major::MN> documents it) steps 64-element N chunks by the
// leading byte offset (8 KiB: box to box) and 8-row K groups by the stride byte offset (1024 B: atom to
// atom); stepping K by 16 rows adds 2048 bytes to the start address.
__device__ __forceinline__ unsigned long long smem_desc_mn(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(8192 >> 4) << 16) |
         ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed wgmma groups of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Keeps the compiler from moving accesses to the accumulators across the asynchronous wgmma.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The m64nNk16 wgmma with both operands from shared memory, scale-d = 1 (accumulate into d), A K-major,
// B K-major (TB = 0) or MN-major (TB = 1: imm-trans-b). The register lists are mechanical (d[0..N/2)), so they are spelled once,
// as macros: the PTX operand numbers %0.. and the matching "+f" constraints; the descriptors follow them.
#define CUPYFFN_WGMMA_REGS_0_64 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define CUPYFFN_WGMMA_REGS_64_128 \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define CUPYFFN_WGMMA_D_0_64 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define CUPYFFN_WGMMA_D_64_128 \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// One wgmma of N columns on TYPE ("f16" or "bf16") operands: REGS the accumulator operand numbers, DESCS
// the numbers of the two descriptors and of the imm-trans-a and imm-trans-b immediates after them, then the
// accumulators' "+f" constraints.
#define CUPYFFN_WGMMA(N, TYPE, REGS, DESCS, ...)                                                      \
  asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" REGS "}, " DESCS \
               ";\n"                                                                                \
               : __VA_ARGS__                                                                        \
               : "l"(desc_a), "l"(desc_b), "n"(TA), "n"(TB)                                         \
               : "memory")

// The m64nNk32 e4m3 x e4m3 wgmma (the fp16+fp8 pair's cross terms): 8-bit operands are K-major only, so
// the instruction has no transpose immediates (scale-d, imm-scale-a, imm-scale-b = 1).
#define CUPYFFN_WGMMA_E4M3(N, REGS, DESCS, ...)                                                    \
  asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {" REGS "}, " DESCS ";\n" \
               : __VA_ARGS__                                                                     \
               : "l"(desc_a), "l"(desc_b)                                                        \
               : "memory")

template <int OP, int TA, int TB>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], unsigned long long desc_a, unsigned long long desc_b) {
  if constexpr (OP == kOpBf16) {
    CUPYFFN_WGMMA(128, "bf16", CUPYFFN_WGMMA_REGS_0_64, "%64, %65, 1, 1, 1, %66, %67", CUPYFFN_WGMMA_D_0_64);
  } else {
    CUPYFFN_WGMMA(128, "f16", CUPYFFN_WGMMA_REGS_0_64, "%64, %65, 1, 1, 1, %66, %67", CUPYFFN_WGMMA_D_0_64);
  }
}

template <int OP, int TA, int TB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], unsigned long long desc_a, unsigned long long desc_b) {
  if constexpr (OP == kOpBf16) {
    CUPYFFN_WGMMA(256, "bf16", CUPYFFN_WGMMA_REGS_0_64 ", " CUPYFFN_WGMMA_REGS_64_128, "%128, %129, 1, 1, 1, %130, %131",
                  CUPYFFN_WGMMA_D_0_64, CUPYFFN_WGMMA_D_64_128);
  } else {
    CUPYFFN_WGMMA(256, "f16", CUPYFFN_WGMMA_REGS_0_64 ", " CUPYFFN_WGMMA_REGS_64_128, "%128, %129, 1, 1, 1, %130, %131",
                  CUPYFFN_WGMMA_D_0_64, CUPYFFN_WGMMA_D_64_128);
  }
}

// One k16 step of 16-bit operands (kOpF16E4M3: its fp16 part).
template <int OP, int BN, int TA, int TB>
__device__ __forceinline__ void wgmma_k16(float (&d)[BN / 2], unsigned long long desc_a, unsigned long long desc_b) {
  if constexpr (BN == 128) wgmma_m64n128k16<OP, TA, TB>(d, desc_a, desc_b);
  if constexpr (BN == 256) wgmma_m64n256k16<OP, TA, TB>(d, desc_a, desc_b);
}

// One k32 step of e4m3 operands (both K-major).
template <int BN>
__device__ __forceinline__ void wgmma_e4m3_k32(float (&d)[BN / 2], unsigned long long desc_a, unsigned long long desc_b) {
  if constexpr (BN == 128) {
    CUPYFFN_WGMMA_E4M3(128, CUPYFFN_WGMMA_REGS_0_64, "%64, %65, 1, 1, 1", CUPYFFN_WGMMA_D_0_64);
  } else {
    CUPYFFN_WGMMA_E4M3(256, CUPYFFN_WGMMA_REGS_0_64 ", " CUPYFFN_WGMMA_REGS_64_128, "%128, %129, 1, 1, 1",
                       CUPYFFN_WGMMA_D_0_64, CUPYFFN_WGMMA_D_64_128);
  }
}

// Bytes of a stage's fp32 B tile (BT = 2: the tile its 16-bit B is converted from; none otherwise).
__host__ __device__ constexpr int raw_bytes_for(int bn, int bt) { return bt == 2 ? bn * kBK * 4 : 0; }
// Bytes of one pipeline stage: the 16-bit A and B tiles, and with BT = 2 the fp32 B tile they are converted from.
__host__ __device__ constexpr int stage_bytes_for(int bn, int bt) { return (kBM + bn) * kBK * 2 + raw_bytes_for(bn, bt); }
// mbarriers per stage: full and empty, and with BT = 2 the fp32 tile's
__host__ __device__ constexpr int bars_for(int bt) { return bt == 2 ? 3 : 2; }

// Pipeline depth: as many stages as fit in 192 KiB of the 227 KiB of shared memory.
__host__ __device__ constexpr int stages_for(int bn, int bt = 0) { return (192 * 1024) / stage_bytes_for(bn, bt); }

// Shared memory a launch needs: the stages, 1 KiB of slack to align them to 1024 bytes, and the
// mbarriers (8 bytes each). cupyffn/_sm90_gemm.py computes the same number.
__host__ __device__ constexpr int smem_bytes_for(int bn, int bt = 0) {
  return stages_for(bn, bt) * stage_bytes_for(bn, bt) + 1024 + bars_for(bt) * 8 * stages_for(bn, bt);
}

// The staged dgelu epilogue (XS = 1): CUPYFFN_XS_STAGE_DROP pipeline stages fewer, and per consumer a
// ring of x/t slots. A slot holds one "group": a 64-row x kXtCols-column block of x and of t, each of the
// consumer's four warps owning the 16 rows of its accumulator fragment (a warp slot, kWarpSlotBytes).
// Stages and slots share 224 KiB; cupyffn/_sm90_gemm.py passes both macros and computes the same numbers.
#ifndef CUPYFFN_XT_COLS
#define CUPYFFN_XT_COLS 32
#endif
#ifndef CUPYFFN_XS_STAGE_DROP
#define CUPYFFN_XS_STAGE_DROP 1
#endif
constexpr int kXtCols = CUPYFFN_XT_COLS;          // columns of a group: whole 16-byte chunks of fp32
constexpr int kXtChunks = kXtCols / 4;            // 16-byte chunks per row of a warp slot
constexpr int kWarpSlotBytes = 2 * 16 * kXtCols * 4;  // x and t, 16 rows each
constexpr int kXtSlotBytes = 4 * kWarpSlotBytes;
static_assert(kXtCols == 8 || kXtCols == 16 || kXtCols == 32, "a group is 8, 16 or 32 columns (2-8 chunks per row)");
__host__ __device__ constexpr int xs_stages_for(int bn, int bt = 0) { return stages_for(bn, bt) - CUPYFFN_XS_STAGE_DROP; }
__host__ __device__ constexpr int xt_slots_for(int bn, int bt = 0) {
  return (224 * 1024 - xs_stages_for(bn, bt) * stage_bytes_for(bn, bt)) / (2 * kXtSlotBytes);
}
__host__ __device__ constexpr int xs_smem_bytes_for(int bn, int bt = 0) {
  return xs_stages_for(bn, bt) * stage_bytes_for(bn, bt) + 2 * xt_slots_for(bn, bt) * kXtSlotBytes + 1024 +
         bars_for(bt) * 8 * xs_stages_for(bn, bt);
}
static_assert(xs_smem_bytes_for(256) <= 232448 && xs_smem_bytes_for(128) <= 232448 && xs_smem_bytes_for(128, 2) <= 232448,
              "227 KiB of dynamic shared memory per CTA at most");
static_assert(xs_stages_for(256) >= 2 && xs_stages_for(128) >= 2 && xt_slots_for(256) >= 1 && xt_slots_for(128) >= 1 &&
              xs_stages_for(128, 2) >= 2 && xt_slots_for(128, 2) >= 1,
              "at least two stages and one slot");

// The dgelu epilogues' two scales: acc_scale multiplies the accumulator (GEMM1's alpha), out_scale the
// result before it is rounded to fp16 (1 for bf16). Read at each epilogue (L1 hits), not held in registers
// through the mainloop (the ping-pong variants have none to spare).
template <int EPI>
__device__ __forceinline__ void epilogue_scales(const GemmArgs& args, float& acc_scale, float& out_scale) {
  constexpr bool kF16 = EPI == kEpiDgeluF16 || EPI == kEpiDgeluF16G;
  acc_scale = args.acc_scale != nullptr ? *args.acc_scale : 1.0f;
  out_scale = kF16 ? (args.state != nullptr ? ldexpf(1.0f, args.state[args.slot]) : args.alpha) : 1.0f;
}

// kEpiDgeluF16G: the scale of the gelu_out codes.
__device__ __forceinline__ float gelu_scale(const GemmArgs& args) {
  return args.state != nullptr ? ldexpf(1.0f, args.state[args.g_slot]) : args.g_alpha;
}

// |v| for finite v, NaN for Inf and NaN (v * 0 + v: exact for finite v), so that one max, which ignores a NaN
// operand, leaves non-finite values out of amax: one instruction instead of a compare and a select.
// (asm: the compiler must not fold v * 0 + v to v; ftz: the same flush of subnormals as fmaxf)
__device__ __forceinline__ float finite_or_nan(float v) {
  float r;
  asm("fma.rn.ftz.f32 %0, %1, 0f00000000, %1;\n" : "=f"(r) : "f"(v));
  return fabsf(r);
}

// The two 16-bit codes of one pair of a one-plane dgelu epilogue, v0 in the low half.
template <int EPI>
__device__ __forceinline__ unsigned pair_codes(float v0, float v1, float out_scale) {
  if constexpr (EPI == kEpiDgeluBf16) {
    return cupyffn::pack2(cupyffn::bf16_bits(v0), cupyffn::bf16_bits(v1));  // the engine's dgelu rounding
  } else {
    return cupyffn::f16x2_bits(v0, v1, out_scale);  // the same rounding as f16_bits of each
  }
}

// Both dgelu epilogues: fold g = (v0, v1) into amax (finite values only; v1 only if `both`, nothing unless
// `both` or `one`), round (bf16, or fp16 after out_scale) and store the codes at p: a 4-byte pair if `both`,
// the 2-byte code of v0 if `one`. Selects and predicated stores, no branches: the staged epilogue's elements
// then form one straight-line block whose loads the compiler can issue ahead of earlier elements' stores (a
// branch around each element kept one element in flight per warp), and amax is one dependent max per pair.
template <int EPI>
__device__ __forceinline__ void store_dgelu_pair(unsigned short* p, int n, float v0, float v1, bool both, bool one,
                                                 float out_scale, float& amax) {
  const float m = fmaxf(finite_or_nan(v0), both ? finite_or_nan(v1) : 0.0f);
  amax = both || one ? fmaxf(amax, m) : amax;
  if constexpr (EPI == kEpiDgeluBf16x3) {
    unsigned short hi0, lo0, hi1, lo1;
    cupyffn::split_bf16(v0, hi0, lo0);  // the engine's conversion (common.cuh write_operand)
    cupyffn::split_bf16(v1, hi1, lo1);
    if (both) *reinterpret_cast<unsigned*>(p) = cupyffn::pack2(hi0, hi1);
    if (both) *reinterpret_cast<unsigned*>(p + n) = cupyffn::pack2(lo0, lo1);
    if (both) *reinterpret_cast<unsigned*>(p + 2 * n) = cupyffn::pack2(hi0, hi1);
    if (one) p[0] = hi0;
    if (one) p[n] = lo0;
    if (one) p[2 * n] = hi0;
    return;
  }
#if defined(CUPYFFN_SM90_TRACE) && CUPYFFN_SM90_EPI_PROBE == 1
  return;  // measurement only (tools/sm90_trace.py --probe 1): the epilogue without its global stores
#endif
  const unsigned codes = pair_codes<EPI>(v0, v1, out_scale);
  if (both) *reinterpret_cast<unsigned*>(p) = codes;
  if (one) p[0] = (unsigned short)codes;
}

// kEpiDgeluF16G's second output: gelu_out = 0.5 x (1 + t) of the pair (x0, t0), (x1, t1), written 0.5 * x * (1 + t)
// as the forward (and convert.cu's gelu_out_of) writes it, folded into gamax (finite values only), rounded to fp16
// after g_scale and stored at p as store_dgelu_pair stores (the same rounding and amax as convert.cu's FMT_F16S).
// Both values go into gamax unpredicated: an element outside the matrix has x = t = 0 (zero-filled slots, or the
// direct epilogue's zeros), so gelu_out = 0 there. (The 128 x 256 cooperative staged variant spills with this
// epilogue, 52 bytes, with or without the predicates: the launcher has no such variant, cupyffn/_sm90_gemm.py.)
__device__ __forceinline__ void store_gelu_pair(unsigned short* p, float x0, float t0, float x1, float t1, bool both,
                                                bool one, float g_scale, float& gamax) {
  const float g0 = cupyffn::gelu_of(x0, t0), g1 = cupyffn::gelu_of(x1, t1);
  gamax = fmaxf(gamax, fmaxf(finite_or_nan(g0), finite_or_nan(g1)));
  const unsigned codes = cupyffn::f16x2_bits(g0, g1, g_scale);
  if (both) *reinterpret_cast<unsigned*>(p) = codes;
  if (one) p[0] = (unsigned short)codes;
}

// The warp's maximum of `v`, folded into *dst by one atomicMax of lane 0 (non-negative floats order like their bits).
__device__ __forceinline__ void warp_amax_to(unsigned* dst, float v, int lane) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  if (lane == 0 && v > 0.0f) atomicMax(dst, __float_as_uint(v));
}

// Stores a consumer's 64 x BN block of the tile whose top-left output element is (row0, col0).
// wgmma's accumulator layout: thread `lane` of warp w holds, for each 8-column group j, columns
// 8j + 2(lane % 4) + {0, 1} of rows 16w + lane / 4 (d[4j], d[4j+1]) and 16w + lane / 4 + 8 (d[4j+2], d[4j+3]).
template <int EPI, int BN>
__device__ __forceinline__ void store_block(const float (&acc)[BN / 2], const GemmArgs& args, int row0, int col0,
                                            int tid) {
  const int warp = tid >> 5, lane = tid & 31;
  float amax = 0.0f, acc_scale = 1.0f, out_scale = 1.0f, gamax = 0.0f, g_scale = 1.0f;
  if constexpr (EPI == kEpiDgeluF16G) g_scale = gelu_scale(args);
  if constexpr (EPI != kEpiF32) {
    epilogue_scales<EPI>(args, acc_scale, out_scale);
  } else {  // fp32 out: the GEMM's alpha, from the device (the engine's consts) or the launch
    acc_scale = args.acc_scale != nullptr ? *args.acc_scale : args.alpha;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + 16 * warp + (lane >> 2) + 8 * h;
    if (r >= args.m) continue;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const int col = col0 + 8 * j + 2 * (lane & 3);
      if (col >= args.n) continue;
      const bool pair = col + 1 < args.n;  // col is even and leading dimensions are multiples of 8
      float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
      if constexpr (EPI == kEpiF32) {
        float* p = static_cast<float*>(args.c) + r * args.ldc + col;
        v0 *= acc_scale;
        v1 *= acc_scale;
        if (pair) {
          if (args.accumulate) {
            const float2 c = *reinterpret_cast<const float2*>(p);
            v0 += c.x;
            v1 += c.y;
          }
          *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
        } else {
          p[0] = args.accumulate ? v0 + p[0] : v0;
        }
      } else {
        const float* xp = args.x + r * args.ldx + col;
        const bool pairs = pair && args.xt_pairs;
        float x0, x1 = 0.0f, t0, t1;
        if (pairs) {
          const float2 xv = __ldcs(reinterpret_cast<const float2*>(xp));
          x0 = xv.x;
          x1 = xv.y;
        } else {
          x0 = __ldcs(xp);
          if (pair) x1 = __ldcs(xp + 1);
        }
        if (args.t != nullptr) {
          const float* tp = args.t + r * args.ldt + col;
          if (pairs) {
            const float2 tv = __ldcs(reinterpret_cast<const float2*>(tp));
            t0 = tv.x;
            t1 = tv.y;
          } else {
            t0 = __ldcs(tp);
            t1 = pair ? __ldcs(tp + 1) : 0.0f;
          }
        } else {
          t0 = cupyffn::tanh_inner_of(x0);
          t1 = cupyffn::tanh_inner_of(x1);
        }
        v0 = (acc_scale * v0) * cupyffn::gelu_grad(x0, t0);
        v1 = (acc_scale * v1) * cupyffn::gelu_grad(x1, t1);
        unsigned short* p = static_cast<unsigned short*>(args.c) + (r * args.ldc + col);
        store_dgelu_pair<EPI>(p, args.n, v0, v1, pair, !pair, out_scale, amax);
        if constexpr (EPI == kEpiDgeluF16G) {
          store_gelu_pair(args.g + (r * args.ldg + col), x0, t0, x1, t1, pair, !pair, g_scale, gamax);
        }
      }
    }
  }
  if constexpr (EPI != kEpiF32) {
    if (args.amax != nullptr) warp_amax_to(args.amax, amax, lane);  // uniform: every thread gets here
  }
  if constexpr (EPI == kEpiDgeluF16G) {
    if (args.g_amax != nullptr) warp_amax_to(args.g_amax, gamax, lane);
  }
}

// ---- staged x/t epilogue (XS = 1) ---------------------------------------------------------------
// x and t are read once: evict them from L2 first, so that they do not push out the A and B tiles the
// other CTAs are still reading. (volatile: made again at each use, one instruction, so that the 64-bit
// policy does not hold two registers through the epilogue: the ping-pong variants have none to spare)
__device__ __forceinline__ unsigned long long evict_first_policy() {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// 16-byte asynchronous copy global -> shared, bypassing L1; bytes < 16 (down to 0) reads only that many
// and zero-fills the rest, so a partial chunk or an out-of-bounds row reads nothing past the matrix.
// (An 8-byte fallback for rows off 16-byte boundaries cost the ping-pong variants 28 bytes of spills:
// the launcher takes the direct epilogue for those instead.)
__device__ __forceinline__ void cp_async_16(unsigned dst, const float* src, unsigned bytes, unsigned long long policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src), "r"(bytes),
               "l"(policy)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }


// A plain (not volatile, no memory clobber) shared load: the compiler may issue a group's loads together,
// ahead of the arithmetic and stores of earlier elements (one warp per scheduler runs an epilogue: nothing
// else hides a load's latency). What keeps it after the copies it reads have landed is its address, which
// comes out of slot_ready() below.
__device__ __forceinline__ float2 ld_shared_f2(unsigned addr) {
  float2 v;
  asm("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
  return v;
}

__device__ __forceinline__ float4 ld_shared_f4(unsigned addr) {
  float4 v;
  asm("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr));
  return v;
}

// Waits until at most N of this thread's cp.async groups are pending and the warp has synchronized (so every
// lane's copies of the oldest group have landed), then returns `addr`: routed through both asm statements, so
// that loads from the result cannot be scheduled before them.
template <int N>
__device__ __forceinline__ unsigned slot_ready(unsigned addr) {
  asm volatile("cp.async.wait_group %1;\n" : "+r"(addr) : "n"(N) : "memory");
  asm volatile("bar.warp.sync 0xffffffff;\n" : "+r"(addr) : : "memory");
  return addr;
}

// A warp slot: for x, then t, 16 rows of kXtCols floats (kXtChunks 16-byte chunks per row). The warp copies
// whole rows (a row's chunks are consecutive lanes: 64-128 contiguous bytes per row and request, where the
// accumulator layout would give 32), then each lane reads its fragment's pairs. Chunk c of row r sits at
// position c ^ swz(r): the 8 rows x 2 chunks one fragment read touches then fall on distinct 16-byte bank
// groups (2 wavefronts for 256 bytes, the minimum), and a copy's 32 chunks on distinct ones per 8.
__device__ __forceinline__ unsigned xt_offset(int tensor, int r, int chunk) {
  const int swz = (r * kXtChunks / 8) % kXtChunks;
  return (unsigned)(tensor * (16 * kXtCols * 4) + r * (kXtCols * 4) + ((chunk ^ swz) * 16));
}

// p, as a value the compiler cannot know before this point (a volatile asm stays in order with the cp.async
// waits and barriers around it), so that a refill's source addresses are formed when it is issued. LAUNDER is
// set for the 128 x 256 variants, where ptxas otherwise precomputes every refill's addresses at the start of
// the epilogue and runs out of registers for overlapping its elements (docs/decisions/037-refill-laundering.md); the
// ping-pong variants spill with it.
template <bool LAUNDER>
__device__ __forceinline__ const float* refill_source(const float* p) {
  if constexpr (LAUNDER) asm volatile("mov.b64 %0, %0;\n" : "+l"(p));
  return p;
}

// Requests into `slot` (the consumer's slot: its 4 warp slots) x and t of the warp's 16 rows from row_base +
// 16 warp and the columns col_base ... + kXtCols; the caller commits the cp.async group. Every row of x and
// t starts on a 16-byte boundary (the launcher checks).
template <bool LAUNDER>
__device__ __forceinline__ void stage_xt(unsigned slot, const GemmArgs& args, int row_base, int col_base, int tid) {
#if defined(CUPYFFN_SM90_TRACE) && CUPYFFN_SM90_EPI_PROBE == 2
  return;  // measurement only (tools/sm90_trace.py --probe 2): no x/t copies (the epilogue reads stale slots)
#endif
  const int warp = tid >> 5, lane = tid & 31;
  const unsigned base = slot + warp * kWarpSlotBytes;
  const unsigned long long policy = evict_first_policy();
#pragma unroll
  for (int i = 0; i < kXtChunks / 2; ++i) {  // 16 rows x kXtChunks chunks = 32 lanes x kXtChunks / 2
    const int q = lane + 32 * i;
    const int rr = q / kXtChunks, chunk = q % kXtChunks;
    const int r = row_base + 16 * warp + rr, col = col_base + 4 * chunk;
    const int left = args.n - col;  // columns of the chunk inside the matrix (may be <= 0)
    const unsigned bytes = r < args.m && left > 0 ? (left >= 4 ? 16u : 4u * left) : 0u;
    // nothing is read when bytes == 0; the address stays inside the matrix anyway
    // (32 x 32 -> 64-bit products: the launcher keeps row strides below 2^31)
    const int r_ok = bytes ? r : 0, c_ok = bytes ? col : 0;
#pragma unroll
    for (int tensor = 0; tensor < 2; ++tensor) {
      const float* src = refill_source<LAUNDER>(tensor ? args.t : args.x);
      if (src == nullptr) continue;  // memory mode: no t
      src += (long long)r_ok * (int)(tensor ? args.ldt : args.ldx) + c_ok;
      const unsigned dst = base + xt_offset(tensor, rr, chunk);
      cp_async_16(dst, src, bytes, policy);
    }
  }
}

// Group g of a consumer's block (HALVES x 64 rows x BN columns): half g / (BN / kXtCols), columns
// kXtCols * (g % (BN / kXtCols)).
template <int BN>
__device__ __forceinline__ void stage_group(unsigned slot, const GemmArgs& args, int row0, int col0, int g, int tid) {
  stage_xt<BN == 256>(slot, args, row0 + 64 * (g / (BN / kXtCols)), col0 + kXtCols * (g % (BN / kXtCols)), tid);
}

// The first SLOTS groups of a block (rows from row0, columns from col0), requested before its mainloop,
// one cp.async group each.
template <int BN, int SLOTS>
__device__ __forceinline__ void stage_xt_prologue(unsigned slots, const GemmArgs& args, int row0, int col0, int tid) {
#pragma unroll 1
  for (int g = 0; g < SLOTS; ++g) {
    stage_group<BN>(slots + g * kXtSlotBytes, args, row0, col0, g, tid);
    cp_async_commit();
  }
}

// The staged one-plane epilogues store C in whole row segments, as store_gelu_rows does, not in the accumulator's
// fragment layout (4-byte pairs 8 columns apart: 16 bytes per row and warp instruction). A warp's codes of one
// group (16 rows x kXtCols columns, 64 bytes per row) go through the x half of its slot once every lane has read
// x: code row r at r * 128 bytes (x's row), its 16-byte chunk c (8 columns) at (c ^ (r % 4)) * 16 + 64 * (r / 4 % 2),
// so that a fragment write (8 rows, one chunk) and a row read (8 rows x 4 chunks) fall on distinct bank groups.
__device__ __forceinline__ unsigned code_offset(int r, int chunk) {
  return (unsigned)(r * (kXtCols * 4) + 64 * ((r >> 2) & 1) + ((chunk ^ (r & 3)) * 16));
}

// Volatile, with memory clobbers: they stay in order with each other and with the warp barriers between them.
__device__ __forceinline__ void st_shared_u32(unsigned addr, unsigned v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint4 ld_shared_u4(unsigned addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}

// 8 consecutive 16-bit codes (w, the first in the low half of w.x) at p, columns col ... of a row of n: one 16-byte
// store if vec (a whole octet inside N, 16-byte aligned), else one code at a time up to N. The row-segment writers'
// common tail (store_code_rows, store_gelu_rows).
__device__ __forceinline__ void store_octet(unsigned short* p, uint4 w, int col, int n, bool vec) {
  if (vec) {
    __stcg(reinterpret_cast<uint4*>(p), w);
  } else {
    const unsigned c[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (col + i < n) p[i] = (unsigned short)(c[i / 2] >> (16 * (i % 2)));
    }
  }
}

// Lane l's two rows (l / 4 and l / 4 + 8 of the warp's 16, from row r_top - l / 4) of the codes a warp put into
// its slot (code_offset), 8 columns from c_group + 8 (l % 4): one 16-byte store per row (a whole octet inside N
// and ldc a multiple of 8), else one code at a time up to N.
__device__ __forceinline__ void store_code_rows(unsigned slot, const GemmArgs& args, int r_top, int c_group, int lane) {
  static_assert(kXtCols == 32, "4 lanes x 8 columns per row of a group");
#if defined(CUPYFFN_SM90_TRACE) && CUPYFFN_SM90_EPI_PROBE == 1
  return;  // measurement only (tools/sm90_trace.py --probe 1): the epilogue without its global stores
#endif
  const int oct = lane & 3, col = c_group + 8 * oct;
  const bool vec = (args.ldc & 7) == 0 && col + 8 <= args.n;
#pragma unroll 1  // one row at a time: unrolled, the ping-pong gelu_out variant spills
  for (int hh = 0; hh < 2; ++hh) {
    const int rr = (lane >> 2) + 8 * hh, row = r_top + 8 * hh;
    if (row >= args.m) continue;  // (before the read: every read's value feeds a store, see the slot's refill)
    const uint4 w = ld_shared_u4(slot + code_offset(rr, oct));
    // (32 x 32 -> 64-bit product: the launcher keeps row strides below 2^31)
    store_octet(static_cast<unsigned short*>(args.c) + ((long long)row * (int)args.ldc + col), w, col, args.n, vec);
  }
}

// kEpiDgeluF16G with t given, staged: gelu_out of a warp's group (16 rows x kXtCols columns from row r_top - lane / 4
// and column c_group) straight from its slot in whole row segments, independent of the accumulator layout: lane l
// takes rows l / 4 and l / 4 + 8 and the 8 columns 8 (l % 4) ..., so that each row gets one 16-byte store of 8 codes
// (4 lanes: 64 contiguous bytes per row), where the fragment layout gives 4-byte stores 8 columns apart (measured: the
// fragment-layout stores made this epilogue ~30% slower at T = 8192, docs/decisions/041-gelu-out-in-epilogue.md).
// Arithmetic, rounding and amax as store_gelu_pair; 16-byte stores need ldc a multiple of 8 and a whole octet inside
// N (else one code at a time). Reads only its own lanes' slot bytes, before the caller's __syncwarp and refill.
__device__ __forceinline__ void store_gelu_rows(unsigned slot, const GemmArgs& args, int r_top, int c_group, int lane,
                                                float g_scale, float& gamax) {
  static_assert(kXtCols == 32, "4 lanes x 8 columns per row of a group");
  const int oct = lane & 3;
  const int col = c_group + 8 * oct;
  const bool vec = (args.ldc & 7) == 0 && col + 8 <= args.n;
#pragma unroll 1  // one row at a time: unrolled, the ping-pong variant spills
  for (int hh = 0; hh < 2; ++hh) {
    const int rr = (lane >> 2) + 8 * hh, row = r_top + 8 * hh;
    unsigned codes[4];
#pragma unroll
    for (int q = 0; q < 2; ++q) {  // two 16-byte chunks of x and of t: 4 columns each
      const float4 x = ld_shared_f4(slot + xt_offset(0, rr, 2 * oct + q));
      const float4 t = ld_shared_f4(slot + xt_offset(1, rr, 2 * oct + q));
      const float g0 = cupyffn::gelu_of(x.x, t.x), g1 = cupyffn::gelu_of(x.y, t.y);
      const float g2 = cupyffn::gelu_of(x.z, t.z), g3 = cupyffn::gelu_of(x.w, t.w);
      // out of the matrix the slot holds zeros (zero-filled copies): gelu_out = 0 there, so no predicate
      gamax = fmaxf(gamax, fmaxf(fmaxf(finite_or_nan(g0), finite_or_nan(g1)), fmaxf(finite_or_nan(g2), finite_or_nan(g3))));
      codes[2 * q] = cupyffn::f16x2_bits(g0, g1, g_scale);
      codes[2 * q + 1] = cupyffn::f16x2_bits(g2, g3, g_scale);
    }
    if (row >= args.m) continue;
    // (32 x 32 -> 64-bit product: the launcher keeps row strides below 2^31)
    store_octet(args.g + ((long long)row * (int)args.ldc + col), make_uint4(codes[0], codes[1], codes[2], codes[3]), col,
                args.n, vec);
  }
}

// One 64-row half H (groups H * BN / kXtCols ...) of store_block_staged, folding into amax. (Register
// pressure of the 128-accumulator variants, at setmaxnreg's 232 per consumer thread, decided the shape of
// this code: one call per half, alpha read once, the prologue loop not unrolled.)
template <int EPI, int BN, int HALVES, int SLOTS, int H, bool HAS_T>
__device__ __forceinline__ void store_half_staged(const float (&acc)[BN / 2], const GemmArgs& args, int row0, int col0,
                                                  int tid, unsigned slots, float& amax, float& gamax) {
  constexpr int kGroupsPerHalf = BN / kXtCols;
  constexpr int kGroups = HALVES * kGroupsPerHalf;
  static_assert(EPI != kEpiF32 && SLOTS >= 1 && SLOTS <= kGroups, "staged: dgelu epilogues, 1..groups slots");
  const int warp = tid >> 5, lane = tid & 31;
  float acc_scale, out_scale;
  epilogue_scales<EPI>(args, acc_scale, out_scale);
  // This thread's two rows (hh = 0, 1) and first column: a pointer to that element of C and the columns
  // left from there (0 for a row past M), once per half, so that each element's store address is the
  // pointer plus a constant and its bounds one compare with a constant. (32 x 32 -> 64-bit product: the
  // launcher keeps row strides below 2^31; formed also past M, never dereferenced there.)
  const int cbase = col0 + 2 * (lane & 3);
  const int r_top = row0 + 64 * H + 16 * warp + (lane >> 2);
  unsigned short* const top_ptr = static_cast<unsigned short*>(args.c) + ((long long)r_top * (int)args.ldc + cbase);
  // kEpiDgeluF16G: gelu_out's codes have C's leading dimension (the launcher checks), so each one's address is
  // C's plus one distance, a kernel parameter (no register held for a second pointer through the half)
  const long long g_delta = EPI == kEpiDgeluF16G ? args.g - static_cast<unsigned short*>(args.c) : 0;
  const float g_scale = EPI == kEpiDgeluF16G ? gelu_scale(args) : 1.0f;
  const int left[2] = {r_top < args.m ? args.n - cbase : 0, r_top + 8 < args.m ? args.n - cbase : 0};
  // One plane, cooperative: C in row segments (store_code_rows). Measured against the fragment-layout stores
  // (docs/decisions/040-row-segment-stores.md): 0.93-0.97 for 128 x 256 at T = 2048-8192, but 1.01-1.03 for the
  // ping-pong variants, whose other consumer's mainloop hides their stores anyway.
  constexpr bool kRowStores = EPI != kEpiDgeluBf16x3 && HALVES == 1;
#pragma unroll
  for (int jg = 0; jg < kGroupsPerHalf; ++jg) {
    const int g = H * kGroupsPerHalf + jg;
    unsigned codes[kXtCols / 8][2];  // kRowStores: the group's codes, in the fragment layout
    // this lane's copies of group g (the oldest of the SLOTS in flight) landed, and every other lane's
    const unsigned slot = slot_ready<SLOTS - 1>(slots + (g % SLOTS) * kXtSlotBytes + warp * kWarpSlotBytes);
    // kEpiDgeluF16G, t given, with row stores: gelu_out first, while no codes are held (else after them, as measured)
    if constexpr (EPI == kEpiDgeluF16G && HAS_T && kRowStores) {
      store_gelu_rows(slot, args, r_top, col0 + jg * kXtCols, lane, g_scale, gamax);
    }
#pragma unroll
    for (int jj = 0; jj < kXtCols / 8; ++jj) {
      const int j = jg * (kXtCols / 8) + jj;  // the accumulator's 8-column group
      const int chunk = 2 * jj + ((lane & 3) >> 1);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int rr = (lane >> 2) + 8 * hh;
        const unsigned within = (lane & 1) * 8;
        const float2 xv = ld_shared_f2(slot + xt_offset(0, rr, chunk) + within);
        float t0, t1;
        if constexpr (HAS_T) {
          const float2 tv = ld_shared_f2(slot + xt_offset(1, rr, chunk) + within);
          t0 = tv.x;
          t1 = tv.y;
        } else {
          t0 = cupyffn::tanh_inner_of(xv.x);
          t1 = cupyffn::tanh_inner_of(xv.y);
        }
        const float v0 = (acc_scale * acc[4 * j + 2 * hh]) * cupyffn::gelu_grad(xv.x, t0);
        const float v1 = (acc_scale * acc[4 * j + 2 * hh + 1]) * cupyffn::gelu_grad(xv.y, t1);
        // columns 8j, 8j + 1 from cbase: both inside N, or only the first
        const bool both = left[hh] > 8 * j + 1, one = left[hh] == 8 * j + 1;
        if constexpr (kRowStores) {
          const float m = fmaxf(finite_or_nan(v0), both ? finite_or_nan(v1) : 0.0f);  // as store_dgelu_pair
          amax = both || one ? fmaxf(amax, m) : amax;
          codes[jj][hh] = pair_codes<EPI>(v0, v1, out_scale);
        } else {
          store_dgelu_pair<EPI>(top_ptr + (hh * 8 * (int)args.ldc + 8 * j), args.n, v0, v1, both, one, out_scale,
                                amax);
        }
        if constexpr (EPI == kEpiDgeluF16G && !HAS_T) {  // memory mode: t is at hand only here
          store_gelu_pair(top_ptr + (g_delta + hh * 8 * (int)args.ldc + 8 * j), xv.x, t0, xv.y, t1,
                          left[hh] > 8 * j + 1, left[hh] == 8 * j + 1, g_scale, gamax);
        }
        // Memory mode with 128 accumulators per thread: tanh_inner recomputed is ~20 instructions per element
        // with enough independent work in one pair; without this fence ptxas overlaps pairs until the 128 x 256
        // variant spills. (It costs those variants ~half their memory-mode speed; the engine runs memory mode
        // on the 64-accumulator 128 x 128 cooperative tile, choose_config.)
        if constexpr (!HAS_T && HALVES * BN / 2 >= 128) __syncwarp();
      }
    }
    if constexpr (kRowStores) {
      // every lane's codes formed (so its reads of x are done: the asm takes each code as an operand) before the
      // barrier after which the codes overwrite x; written, then read back in rows after a second barrier
#pragma unroll
      for (int jj = 0; jj < kXtCols / 8; ++jj) {
        asm volatile("" : "+r"(codes[jj][0]), "+r"(codes[jj][1]) : : "memory");
      }
      asm volatile("bar.warp.sync 0xffffffff;\n" ::: "memory");
#pragma unroll
      for (int jj = 0; jj < kXtCols / 8; ++jj) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          st_shared_u32(slot + code_offset((lane >> 2) + 8 * hh, jj) + 4 * (lane & 3), codes[jj][hh]);
        }
      }
      asm volatile("bar.warp.sync 0xffffffff;\n" ::: "memory");
      store_code_rows(slot, args, r_top, col0 + jg * kXtCols, lane);
    } else if constexpr (EPI == kEpiDgeluF16G && HAS_T) {
      store_gelu_rows(slot, args, r_top, col0 + jg * kXtCols, lane, g_scale, gamax);
    }
    // Refill the slot just read with group g + SLOTS, once every lane of the warp has read it: each loaded
    // value feeds a store or amax above (so its load has completed before they issue, and they stay before
    // this barrier); a copy lands only after it. An empty group keeps the count.
    __syncwarp();
    if (g + SLOTS < kGroups) stage_group<BN>(slots + (g % SLOTS) * kXtSlotBytes, args, row0, col0, g + SLOTS, tid);
    cp_async_commit();
  }
}

// The dgelu epilogue of a consumer's HALVES x 64 x BN block (rows from row0) with x and t from its ring
// of SLOTS slots; stage_xt_prologue of the same block must have been called (SLOTS groups pending).
// Same arithmetic, rounding and amax as store_block.
template <int EPI, int BN, int HALVES, int SLOTS>
__device__ __forceinline__ void store_block_staged(const float (&acc)[HALVES][BN / 2], const GemmArgs& args, int row0,
                                                   int col0, int tid, unsigned slots) {
  float amax = 0.0f, gamax = 0.0f;
  // tanh_inner given or not (memory mode) decided once, not per element: a branch per element splits the
  // epilogue into one small block per element (docs/decisions/035-no-branch-per-element.md)
  if (args.t != nullptr) {
    store_half_staged<EPI, BN, HALVES, SLOTS, 0, true>(acc[0], args, row0, col0, tid, slots, amax, gamax);
    if constexpr (HALVES == 2) {
      store_half_staged<EPI, BN, HALVES, SLOTS, 1, true>(acc[1], args, row0, col0, tid, slots, amax, gamax);
    }
  } else {
    store_half_staged<EPI, BN, HALVES, SLOTS, 0, false>(acc[0], args, row0, col0, tid, slots, amax, gamax);
    if constexpr (HALVES == 2) {
      store_half_staged<EPI, BN, HALVES, SLOTS, 1, false>(acc[1], args, row0, col0, tid, slots, amax, gamax);
    }
  }
  if (args.amax != nullptr) sm90::warp_amax_to(args.amax, amax, tid & 31);  // uniform: every thread gets here
  if constexpr (EPI == kEpiDgeluF16G) {
    if (args.g_amax != nullptr) sm90::warp_amax_to(args.g_amax, gamax, tid & 31);
  }
}

// ---- B converted in the kernel (BT = 2) -----------------------------------------------------------
__device__ __forceinline__ void st_shared_u4(unsigned addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// One step of convert_b_stage: rows r0 = 8 (pair / 4) + pair % 4 and r0 + 4 of one 128-column part.
struct ConvertStep {
  uint4 u0, u1;  // the 4 floats of each row at this lane's columns
  int r0;
  int part;
};

template <int BN>
__device__ __forceinline__ ConvertStep load_convert_step(unsigned raw, int step, int lane) {
  ConvertStep c;
  c.part = step >> 5;
  const int pair = step & 31;
  c.r0 = (pair >> 2) * 8 + (pair & 3);
  const unsigned col_bytes = (unsigned)(c.part * 128 + 4 * lane) * 4u;
  c.u0 = ld_shared_u4(raw + (unsigned)c.r0 * (BN * 4) + col_bytes);
  c.u1 = ld_shared_u4(raw + (unsigned)(c.r0 + 4) * (BN * 4) + col_bytes);
  return c;
}

__device__ __forceinline__ void store_convert_step(const ConvertStep& c, unsigned dst, int lane, float scale,
                                                   float& amax) {
  const bool odd = lane & 1;
  const float v[8] = {__uint_as_float(c.u0.x), __uint_as_float(c.u0.y), __uint_as_float(c.u0.z), __uint_as_float(c.u0.w),
                      __uint_as_float(c.u1.x), __uint_as_float(c.u1.y), __uint_as_float(c.u1.z), __uint_as_float(c.u1.w)};
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, finite_or_nan(v[i]));  // finite_absmax in two instructions
  const unsigned a0 = cupyffn::f16x2_bits(v[0], v[1], scale), a1 = cupyffn::f16x2_bits(v[2], v[3], scale);
  const unsigned b0 = cupyffn::f16x2_bits(v[4], v[5], scale), b1 = cupyffn::f16x2_bits(v[6], v[7], scale);
  // even lane 2m keeps row r0 (its columns 8m ..., then its neighbour's 8m + 4 ...), odd lane 2m + 1 row r0 + 4
  const unsigned q0 = __shfl_xor_sync(0xffffffffu, odd ? a0 : b0, 1);
  const unsigned q1 = __shfl_xor_sync(0xffffffffu, odd ? a1 : b1, 1);
  const uint4 w = odd ? make_uint4(q0, q1, b0, b1) : make_uint4(a0, a1, q0, q1);
  const int r = odd ? c.r0 + 4 : c.r0;
  const int j = c.part * 16 + (lane >> 1);  // the 8-column chunk of the tile's row
  st_shared_u4(dst + (unsigned)((j >> 3) * 8192 + r * 128 + (((j & 7) ^ (r & 7)) << 4)), w);
}

// The fp32 B tile of a stage (64 K-rows x BN N-elements, row-major: TMA lands it unswizzled) into the fp16 tile
// that BT = 1 gets from TMA (BN / 64 boxes of 64 K-rows x 128 bytes, 128-byte swizzled: 16-byte chunk c of row r
// at chunk c ^ (r % 8)), by converter warp cw (of 3). Per step a warp converts rows r and r + 4 of 128 columns:
// lane l reads 4 floats of each (columns 4 l ...: a warp reads 512 contiguous bytes per row, no bank conflict),
// rounds them as convert.cu does (fp16(b * scale), f16x2_bits), and trades one row's codes with lane l ^ 1, so
// that it holds 8 consecutive codes of one row: one 16-byte store. (Rows r and r + 4: in each quarter-warp the
// 8 stores then fall on 8 distinct 16-byte bank groups, since c ^ r and c ^ (r + 4) differ in bit 2.) Three
// steps at a time, all loaded first: the later ones' loads are in flight while the first is converted. (Run with
// setmaxnreg 56 for the producer warpgroup: at 40 any unrolling spills, and one step at a time measured ~470 cycles
// per step, 3.5x slower than the converted-weight GEMM; docs/decisions/043-kn32-weights-converted-in-gemm.md.)
template <int BN>
__device__ __forceinline__ void convert_b_stage(unsigned raw, unsigned dst, int cw, int lane, float scale,
                                                float& amax) {
  constexpr int kSteps = 32 * (BN / 128);  // (row pair, 128-column part) steps of a stage
#pragma unroll 1
  for (int step = cw; step < kSteps; step += 9) {
    const bool second = step + 3 < kSteps, third = step + 6 < kSteps;  // uniform across the warp
    const ConvertStep s0 = load_convert_step<BN>(raw, step, lane);
    const ConvertStep s1 = load_convert_step<BN>(raw, second ? step + 3 : step, lane);
    const ConvertStep s2 = load_convert_step<BN>(raw, third ? step + 6 : step, lane);
    store_convert_step(s0, dst, lane, scale, amax);
    if (second) store_convert_step(s1, dst, lane, scale, amax);
    if (third) store_convert_step(s2, dst, lane, scale, amax);
  }
}

// Makes this thread's generic-proxy accesses to shared memory (the converted tile, and its reads of the fp32 tile
// that TMA overwrites next) ordered with the async proxy's (wgmma reads, TMA writes).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The tile group (cluster-sized stack of vertically adjacent tiles) at position `group` of the walk:
// raster = 0 goes down each column (M fastest, then N); raster = R > 0 cuts the rows into bands of R and
// walks each band column by column, so that the CTAs running at one time touch R rows' worth of A and a
// few columns' worth of B (a smaller L2 working set than all of A). Producer and consumers call it alike.
__device__ __forceinline__ void group_coords(int group, int m_groups, int n_tiles, int raster, int& mg, int& nb) {
  if (raster <= 0 || raster >= m_groups) {
    mg = group % m_groups;
    nb = group / m_groups;
    return;
  }
  const int per_band = raster * n_tiles;
  const int band = group / per_band, within = group - band * per_band;
  const int rows = min(raster, m_groups - band * raster);  // the last band may be shorter
  mg = band * raster + within % rows;
  nb = within / rows;
}

// ---- the dgelu epilogue in warps of its own (XS = 2) --------------------------------------------
// The consumers hand each finished 128 x 128 accumulator tile to shared memory (fp32, 64 KiB) and go on with the
// next tile's mainloop at once; seven epilogue warps (warps 1-3 of the producer warpgroup, idle otherwise, and a
// fourth warpgroup: 512 threads) run the dgelu epilogue from there, streaming x and t through rings of their own.
// So the epilogue's DRAM traffic and instructions overlap the next tile's MMAs instead of following them. A tile's
// rows go to the warps in pairs (pair p to warp p % 7): lane l takes columns 4l ... 4l + 3 of both rows, so every
// load and store of a warp is one whole 512-byte (x, t, accumulator) or 256-byte (codes) row segment. Handshake, one
// mbarrier each way: acc_full (the 256 consumer threads arrive once their accumulators are in shared memory),
// acc_empty (the epilogue threads arrive once they have read theirs). Arithmetic, rounding and amax are those of the
// staged epilogue (bit for bit the same outputs).
#ifndef CUPYFFN_EW_STAGES
#define CUPYFFN_EW_STAGES 4
#endif
#ifndef CUPYFFN_EW_RING
#define CUPYFFN_EW_RING 2
#endif
constexpr int kEwThreads = 512;                // kThreads + the epilogue warpgroup
constexpr int kEwStages = CUPYFFN_EW_STAGES;   // pipeline stages (32 KiB each at BN = 128)
constexpr int kEwWarps = 7;                    // warps 1-3 of the producer warpgroup, the 4 of warpgroup 3
constexpr int kEwRing = CUPYFFN_EW_RING;       // x/t items in flight per epilogue warp
constexpr int kEwItemBytes = 2 * 2 * 128 * 4;  // an item: x and t of two 128-column rows (2 KiB)
constexpr int kEwAccBytes = kBM * 128 * 4;     // the fp32 accumulator tile (64 KiB)
constexpr int kEwRingBytes = kEwWarps * kEwRing * kEwItemBytes;
__host__ __device__ constexpr int ew_smem_bytes_for() {
  return kEwStages * stage_bytes_for(128, 0) + kEwAccBytes + kEwRingBytes + 1024 + 8 * (2 * kEwStages + 2);
}
static_assert(ew_smem_bytes_for() <= 232448, "227 KiB of dynamic shared memory per CTA at most");

// Byte offset of 16-byte chunk c (columns 4c ... 4c + 3) of row r in the accumulator tile: rows of 512 bytes, chunks
// XOR-swizzled by r % 8, so that a consumer's fragment store (8 rows x 2 chunks) takes the minimum 2 wavefronts and
// an epilogue warp's row read (32 chunks) the minimum 4.
__device__ __forceinline__ unsigned ew_acc_offset(int r, int c) { return (unsigned)(r * 512 + ((c ^ (r & 7)) * 16)); }

// A consumer thread's 64 accumulators (64 x 128 block of consumer `consumer`, wgmma's fragment layout) into the tile.
__device__ __forceinline__ void ew_store_acc(const float (&acc)[64], unsigned acc_smem, int consumer, int tid) {
  const int warp = tid >> 5, lane = tid & 31;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 64 * consumer + 16 * warp + (lane >> 2) + 8 * hh;
      const unsigned addr = acc_smem + ew_acc_offset(r, 2 * j + ((lane & 3) >> 1)) + (lane & 1) * 8;
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(acc[4 * j + 2 * hh]),
                   "f"(acc[4 * j + 2 * hh + 1])
                   : "memory");
    }
  }
}

// Where an epilogue warp's walk is: tile `group` of the CTA's sequence (at tile row mg, column nb) and its row pair;
// the pairs of a warp are ew, ew + 7, ... of each tile, the tiles those of the CTA.
// With clusters of CL CTAs the walk is the cluster's (groups of CL vertically adjacent tiles), this CTA's tile of
// each group the one at its rank, as the consumers walk it.
struct EwCursor {
  int group, pair, mb, nb;
};

template <int CL>
__device__ __forceinline__ void ew_locate(EwCursor& c, const GemmArgs& args, int groups, int m_groups, int n_tiles) {
  if (c.group < groups) {
    int mg;
    group_coords(c.group, m_groups, n_tiles, args.raster, mg, c.nb);
    c.mb = CL * mg + (CL > 1 ? (int)cluster_rank() : 0);
  }
}

template <int CL>
__device__ __forceinline__ void ew_advance(EwCursor& c, const GemmArgs& args, int groups, int m_groups, int n_tiles,
                                           int ew) {
  c.pair += kEwWarps;
  if (c.pair >= kBM / 2) {  // the next tile: its coordinates once per tile, not per item
    c.pair = ew;
    c.group += gridDim.x / CL;
    ew_locate<CL>(c, args, groups, m_groups, n_tiles);
  }
}

// Requests the item at c into `slot` (x and t of its two rows, this lane's 16-byte chunk of each) and commits one
// cp.async group; past the CTA's last tile it commits an empty group (the count stays one per item).
template <bool HAS_T>
__device__ __forceinline__ void ew_request(unsigned slot, const GemmArgs& args, const EwCursor& c, int groups,
                                           int lane) {
  bool live = c.group < groups;
#if defined(CUPYFFN_SM90_TRACE) && CUPYFFN_SM90_EPI_PROBE == 2
  live = false;  // measurement only (probe 2): no x/t copies (the epilogue reads stale slots)
#endif
  if (live) {
    const unsigned long long policy = evict_first_policy();
    const int col = c.nb * 128 + 4 * lane, left = args.n - col;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int r = c.mb * kBM + 2 * c.pair + q;
      const unsigned bytes = r < args.m && left > 0 ? (left >= 4 ? 16u : 4u * left) : 0u;
      // nothing is read when bytes == 0; the address stays inside the matrix anyway (row strides < 2^31)
      const int r_ok = bytes ? r : 0, c_ok = bytes ? col : 0;
      cp_async_16(slot + (2 * q) * 512 + lane * 16, args.x + ((long long)r_ok * (int)args.ldx + c_ok), bytes, policy);
      if constexpr (HAS_T) {
        cp_async_16(slot + (2 * q + 1) * 512 + lane * 16, args.t + ((long long)r_ok * (int)args.ldt + c_ok), bytes,
                    policy);
      }
    }
  }
  cp_async_commit();
}

// 4 consecutive 16-bit codes (c0: the first two) at p, columns col ... of a row with `left` columns from col on: one
// 8-byte store if vec (all four inside N, 8-byte aligned), else one code at a time up to N.
__device__ __forceinline__ void ew_store_quad(unsigned short* p, unsigned c0, unsigned c1, int left, bool vec) {
#if defined(CUPYFFN_SM90_TRACE) && CUPYFFN_SM90_EPI_PROBE == 1
  return;  // measurement only (probe 1): no global stores
#endif
  if (vec) {
    __stcg(reinterpret_cast<uint2*>(p), make_uint2(c0, c1));
  } else {
    const unsigned c[2] = {c0, c1};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (i < left) p[i] = (unsigned short)(c[i / 2] >> (16 * (i % 2)));
    }
  }
}

// Epilogue warp ew (0-6) of the CTA: every tile of the CTA's walk, from the accumulator tile the consumers hand over.
// Elements outside the matrix: their accumulators are zeros (TMA zero-fills A and B) and so are x and t (zero-filled
// copies), so g = 0 and gelu_out = 0 there and amax needs no predicate; only the stores are bounded.
template <int EPI, bool HAS_T, int CL>
__device__ __forceinline__ void ew_epilogue(const GemmArgs& args, unsigned acc_smem, unsigned ring, unsigned acc_full,
                                            unsigned acc_empty, int groups, int m_groups, int n_tiles, int ew,
                                            int lane) {
  static_assert(EPI == kEpiDgeluF16 || EPI == kEpiDgeluF16G || EPI == kEpiDgeluBf16, "one-plane dgelu epilogues");
  const unsigned my_ring = ring + ew * (kEwRing * kEwItemBytes);
  EwCursor rq{(int)blockIdx.x / CL, ew, 0, 0};  // the next item to request
  ew_locate<CL>(rq, args, groups, m_groups, n_tiles);
#pragma unroll 1
  for (int i = 0; i < kEwRing; ++i) {
    ew_request<HAS_T>(my_ring + i * kEwItemBytes, args, rq, groups, lane);
    ew_advance<CL>(rq, args, groups, m_groups, n_tiles, ew);
  }
  unsigned slot_index = 0;
  int local = 0;
#pragma unroll 1
  for (int group = blockIdx.x / CL; group < groups; group += gridDim.x / CL, ++local) {
    int mg, nb;
    group_coords(group, m_groups, n_tiles, args.raster, mg, nb);
    const int mb = CL * mg + (CL > 1 ? (int)cluster_rank() : 0);
    float acc_scale, out_scale;
    epilogue_scales<EPI>(args, acc_scale, out_scale);
    const float g_scale = EPI == kEpiDgeluF16G ? gelu_scale(args) : 1.0f;
    const int col = nb * 128 + 4 * lane, left = args.n - col;
    const bool vec = (args.ldc & 3) == 0 && left >= 4;
    // this lane's element (row 2 pair, column col) of C; gelu_out's has the same offset from g (ldg == ldc)
    unsigned short* c_ptr = static_cast<unsigned short*>(args.c) + ((long long)(mb * kBM + 2 * ew) * (int)args.ldc + col);
    const long long g_delta = EPI == kEpiDgeluF16G ? args.g - static_cast<unsigned short*>(args.c) : 0;
    int row = mb * kBM + 2 * ew;
    float amax = 0.0f, gamax = 0.0f;
    unsigned tile = acc_smem;
    mbar_wait(acc_full, (unsigned)local & 1u);
    asm volatile("mov.b32 %0, %0;\n" : "+r"(tile) : : "memory");  // the tile's reads stay after the wait
#pragma unroll 1
    for (int pair = ew; pair < kBM / 2; pair += kEwWarps) {
      unsigned slot = my_ring + slot_index * kEwItemBytes;
      slot_index = slot_index + 1 == kEwRing ? 0 : slot_index + 1;
      // this lane's copies of the item have landed (it reads only its own chunks: no warp barrier)
      asm volatile("cp.async.wait_group %1;\n" : "+r"(slot) : "n"(kEwRing - 1) : "memory");
      unsigned codes[2][2], gcodes[2][2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int r = 2 * pair + q;
        const float4 a = ld_shared_f4(tile + ew_acc_offset(r, lane));
        const float4 x = ld_shared_f4(slot + (2 * q) * 512 + lane * 16);
        float4 t;
        if constexpr (HAS_T) {
          t = ld_shared_f4(slot + (2 * q + 1) * 512 + lane * 16);
        } else {
          t = make_float4(cupyffn::tanh_inner_of(x.x), cupyffn::tanh_inner_of(x.y), cupyffn::tanh_inner_of(x.z),
                          cupyffn::tanh_inner_of(x.w));
        }
        const float v0 = (acc_scale * a.x) * cupyffn::gelu_grad(x.x, t.x);
        const float v1 = (acc_scale * a.y) * cupyffn::gelu_grad(x.y, t.y);
        const float v2 = (acc_scale * a.z) * cupyffn::gelu_grad(x.z, t.z);
        const float v3 = (acc_scale * a.w) * cupyffn::gelu_grad(x.w, t.w);
        amax = fmaxf(amax, fmaxf(fmaxf(finite_or_nan(v0), finite_or_nan(v1)), fmaxf(finite_or_nan(v2), finite_or_nan(v3))));
        codes[q][0] = pair_codes<EPI>(v0, v1, out_scale);
        codes[q][1] = pair_codes<EPI>(v2, v3, out_scale);
        if constexpr (EPI == kEpiDgeluF16G) {
          const float g0 = cupyffn::gelu_of(x.x, t.x), g1 = cupyffn::gelu_of(x.y, t.y);
          const float g2 = cupyffn::gelu_of(x.z, t.z), g3 = cupyffn::gelu_of(x.w, t.w);
          gamax = fmaxf(gamax, fmaxf(fmaxf(finite_or_nan(g0), finite_or_nan(g1)), fmaxf(finite_or_nan(g2), finite_or_nan(g3))));
          gcodes[q][0] = cupyffn::f16x2_bits(g0, g1, g_scale);
          gcodes[q][1] = cupyffn::f16x2_bits(g2, g3, g_scale);
        } else {
          gcodes[q][0] = gcodes[q][1] = 0u;
        }
      }
      // every value read from the slot and the tile is consumed (the codes are operands here) before the slot is
      // refilled and, after the tile's last pair, before the tile is released to the consumers
      asm volatile("" : "+r"(codes[0][0]), "+r"(codes[0][1]), "+r"(codes[1][0]), "+r"(codes[1][1]),
                   "+r"(gcodes[0][0]), "+r"(gcodes[0][1]), "+r"(gcodes[1][0]), "+r"(gcodes[1][1])
                   : : "memory");
      if (pair + kEwWarps >= kBM / 2) mbar_arrive(acc_empty);
      ew_request<HAS_T>(slot, args, rq, groups, lane);
      ew_advance<CL>(rq, args, groups, m_groups, n_tiles, ew);
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        // (32 x 32 -> 64-bit products: the launcher keeps row strides below 2^31)
        unsigned short* const p = c_ptr + q * (int)args.ldc;
        if (row + q < args.m) {
          ew_store_quad(p, codes[q][0], codes[q][1], left, vec);
          if constexpr (EPI == kEpiDgeluF16G) ew_store_quad(p + g_delta, gcodes[q][0], gcodes[q][1], left, vec);
        }
      }
      c_ptr += 2 * kEwWarps * (int)args.ldc;
      row += 2 * kEwWarps;
    }
    if (args.amax != nullptr) warp_amax_to(args.amax, amax, lane);
    if constexpr (EPI == kEpiDgeluF16G) {
      if (args.g_amax != nullptr) warp_amax_to(args.g_amax, gamax, lane);
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // (the requests past the last tile are empty groups)
}

// Epilogue warp ew: tanh_inner given or recomputed (memory mode), decided once.
template <int EPI, int CL>
__device__ __forceinline__ void ew_run(const GemmArgs& args, unsigned xt_smem, unsigned acc_full, unsigned acc_empty,
                                       int groups, int m_groups, int n_tiles, int ew) {
  if constexpr (EPI == kEpiDgeluF16 || EPI == kEpiDgeluF16G || EPI == kEpiDgeluBf16) {
    const unsigned ring = xt_smem + kEwAccBytes;
    if (args.t != nullptr) {
      ew_epilogue<EPI, true, CL>(args, xt_smem, ring, acc_full, acc_empty, groups, m_groups, n_tiles, ew, threadIdx.x & 31);
    } else {
      ew_epilogue<EPI, false, CL>(args, xt_smem, ring, acc_full, acc_empty, groups, m_groups, n_tiles, ew, threadIdx.x & 31);
    }
  }
}

// Measurement only (tools/sm90_trace.py compiles with CUPYFFN_SM90_TRACE): per consumer and tile, the global
// timer when the tile's loop iteration starts, when the consumer has its turn on the tensor cores (ping-pong),
// when its mainloop has finished and when its epilogue has. The launcher never defines the macro.
#ifdef CUPYFFN_SM90_TRACE
constexpr int kTraceTiles = 64;  // per consumer and CTA; later tiles are not recorded
extern "C" {  // unmangled: the tool sets it by name
__device__ unsigned long long* cupyffn_sm90_trace;
}
__device__ __forceinline__ void trace_stamp(int consumer, int local, int what, int tid) {
  if (tid == 0 && local < kTraceTiles && cupyffn_sm90_trace != nullptr) {
    cupyffn_sm90_trace[((blockIdx.x * 2 + consumer) * kTraceTiles + local) * 4 + what] = global_ns();
  }
}
#define CUPYFFN_TRACE(what) sm90::trace_stamp(consumer, local, what, tid)
#else
#define CUPYFFN_TRACE(what) ((void)0)
#endif

__device__ __forceinline__ unsigned dynamic_smem_size() {
  unsigned bytes;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(bytes));
  return bytes;
}

}  // namespace sm90

// PP = 0 ("cooperative"): both consumers work on one 128 x BN tile, 64 rows each.
// PP = 1 ("ping-pong", BN = 128 only): each consumer owns whole 128 x 128 tiles, the two taking turns
// along the CTA's tile sequence; the stages arrive in tile order, so one consumer's epilogue runs
// while the other one's mainloop keeps the tensor cores busy. The mainloops take turns too: a
// consumer starts waiting on the stages of its tile only once the other one has passed all the
// stages of the tile before (named barrier 1 + consumer). Without that, a consumer skipping the
// other's k_tiles stages would wait on a full barrier up to k_tiles / kStages phases ahead, where
// the parity wait cannot tell its phase from an earlier one (wrong data, then a deadlock, whenever
// K > (kStages - 1) * 64 and a CTA has more than one tile).
//
// XS = 1: the staged dgelu epilogue (see the top of the file); XS = 0: x and t straight from global memory.
// BT = 1: B is [K, N] (N contiguous), see the top of the file.
// BT = 2 (fp16 only, no clusters): B is fp32 [K, N] (a weight as the caller holds it), converted in the kernel: TMA
// lands each stage's fp32 tile in a ring of its own (raw_full barrier), warps 1-3 of the producer warpgroup convert
// it into the fp16 tile BT = 1 reads (convert_b_stage) and arrive on the stage's full barrier with the TMA of A, so
// the weight's fp16 copy is never written to global memory. A stage's fp32 tile is free again when the stage is.
//
// CL = 2 (gemm_sm90_cluster2_kernel): clusters of two CTAs on vertically adjacent tiles (rows mb, mb + 1 of
// tiles, the same column nb) share the B tile: each CTA loads its A tile and one half of B, multicast to both,
// so L2 delivers 3/4 (BN = 128) or 2/3 (BN = 256) of the bytes per FLOP. Each CTA's full barrier counts the
// bytes of both halves; a stage is free again only when the consumers of both CTAs are done with it, so each
// consumer warp arrives on the empty barrier of both. The two CTAs walk the same sequence of tile pairs
// (one k-step sequence), the second one's tile past M when the tile rows are odd (TMA zero-fills it, the
// epilogue stores nothing), and neither leaves before the other (cluster_sync): a peer may still deliver
// into its shared memory or arrive on its barriers.
//
// OP = kOpF16E4M3 (gemm_sm90_pair_kernel, the fp16+fp8 plan's f16+e4m3 form in one kernel): each tile first
// runs k8 / 128 stages of e4m3 operands (map_a8, map_b8: [M, k8] and [N, k8] bytes, K-major, the cross terms'
// pairs of kernels_cu/split_e4m3.cu) into the accumulator, multiplies it by pair_scale (a power of two: exact),
// then runs the fp16 stages of A and B on top. An e4m3 stage (128 x 128 and BN x 128 bytes) has the bytes and
// the swizzle of an fp16 one, so the pipeline is the same; the cross terms come first because Hopper's e4m3 MMA
// keeps only ~14 bits of its sum (docs/decisions/024-sm90-pair-kernel-gemm1.md): it only ever adds the small terms to
// each other, and the fp16 MMAs add the large ones on top, as the cuBLAS pair does (its e4m3 GEMM writes C, the fp16
// one adds to it).
// TA = 1: A is [K, M] (M contiguous: grad_output / grad_linear1 as stored, for the weight gradients), loaded
// and read MN-major as BT's B (16-bit operands only).
template <int OP, int BN, int EPI, int PP, int XS, int BT, int CL, int TA = 0>
__device__ __forceinline__ void gemm_sm90_body(const sm90::TmaDesc& map_a, const sm90::TmaDesc& map_b,
                                               const sm90::TmaDesc& map_a8, const sm90::TmaDesc& map_b8,
                                               const sm90::GemmArgs& args) {
  using namespace sm90;
  static_assert(CL == 1 || CL == 2, "clusters of one or two CTAs");
  static_assert(OP != kOpF16E4M3 || (EPI == kEpiF32 && CL == 1), "the pair: fp32 out, no clusters");
  constexpr bool kPair = OP == kOpF16E4M3;
  static_assert(PP == 0 || BN == 128, "ping-pong keeps a whole 128 x BN tile per warpgroup: BN = 128 only");
  static_assert(XS == 0 || EPI != kEpiF32, "the staged epilogue is a dgelu epilogue");
  static_assert(XS != 2 || (BN == 128 && PP == 0 && BT != 2 && !kPair && EPI != kEpiDgeluBf16x3),
                "the epilogue warps: cooperative 128 x 128 tiles, 16-bit B, one-plane dgelu");
  static_assert(BT != 2 || (OP == kOpF16 && CL == 1 && TA == 0), "B converted in the kernel: fp16, no clusters");
#if defined(CUPYFFN_SM90_TRACE) && CUPYFFN_SM90_EPI_PROBE == 6
  // probe 6 (timing only): the 16-bit layouts' 128 x 128 tiles with kn32's pipeline depth (the launch's shared
  // memory is then more than the layout needs)
  constexpr int kDepthBT = BN == 128 ? 2 : BT;
#else
  constexpr int kDepthBT = BT;
#endif
  constexpr int kStages = XS == 2 ? kEwStages : XS ? xs_stages_for(BN, kDepthBT) : stages_for(BN, kDepthBT);
  constexpr int kHalves = PP ? 2 : 1;  // 64-row halves of a tile that one consumer computes
  constexpr int kXtSlots = XS == 1 ? xt_slots_for(BN, BT) : 0;  // per consumer
  // XS = 2: the accumulator tile and the epilogue warps' rings take the slots' place
  constexpr unsigned kXtBytes = XS == 2 ? kEwAccBytes + kEwRingBytes : 2 * kXtSlots * kXtSlotBytes;
  constexpr unsigned kSmemBytes = XS == 2 ? ew_smem_bytes_for() : XS ? xs_smem_bytes_for(BN, BT) : smem_bytes_for(BN, BT);
  constexpr unsigned kABytes = kBM * kBK * 2;
  constexpr unsigned kBBytes = BN * kBK * 2;
  constexpr unsigned kRawBytes = raw_bytes_for(BN, BT);  // the fp32 tile of B a stage is converted from
  constexpr int kConverters = BT == 2 ? 3 : 0;                // warps 1-3 of the producer warpgroup
  // setmaxnreg per thread: 40 for the producer warpgroup, 232 for the consumers; BT = 2 gives the converter warps'
  // loop 56 and keeps 224 for the consumers (128 x 56 + 256 x 224 <= 64 K)
  constexpr unsigned kProducerRegs = BT == 2 ? 56 : 40, kConsumerRegs = BT == 2 ? 224 : 232;
  extern __shared__ unsigned char smem_raw[];
  const unsigned raw = smem_addr(smem_raw);
  const unsigned a_smem = (raw + 1023u) & ~1023u;  // 128-byte swizzle atoms sit on 1024-byte boundaries
  const unsigned b_smem = a_smem + kStages * kABytes;
  const unsigned b32_smem = b_smem + kStages * kBBytes;  // BT = 2: stage s's fp32 tile at b32_smem + s * kRawBytes
  const unsigned xt_smem = b32_smem + kStages * kRawBytes;  // consumer c's slots: xt_smem + c * kXtSlots * slot bytes
  const unsigned full_bar = xt_smem + kXtBytes;  // stage s: full_bar + 8 s; empty: empty_bar + 8 s
  const unsigned empty_bar = full_bar + 8 * kStages;
  const unsigned b32_bar = empty_bar + 8 * kStages;  // BT = 2: stage s's fp32 tile landed (b32_bar + 8 s)
  const unsigned acc_full = empty_bar + 8 * kStages, acc_empty = acc_full + 8;  // XS = 2 (no BT = 2 there)

  const int m_tiles = (args.m + kBM - 1) / kBM;
  const int n_tiles = (args.n + BN - 1) / BN;
  // the cluster walks groups of CL vertically adjacent tiles (group = column nb, tile rows CL * mg ...)
  const int m_groups = (m_tiles + CL - 1) / CL;
  const int groups = m_groups * n_tiles;
  const int cluster = blockIdx.x / CL, clusters = gridDim.x / CL;
  const unsigned rank = CL > 1 ? cluster_rank() : 0u;
  const int k8_tiles = kPair ? (args.k8 + 2 * kBK - 1) / (2 * kBK) : 0;  // e4m3 stages: 128 bytes of K each
  const int k_tiles = k8_tiles + (args.k + kBK - 1) / kBK;             // every stage of a tile
  const int wg = threadIdx.x >> 7;

  if (EPI != kEpiF32 && args.state != nullptr && args.rescue) {
    // The rescue launch (as dgelu.cu's): block 0 writes the alphas of the GEMMs that read this output; the
    // whole launch runs only if the decision after the gathering launch moved this output's exponent.
    cupyffn::write_alphas(args.state, args.consts, args.alpha_mask);
    // kEpiDgeluF16G writes two outputs: rerun if either exponent moved (the other's codes come out the same)
    const bool again = args.state[2 * kSlots + args.slot] != 0 ||
                       (EPI == kEpiDgeluF16G && args.state[2 * kSlots + args.g_slot] != 0) ||
                       (BT == 2 && args.b_slot >= 0 && args.state[2 * kSlots + args.b_slot] != 0);
    if (!again) return;  // uniform across the grid, before any barrier
  }
  if (threadIdx.x == 0) {
    // a launch with less shared memory than this variant's layout would write past it: fail loudly
    if (dynamic_smem_size() < kSmemBytes) __trap();
    for (int s = 0; s < kStages; ++s) {
      // the producer's arrive_expect_tx (+ the TMA bytes), and with BT = 2 one arrival per converter warp
      mbar_init(full_bar + 8 * s, 1 + kConverters);
      mbar_init(empty_bar + 8 * s, CL * 4 * (2 / kHalves));  // one arrival per warp of the stage's consumers
      if constexpr (BT == 2) mbar_init(b32_bar + 8 * s, 1);  // the producer's arrive_expect_tx + the TMA bytes
    }
    if constexpr (XS == 2) {
      mbar_init(acc_full, 256);                 // every consumer thread, its accumulators stored
      mbar_init(acc_empty, 32 * kEwWarps);      // every epilogue thread, its accumulators read
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit
    tma_prefetch_desc(&map_a);
    tma_prefetch_desc(&map_b);
    if constexpr (kPair) {
      tma_prefetch_desc(&map_a8);
      tma_prefetch_desc(&map_b8);
    }
  }
  if constexpr (CL > 1) {
    cluster_sync();  // the peer's barriers are initialized before anything multicasts or arrives on them
  } else {
    __syncthreads();
  }

  // XS = 2: the epilogue warps 0-6 (warps 1-3 of warpgroup 0, then warpgroup 3), one call site (compact code)
  const int ew = XS != 2 ? -1 : wg == 3 ? (int)(threadIdx.x >> 5) - 9 : wg == 0 && threadIdx.x >= 32 ? (int)(threadIdx.x >> 5) - 1 : -1;
  if (ew >= 0) {
    ew_run<EPI, CL>(args, xt_smem, acc_full, acc_empty, groups, m_groups, n_tiles, ew);
  } else if (wg == 0) {
    // Producer warpgroup: every thread gives up registers (XS = 2: not, its epilogue warps need them); one thread
    // issues the copies.
    if constexpr (XS != 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs) : "memory");
    if (threadIdx.x == 0) {
      unsigned it = 0;
      for (int group = cluster; group < groups; group += clusters) {
        int mg, nb;
        group_coords(group, m_groups, n_tiles, args.raster, mg, nb);
        const int mb = CL * mg + rank;
        for (int kt = 0; kt < k_tiles; ++kt, ++it) {
          const unsigned s = it % kStages, phase = (it / kStages) & 1u;
          mbar_wait(empty_bar + 8 * s, phase ^ 1u);  // the consumers are done with this stage
          // TMA counts the whole box, out-of-bounds (zero-filled) elements included; with CL = 2 the peer's
          // half of B completes on this barrier too.
          mbar_arrive_expect_tx(full_bar + 8 * s, kABytes + (BT == 2 ? 0 : kBBytes));
          if (kPair && kt < k8_tiles) {  // an e4m3 stage: boxes of 128 bytes of K (map_b8's box is BN rows)
            tma_load_2d(a_smem + s * kABytes, &map_a8, full_bar + 8 * s, kt * 2 * kBK, mb * kBM);
            tma_load_2d(b_smem + s * kBBytes, &map_b8, full_bar + 8 * s, kt * 2 * kBK, nb * BN);
            continue;
          }
          const int kf = kt - k8_tiles;  // the 16-bit stage's K step
          if constexpr (TA) {  // A [K, M]: two boxes of 64 K-rows x 64 M-elements, one per 64-row half
            tma_load_2d(a_smem + s * kABytes, &map_a, full_bar + 8 * s, mb * kBM, kf * kBK);
            tma_load_2d(a_smem + s * kABytes + 8192, &map_a, full_bar + 8 * s, mb * kBM + 64, kf * kBK);
          } else {
            tma_load_2d(a_smem + s * kABytes, &map_a, full_bar + 8 * s, kf * kBK, mb * kBM);
          }
          // This CTA's part of B: all of it, or with CL = 2 one half (whole 1024-byte swizzle atoms: the layout
          // one box would give), delivered to both CTAs.
          if constexpr (BT == 2) {  // fp32 B [K, N]: one box of 64 K-rows x BN N-elements, for the converters
            mbar_arrive_expect_tx(b32_bar + 8 * s, kRawBytes);
            tma_load_2d(b32_smem + s * kRawBytes, &map_b, b32_bar + 8 * s, nb * BN, kf * kBK);
          } else if constexpr (BT) {  // B [K, N]: BN / 64 boxes of 64 K-rows x 64 N-elements, BN / 64 / CL of them here
            constexpr int kBoxes = BN / 64 / CL;
#pragma unroll
            for (int q = (int)rank * kBoxes; q < ((int)rank + 1) * kBoxes; ++q) {
              tma_load_b<CL>(b_smem + s * kBBytes + q * 8192, &map_b, full_bar + 8 * s, nb * BN + 64 * q, kf * kBK);
            }
          } else {  // map_b's box is BN / CL rows
            tma_load_b<CL>(b_smem + s * kBBytes + rank * (kBBytes / CL), &map_b, full_bar + 8 * s, kf * kBK,
                           nb * BN + (int)rank * (BN / CL));
          }
        }
      }
    } else if (BT == 2 && threadIdx.x >= 32) {
      // Converter warps: the producer's walk, stage by stage. The fp16 tile of stage s is free once its fp32
      // tile has landed (the producer issued that copy after the consumers released the stage).
      const int cw = (threadIdx.x >> 5) - 1, lane = threadIdx.x & 31;
      const float scale = args.b_slot >= 0 ? ldexpf(1.0f, args.state[args.b_slot]) : args.b_alpha;
      float amax = 0.0f;
      unsigned it = 0;
      for (int group = cluster; group < groups; group += clusters) {
        for (int kt = 0; kt < k_tiles; ++kt, ++it) {
          const unsigned s = it % kStages, phase = (it / kStages) & 1u;
          mbar_wait(b32_bar + 8 * s, phase);
#if defined(CUPYFFN_SM90_TRACE) && CUPYFFN_SM90_EPI_PROBE == 4  // probe 4: nothing converted (timing only)
          (void)cw;
#else
          convert_b_stage<BN>(b32_smem + s * kRawBytes, b_smem + s * kBBytes, cw, lane, scale, amax);
#endif
#if !(defined(CUPYFFN_SM90_TRACE) && CUPYFFN_SM90_EPI_PROBE == 5)  // probe 5: no proxy fence (timing only)
          fence_proxy_async_shared();  // the codes before wgmma reads them, the fp32 reads before TMA rewrites them
#endif
          __syncwarp();
          if (lane == 0) mbar_arrive(full_bar + 8 * s);
        }
      }
      if (args.b_amax != nullptr) warp_amax_to(args.b_amax, amax, lane);
    }
  } else {
    if constexpr (XS != 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs) : "memory");
    const int consumer = wg - 1;
    const int tid = threadIdx.x & 127;
    float acc[kHalves][BN / 2];
    unsigned it = 0;
    int local = 0;  // index of the tile in this CTA's sequence
    for (int group = cluster; group < groups; group += clusters, ++local) {
      if (PP && (local & 1) != consumer) {  // the other consumer's tile: skip its stages
        it += k_tiles;
        continue;
      }
      int mg, nb;
      group_coords(group, m_groups, n_tiles, args.raster, mg, nb);
      const int mb = CL * mg + rank;
      CUPYFFN_TRACE(0);
      const int row0 = mb * kBM + 64 * (PP ? 0 : consumer);  // this consumer's block of the tile
      // staged: x and t of the first kXtSlots groups are on their way while the mainloop runs (the ring
      // is free: this thread's previous epilogue has read all of it)
      if constexpr (XS == 1) {
        stage_xt_prologue<BN, kXtSlots>(xt_smem + consumer * kXtSlots * kXtSlotBytes, args, row0, nb * BN, tid);
      }
      // ping-pong: my turn once the other consumer has passed every stage of the tile before this one
      if (PP && local > 0) named_bar_sync(1 + consumer, 256);
      CUPYFFN_TRACE(1);
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[h][i] = 0.0f;
      }
      // One group of wgmma stays in flight while the next stage's are issued; a stage is released once
      // the group that read it has completed (wait<1> leaves only the newest one running).
      unsigned previous = 0;
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const unsigned s = it % kStages, phase = (it / kStages) & 1u;
        if (kPair && kt == k8_tiles && kt > 0) {
          // the e4m3 cross terms are summed: weigh them against the fp16 product that follows
          wgmma_wait<0>();
#pragma unroll
          for (int h = 0; h < kHalves; ++h) {
            fence_regs(acc[h]);
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) acc[h][i] *= args.pair_scale;
          }
        }
        mbar_wait(full_bar + 8 * s, phase);
        // cooperative: this consumer's 64 rows; ping-pong: both halves, 64 rows (8 KiB, one TA box) apart
        const unsigned a_stage = a_smem + s * kABytes + (PP ? 0 : consumer * (64 * 128));
        const unsigned b_stage = b_smem + s * kBBytes;
        wgmma_fence();
        if (kPair && kt < k8_tiles) {  // e4m3: 4 k32 steps of 32 bytes through the 128-byte swizzle row
#pragma unroll
          for (int kk = 0; kk < (kProbeNoMma ? 0 : 4); ++kk) {
#pragma unroll
            for (int h = 0; h < kHalves; ++h) {
              wgmma_e4m3_k32<BN>(acc[h], smem_desc(a_stage + h * (64 * 128) + 32 * kk), smem_desc(b_stage + 32 * kk));
            }
          }
        } else {
#pragma unroll
          for (int kk = 0; kk < (kProbeNoMma ? 0 : kBK / 16); ++kk) {
#pragma unroll
            for (int h = 0; h < kHalves; ++h) {
              const unsigned long long desc_b = BT ? smem_desc_mn(b_stage + 2048 * kk) : smem_desc(b_stage + 32 * kk);
              const unsigned a_half = a_stage + h * (64 * 128);
              const unsigned long long desc_a = TA ? smem_desc_mn(a_half + 2048 * kk) : smem_desc(a_half + 32 * kk);
              wgmma_k16<OP, BN, TA, (BT != 0)>(acc[h], desc_a, desc_b);
            }
          }
        }
        wgmma_commit();
        wgmma_wait<1>();
        if (kt > 0 && (tid & 31) == 0) release_stage<CL>(empty_bar + 8 * previous);  // this warp is done with it
        previous = s;
      }
      wgmma_wait<0>();
#pragma unroll
      for (int h = 0; h < kHalves; ++h) fence_regs(acc[h]);
      if ((tid & 31) == 0) release_stage<CL>(empty_bar + 8 * previous);
      // ping-pong: the other consumer's turn, if the CTA has a next tile (then it waits for exactly this
      // arrival: every bar.arrive is matched by one bar.sync, none is left pending at exit)
      if (PP && group + clusters < groups) named_bar_arrive(1 + (consumer ^ 1), 256);
      CUPYFFN_TRACE(2);
      if constexpr (XS == 2) {
        // the epilogue warps have read the previous tile (parity: one phase per tile; the first wait passes)
        mbar_wait(acc_empty, ((unsigned)local & 1u) ^ 1u);
        ew_store_acc(acc[0], xt_smem, consumer, tid);
        mbar_arrive(acc_full);
      } else if constexpr (XS) {
        const unsigned xt_slots = xt_smem + consumer * kXtSlots * kXtSlotBytes;
        store_block_staged<EPI, BN, kHalves, kXtSlots>(acc, args, row0, nb * BN, tid, xt_slots);
      } else {
#pragma unroll
        for (int h = 0; h < kHalves; ++h) store_block<EPI, BN>(acc[h], args, row0 + 64 * h, nb * BN, tid);
      }
      CUPYFFN_TRACE(3);
    }
  }
  if constexpr (CL > 1) cluster_sync();  // the peer may still deliver to this CTA or arrive on its barriers
}

template <int OP, int BN, int EPI, int PP, int XS, int BT>
__global__ void __launch_bounds__(XS == 2 ? sm90::kEwThreads : sm90::kThreads, 1)
    gemm_sm90_kernel(const __grid_constant__ sm90::TmaDesc map_a, const __grid_constant__ sm90::TmaDesc map_b,
                     const __grid_constant__ sm90::GemmArgs args) {
  gemm_sm90_body<OP, BN, EPI, PP, XS, BT, 1>(map_a, map_b, map_a, map_b, args);
}

// The fp16+fp8 pair in one kernel (OP = kOpF16E4M3 above): fp32 C = alpha (pair_scale A8 B8^T + A B^T) (+ C).
template <int BN, int PP, int TA, int BT>
__global__ void __launch_bounds__(sm90::kThreads, 1)
    gemm_sm90_pair_kernel(const __grid_constant__ sm90::TmaDesc map_a, const __grid_constant__ sm90::TmaDesc map_b,
                          const __grid_constant__ sm90::TmaDesc map_a8, const __grid_constant__ sm90::TmaDesc map_b8,
                          const __grid_constant__ sm90::GemmArgs args) {
  gemm_sm90_body<kOpF16E4M3, BN, kEpiF32, PP, 0, BT, 1, TA>(map_a, map_b, map_a8, map_b8, args);
}

// The same with clusters of two CTAs (CL = 2 above; the grid is a multiple of 2).
template <int OP, int BN, int EPI, int PP, int XS, int BT>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(XS == 2 ? sm90::kEwThreads : sm90::kThreads, 1)
    gemm_sm90_cluster2_kernel(const __grid_constant__ sm90::TmaDesc map_a, const __grid_constant__ sm90::TmaDesc map_b,
                              const __grid_constant__ sm90::GemmArgs args) {
  gemm_sm90_body<OP, BN, EPI, PP, XS, BT, 2>(map_a, map_b, map_a, map_b, args);
}
