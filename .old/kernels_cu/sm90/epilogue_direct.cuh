// sm90 GEMM: the direct dgelu epilogue (XS = 0): x and t loaded from global memory in the epilogue, 8 bytes per
// thread and fragment (or single floats where rows are not 8-byte aligned: GemmArgs::xt_pairs). Few bytes in flight
// per SM, so it runs at a fraction of HBM bandwidth; the launcher takes it where the rows of x and t are off 16-byte
// boundaries (the staged epilogue's cp.async needs them; docs/decisions/026-staged-epilogue.md).
#pragma once

namespace sm90 {

// Stores a consumer's 64 x BN block of the tile whose top-left output element is (row0, col0).
// wgmma's accumulator layout: thread `lane` of warp w holds, for each 8-column group j, columns
// 8j + 2(lane % 4) + {0, 1} of rows 16w + lane / 4 (d[4j], d[4j+1]) and 16w + lane / 4 + 8 (d[4j+2], d[4j+3]).
template <int EPI, int BN>
__device__ __forceinline__ void store_block_direct(const float (&acc)[BN / 2], const GemmArgs& args, int row0, int col0,
                                                   int tid) {
  const int warp = tid >> 5, lane = tid & 31;
  float amax = 0.0f, acc_scale = 1.0f, out_scale = 1.0f, gamax = 0.0f, g_scale = 1.0f;
  if constexpr (EPI == kEpiDgeluF16G) g_scale = gelu_scale(args);
  epilogue_scales<EPI>(args, acc_scale, out_scale);
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
  if (args.amax != nullptr) warp_amax_to(args.amax, amax, lane);  // uniform: every thread gets here
  if constexpr (EPI == kEpiDgeluF16G) {
    if (args.g_amax != nullptr) warp_amax_to(args.g_amax, gamax, lane);
  }
}

}  // namespace sm90
