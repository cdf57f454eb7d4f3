// Hopper (sm_90a) GEMM with fp32 accumulation in registers, composed of the parts in kernels_cu/sm90/:
//   types.cuh      operand / epilogue codes, the kernel parameters (TmaDesc, GemmArgs), the shared-memory budget
//   ptx.cuh        mbarrier, TMA, wgmma and cp.async wrappers
//   scheduler.cuh  the persistent tile walk and its raster order
//   mainloop.cuh   the TMA producer and the wgmma consumers' mainloop
//   epilogue_*.cuh f32 (the pair), dgelu element math, and the direct / staged / warps dgelu epilogues
//   trace.cuh      per-tile timestamps behind CUPYFFN_SM90_TRACE (measurement only)
// cupyffn/gemm/sm90/ chooses a variant (config.py), encodes the tensor maps and launches it (launch.py).
//
// Two kernels (technique as in CUTLASS's sm90 warp-specialized kernels and public write-ups of hand-written wgmma
// GEMMs; this code is our own):
//   gemm_sm90_kernel<OP, BN, EPI, PP, XS>: the fused GEMM1 + GELU derivative of the tf32 and bf16x3 plans,
//     C = dgelu(A[M, K] @ B[K, N]) with 16-bit operands (OP: kOpF16 or kOpBf16), B a weight as stored (N contiguous).
//   gemm_sm90_pair_kernel<BN, TA>: the fp16+fp8 plan's f16+e4m3 pair in one kernel, fp32 C = alpha (pair_scale
//     A8 B8^T + A B^T) (+ C), A [M, K] (TA = 0) or [K, M] (TA = 1).
//
// Structure: 384 threads = 3 warpgroups. Warpgroup 0 is the producer: one thread issues the TMA copies of each
// stage (mainloop.cuh). Warpgroups 1 and 2 are consumers: they issue wgmma.mma_async m64nBNk16 from shared memory,
// keep one group in flight and release each stage once the group that read it is done. setmaxnreg hands the
// producer's registers to the consumers (40 / 232 per thread). Persistent: at most one CTA per SM, walking the
// output tiles with a stride of the grid (scheduler.cuh). Out-of-bounds rows/columns/K of a tile are zero-filled by
// TMA; the epilogue stores only in-bounds elements.
//
// Schedules (PP): cooperative (both consumers on one 128 x BN tile, 64 rows each, BN = 128 or 256) or ping-pong
// (BN = 128: each consumer owns whole tiles in turn, one stores while the other computes;
// docs/decisions/031-schedule-per-t.md).
//
// Epilogues (EPI; epilogue_dgelu.cuh for the arithmetic):
//   kEpiF32         C = alpha * acc (+ C if accumulate), fp32 (the pair kernel)
//   kEpiDgeluF16    C = fp16(alpha * acc * gelu'(x, t)), x = linear1_out, t = tanh_inner (fp32 [M, N]; t == nullptr
//                   recomputes t from x: memory mode), alpha a power of two chosen by the caller, or 2^state[slot]
//                   from the engine's fp16 scale state (the "tf32" plan)
//   kEpiDgeluF16G   kEpiDgeluF16, and GEMM2's operand as a second output: gelu_out = 0.5 x (1 + t) as fp16 codes of
//                   gelu_out * 2^state[g_slot] (or g_alpha) in g [M, N] (leading dimension ldg), max |gelu_out|
//                   folded into g_amax (docs/decisions/041-gelu-out-in-epilogue.md)
//   kEpiDgeluBf16x3 g = acc * gelu'(x, t) as three bf16 planes side by side in each row of C: columns [0, N) hi =
//                   bf16(g), [N, 2N) lo = bf16(g - hi), [2N, 3N) hi again (ldc >= 3N): the bf16x3 plan's
//                   grad_linear1 (docs/decisions/042-bf16x3-fused-gemm1.md)
//   The dgelu epilogues can also fold max |g| (finite g, before alpha) into a device word (GemmArgs::amax),
//   multiply acc by a device scale first (GemmArgs::acc_scale: GEMM1's alpha), and run as the engine's rescue
//   launch (GemmArgs::rescue; kernels_cu/convert.cu explains gathering and rescue passes).
// How a dgelu epilogue gets x and t (XS): 0 direct (global loads in the epilogue, epilogue_direct.cuh), 1 staged
// (cp.async into shared memory during the mainloop, epilogue_staged.cuh), 2 the epilogue warps (cooperative
// 128 x 128 tiles, one-plane fp16: seven more warps run it while the consumers compute the next tile, 512 threads,
// epilogue_warps.cuh).
//
// Constraints (checked by cupyffn/gemm/sm90/checks.py): K >= 1; lda, ldb multiples of 8 elements and A, B 16-byte
// aligned (TMA; the pair's e4m3 rows: multiples of 16 bytes, k8 a positive multiple of 16); ldc, ldx, ldt even
// (pairs of columns are stored/loaded together) and C, x, t 16-byte aligned; the staged and warps epilogues also
// need ldx, ldt multiples of 4 (16-byte row starts), and with kEpiDgeluF16G ldg == ldc (gelu_out's rows are
// addressed with ldc). Compile for sm_90a (wgmma, setmaxnreg): cupyffn/gemm/sm90/launch.py does.

