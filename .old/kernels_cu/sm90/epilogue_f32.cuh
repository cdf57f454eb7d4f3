// sm90 GEMM: the fp32 epilogue of the fp16+fp8 pair kernel (gemm_sm90_pair_kernel): C = alpha * acc (+ C if
// accumulate), fp32 [M, N] with leading dimension ldc; alpha is *acc_scale where given (the engine's device
// constant), else GemmArgs::alpha.
#pragma once

namespace sm90 {

// Stores a consumer's 64 x BN block of the tile whose top-left output element is (row0, col0).
// wgmma's accumulator layout: thread `lane` of warp w holds, for each 8-column group j, columns
// 8j + 2(lane % 4) + {0, 1} of rows 16w + lane / 4 (d[4j], d[4j+1]) and 16w + lane / 4 + 8 (d[4j+2], d[4j+3]).
template <int BN>
__device__ __forceinline__ void store_block_f32(const float (&acc)[BN / 2], const GemmArgs& args, int row0, int col0,
                                                int tid) {
  const int warp = tid >> 5, lane = tid & 31;
  // the GEMM's alpha, from the device (the engine's consts) or the launch
  const float acc_scale = args.acc_scale != nullptr ? *args.acc_scale : args.alpha;
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
    }
  }
}

}  // namespace sm90
