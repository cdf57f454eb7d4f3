// sm90 GEMM: the mainloop's parts, a TMA producer and the consumers' wgmma, around a ring of STAGES shared-memory
// stages. (The consumers' k-loop itself, waits and releases, stays in gemm_sm90_body: as a function of its own NVVM
// optimizes it before inlining, and the kernels' PTX changed.)
// Stage s holds a 128 x 64 tile of A at a_smem + s * kABytes and a 64-deep tile of B at b_smem + s * BN * 128 bytes;
// its "full" mbarrier (full_bar + 8 s) completes when the TMA bytes have landed, its "empty" one (empty_bar + 8 s)
// when every consumer warp that reads it is done. The pipeline runs on across tile boundaries (producer and
// consumers count stages with one running index `it`), so the producer loads the next tile while the consumers store.
//
// A: [M, K] K-major (TA = 0: one box of 128 rows x 64 per stage), or [K, M] M-major (TA = 1, the fp16+fp8 pair's
// weight gradients: two boxes of 64 K-rows x 64 M-elements). B: [K, N] N-major, a weight as it is stored (BN / 64
// boxes of 64 K-rows x 64 N-elements, read MN-major by wgmma; docs/decisions/030-b-as-stored.md). The pair
// (OP = kOpF16E4M3) first runs k8_tiles stages of e4m3 operands, K-major (128 bytes of K per stage: the bytes and
// swizzle of a 16-bit stage), then the fp16 ones into the same accumulator.
#pragma once

namespace sm90 {

constexpr unsigned kABytes = kBM * kBK * 2;  // A's tile of a stage (e4m3: 128 x 128 bytes, the same)

// The producer thread: for each tile of the CTA's walk (tiles first_tile, first_tile + tile_step, ...), each stage:
// wait until the consumers have released it, then issue its TMA copies, completing on its full barrier.
template <bool PAIR, int BN, int TA, int STAGES>
__device__ __forceinline__ void produce(const TmaDesc& map_a, const TmaDesc& map_b, const TmaDesc& map_a8,
                                        const TmaDesc& map_b8, const GemmArgs& args, unsigned a_smem, unsigned b_smem,
                                        unsigned full_bar, unsigned empty_bar, int first_tile, int tile_step, int tiles,
                                        int m_tiles, int n_tiles, int k8_tiles, int k_tiles) {
  constexpr unsigned kBBytes = BN * kBK * 2;
  unsigned it = 0;
  for (int tile = first_tile; tile < tiles; tile += tile_step) {
    int mb, nb;
    tile_coords(tile, m_tiles, n_tiles, args.raster, mb, nb);
    for (int kt = 0; kt < k_tiles; ++kt, ++it) {
      const unsigned s = it % STAGES, phase = (it / STAGES) & 1u;
      mbar_wait(empty_bar + 8 * s, phase ^ 1u);  // the consumers are done with this stage
      // TMA counts the whole box, out-of-bounds (zero-filled) elements included.
      mbar_arrive_expect_tx(full_bar + 8 * s, kABytes + kBBytes);
      if (PAIR && kt < k8_tiles) {  // an e4m3 stage: boxes of 128 bytes of K (map_b8's box is BN rows)
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
      // B [K, N]: BN / 64 boxes of 64 K-rows x 64 N-elements
#pragma unroll
      for (int q = 0; q < BN / 64; ++q) {
        tma_load_2d(b_smem + s * kBBytes + q * 8192, &map_b, full_bar + 8 * s, nb * BN + 64 * q, kf * kBK);
      }
    }
  }
}

// A consumer warpgroup's wgmma of one stage into acc (HALVES 64-row halves: 1 cooperative, 2 ping-pong), the stage's
// tiles at a_stage (this consumer's rows) and b_stage: an e4m3 stage of the pair (4 k32 steps of 32 bytes through
// the 128-byte swizzle row, both operands K-major), else 4 k16 steps of 16-bit operands (A K-major or, TA = 1,
// MN-major; B MN-major). The caller fences before and commits after (the mainloop in gemm_sm90.cu).
template <int OP, int BN, int TA, int HALVES>
__device__ __forceinline__ void mma_stage(float (&acc)[HALVES][BN / 2], unsigned a_stage, unsigned b_stage,
                                          bool e4m3) {
  if (OP == kOpF16E4M3 && e4m3) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int h = 0; h < HALVES; ++h) {
        wgmma_e4m3_k32<BN>(acc[h], smem_desc(a_stage + h * (64 * 128) + 32 * kk), smem_desc(b_stage + 32 * kk));
      }
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
#pragma unroll
      for (int h = 0; h < HALVES; ++h) {
        const unsigned long long desc_b = smem_desc_mn(b_stage + 2048 * kk);
        const unsigned a_half = a_stage + h * (64 * 128);
        const unsigned long long desc_a = TA ? smem_desc_mn(a_half + 2048 * kk) : smem_desc(a_half + 32 * kk);
        wgmma_k16<OP, BN, TA, 1>(acc[h], desc_a, desc_b);
      }
    }
  }
}

}  // namespace sm90