#include "common.cuh"
#include "sm90/types.cuh"
#include "sm90/ptx.cuh"
#include "sm90/scheduler.cuh"
#include "sm90/mainloop.cuh"
#include "sm90/epilogue_dgelu.cuh"
#include "sm90/epilogue_f32.cuh"
#include "sm90/epilogue_direct.cuh"
#include "sm90/epilogue_staged.cuh"
#include "sm90/epilogue_warps.cuh"
#include "sm90/trace.cuh"

// Ping-pong (PP = 1): the stages arrive in tile order, so one consumer's epilogue runs while the other one's
// mainloop keeps the tensor cores busy. The mainloops take turns too: a consumer starts waiting on the stages of
// its tile only once the other one has passed all the stages of the tile before (named barrier 1 + consumer).
// Without that, a consumer skipping the other's k_tiles stages would wait on a full barrier up to k_tiles / kStages
// phases ahead, where the parity wait cannot tell its phase from an earlier one (wrong data, then a deadlock,
// whenever K > (kStages - 1) * 64 and a CTA has more than one tile).
template <int OP, int BN, int EPI, int PP, int XS, int TA = 0>
__device__ __forceinline__ void gemm_sm90_body(const sm90::TmaDesc& map_a, const sm90::TmaDesc& map_b,
                                               const sm90::TmaDesc& map_a8, const sm90::TmaDesc& map_b8,
                                               const sm90::GemmArgs& args) {
  using namespace sm90;
  static_assert(OP != kOpF16E4M3 || EPI == kEpiF32, "the pair: fp32 out");
  constexpr bool kPair = OP == kOpF16E4M3;
  static_assert(PP == 0 || BN == 128, "ping-pong keeps a whole 128 x BN tile per warpgroup: BN = 128 only");
  static_assert(XS == 0 || EPI != kEpiF32, "the staged epilogue is a dgelu epilogue");
  static_assert(XS != 2 || (BN == 128 && PP == 0 && !kPair && EPI != kEpiDgeluBf16x3),
                "the epilogue warps: cooperative 128 x 128 tiles, one-plane dgelu");
  constexpr int kStages = XS == 2 ? kEwStages : XS ? xs_stages_for(BN) : stages_for(BN);
  constexpr int kHalves = PP ? 2 : 1;  // 64-row halves of a tile that one consumer computes
  constexpr int kXtSlots = XS == 1 ? xt_slots_for(BN) : 0;  // per consumer
  // XS = 2: the accumulator tile and the epilogue warps' rings take the slots' place
  constexpr unsigned kXtBytes = XS == 2 ? kEwAccBytes + kEwRingBytes : 2 * kXtSlots * kXtSlotBytes;
  constexpr unsigned kSmemBytes = XS == 2 ? ew_smem_bytes_for() : XS ? xs_smem_bytes_for(BN) : smem_bytes_for(BN);
  constexpr unsigned kBBytes = BN * kBK * 2;
  constexpr unsigned kProducerRegs = 40, kConsumerRegs = 232;  // setmaxnreg per thread
  extern __shared__ unsigned char smem_raw[];
  const unsigned raw = smem_addr(smem_raw);
  const unsigned a_smem = (raw + 1023u) & ~1023u;  // 128-byte swizzle atoms sit on 1024-byte boundaries
  const unsigned b_smem = a_smem + kStages * kABytes;
  const unsigned xt_smem = b_smem + kStages * kBBytes;  // consumer c's slots: xt_smem + c * kXtSlots * slot bytes
  const unsigned full_bar = xt_smem + kXtBytes;  // stage s: full_bar + 8 s; empty: empty_bar + 8 s
  const unsigned empty_bar = full_bar + 8 * kStages;
  const unsigned acc_full = empty_bar + 8 * kStages, acc_empty = acc_full + 8;  // XS = 2

  const int m_tiles = (args.m + kBM - 1) / kBM;
  const int n_tiles = (args.n + BN - 1) / BN;
  const int tiles = m_tiles * n_tiles;
  const int first_tile = blockIdx.x, tile_step = gridDim.x;
  const int k8_tiles = kPair ? (args.k8 + 2 * kBK - 1) / (2 * kBK) : 0;  // e4m3 stages: 128 bytes of K each
  const int k_tiles = k8_tiles + (args.k + kBK - 1) / kBK;             // every stage of a tile
  const int wg = threadIdx.x >> 7;

  if (EPI != kEpiF32 && args.state != nullptr && args.rescue) {
    // The rescue launch (as dgelu.cu's): block 0 writes the alphas of the GEMMs that read this output; the
    // whole launch runs only if the decision after the gathering launch moved this output's exponent.
    cupyffn::write_alphas(args.state, args.consts, args.alpha_mask);
    // kEpiDgeluF16G writes two outputs: rerun if either exponent moved (the other's codes come out the same)
    const bool again = args.state[2 * kSlots + args.slot] != 0 ||
                       (EPI == kEpiDgeluF16G && args.state[2 * kSlots + args.g_slot] != 0);
    if (!again) return;  // uniform across the grid, before any barrier
  }
  if (threadIdx.x == 0) {
    // a launch with less shared memory than this variant's layout would write past it: fail loudly
    if (dynamic_smem_size() < kSmemBytes) __trap();
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full_bar + 8 * s, 1);  // the producer's arrive_expect_tx (+ the TMA bytes)
      mbar_init(empty_bar + 8 * s, 4 * (2 / kHalves));  // one arrival per warp of the stage's consumers
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
  __syncthreads();

  // XS = 2: the epilogue warps 0-6 (warps 1-3 of warpgroup 0, then warpgroup 3), one call site (compact code)
  const int ew = XS != 2 ? -1 : wg == 3 ? (int)(threadIdx.x >> 5) - 9 : wg == 0 && threadIdx.x >= 32 ? (int)(threadIdx.x >> 5) - 1 : -1;
  if (ew >= 0) {
    ew_run<EPI>(args, xt_smem, acc_full, acc_empty, tiles, m_tiles, n_tiles, ew);
  } else if (wg == 0) {
    // Producer warpgroup: every thread gives up registers (XS = 2: not, its epilogue warps need them); one thread
    // issues the copies.
    if constexpr (XS != 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs) : "memory");
    if (threadIdx.x == 0) {
      produce<kPair, BN, TA, kStages>(map_a, map_b, map_a8, map_b8, args, a_smem, b_smem, full_bar, empty_bar,
                                      first_tile, tile_step, tiles, m_tiles, n_tiles, k8_tiles, k_tiles);
    }
  } else {
    if constexpr (XS != 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs) : "memory");
    const int consumer = wg - 1;
    const int tid = threadIdx.x & 127;
    float acc[kHalves][BN / 2];
    unsigned it = 0;
    int local = 0;  // index of the tile in this CTA's sequence
    for (int tile = first_tile; tile < tiles; tile += tile_step, ++local) {
      if (PP && (local & 1) != consumer) {  // the other consumer's tile: skip its stages
        it += k_tiles;
        continue;
      }
      int mb, nb;
      tile_coords(tile, m_tiles, n_tiles, args.raster, mb, nb);
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
      // The mainloop (the stages as mainloop.cuh describes them): one group of wgmma stays in flight while the next
      // stage's are issued; a stage is released once the group that read it has completed (wait<1> leaves only the
      // newest one running).
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
        mma_stage<OP, BN, TA, kHalves>(acc, a_stage, b_stage, kPair && kt < k8_tiles);
        wgmma_commit();
        wgmma_wait<1>();
        if (kt > 0 && (tid & 31) == 0) mbar_arrive(empty_bar + 8 * previous);  // this warp is done with it
        previous = s;
      }
      wgmma_wait<0>();
#pragma unroll
      for (int h = 0; h < kHalves; ++h) fence_regs(acc[h]);
      if ((tid & 31) == 0) mbar_arrive(empty_bar + 8 * previous);
      // ping-pong: the other consumer's turn, if the CTA has a next tile (then it waits for exactly this
      // arrival: every bar.arrive is matched by one bar.sync, none is left pending at exit)
      if (PP && tile + tile_step < tiles) named_bar_arrive(1 + (consumer ^ 1), 256);
      CUPYFFN_TRACE(2);
      if constexpr (XS == 2) {
        // the epilogue warps have read the previous tile (parity: one phase per tile; the first wait passes)
        mbar_wait(acc_empty, ((unsigned)local & 1u) ^ 1u);
        ew_store_acc(acc[0], xt_smem, consumer, tid);
        mbar_arrive(acc_full);
      } else if constexpr (XS) {
        const unsigned xt_slots = xt_smem + consumer * kXtSlots * kXtSlotBytes;
        store_block_staged<EPI, BN, kHalves, kXtSlots>(acc, args, row0, nb * BN, tid, xt_slots);
      } else if constexpr (EPI == kEpiF32) {
#pragma unroll
        for (int h = 0; h < kHalves; ++h) store_block_f32<BN>(acc[h], args, row0 + 64 * h, nb * BN, tid);
      } else {
#pragma unroll
        for (int h = 0; h < kHalves; ++h) store_block_direct<EPI, BN>(acc[h], args, row0 + 64 * h, nb * BN, tid);
      }
      CUPYFFN_TRACE(3);
    }
  }
}

// The fused GEMM1 + dgelu: OP kOpF16 / kOpBf16, EPI one of the dgelu epilogues, PP the schedule, XS how the epilogue
// gets x and t (512 threads with the epilogue warps, XS = 2).
template <int OP, int BN, int EPI, int PP, int XS>
__global__ void __launch_bounds__(XS == 2 ? sm90::kEwThreads : sm90::kThreads, 1)
    gemm_sm90_kernel(const __grid_constant__ sm90::TmaDesc map_a, const __grid_constant__ sm90::TmaDesc map_b,
                     const __grid_constant__ sm90::GemmArgs args) {
  gemm_sm90_body<OP, BN, EPI, PP, XS>(map_a, map_b, map_a, map_b, args);
}

// The fp16+fp8 pair in one kernel (OP = kOpF16E4M3, cooperative): fp32 C = alpha (pair_scale A8 B8^T + A B^T) (+ C).
// Each tile first runs k8 / 128 stages of e4m3 operands (map_a8, map_b8: [M, k8] and [N, k8] bytes, K-major, the
// cross terms' pairs of kernels_cu/split_e4m3.cu) into the accumulator, multiplies it by pair_scale, then runs the
// fp16 stages of A and B on top. The cross terms come first because Hopper's e4m3 MMA keeps only ~14 bits of its
// sum (docs/decisions/024-sm90-pair-kernel-gemm1.md): it only ever adds the small terms to each other, and the fp16
// MMAs add the large ones on top, as the cuBLAS pair does (its e4m3 GEMM writes C, the fp16 one adds to it).
// TA = 1: A is [K, M] (M contiguous: grad_output / grad_linear1 as stored, for the weight gradients).
template <int BN, int TA>
__global__ void __launch_bounds__(sm90::kThreads, 1)
    gemm_sm90_pair_kernel(const __grid_constant__ sm90::TmaDesc map_a, const __grid_constant__ sm90::TmaDesc map_b,
                          const __grid_constant__ sm90::TmaDesc map_a8, const __grid_constant__ sm90::TmaDesc map_b8,
                          const __grid_constant__ sm90::GemmArgs args) {
  gemm_sm90_body<kOpF16E4M3, BN, kEpiF32, 0, 0, TA>(map_a, map_b, map_a8, map_b8, args);
}
