// Biases of the float32 engine (docs/decisions/050-biases-in-the-split-precisions.md).
//
// colsum_kernel: column sums of an fp32 matrix in a fixed order, so a bias gradient (a sum over tokens) is
// bit-identical on every call. Block b = by * col_blocks + bx sums columns [128 bx, 128 bx + 128) over the rows of
// band by ([by * band, (by + 1) * band)): lane l of warp w adds columns 4 l .. 4 l + 3 of rows w, w + 8, ... in
// order, then thread c < 128 adds the eight warps' sums in warp order and writes row by of dst (or adds to it).
// The bias gradients take it twice: bands of grad_output into a partial-sum scratch, then one band (all of those
// partial rows) into grad_bias2; grad_bias1's partial rows come from the dgelu pass itself.
//
// bias_rows_kernel: every row of dst [rows, cols] set to bias (the forward's output before the second GEMM adds
// onto it with beta = 1).
#include "common.cuh"

struct ColsumJob {
  const float* src;  // [rows, cols], row stride ld
  float* dst;        // [bands, cols], row stride cols
  long long ld;
  long long rows;
  long long band;    // rows per band
  int cols;
  int vec;           // 1: cols % 4 == 0, src and ld 16-byte aligned
  int accumulate;    // 1: dst += sums
  int col_blocks;    // ceil(cols / 128); the grid is col_blocks * bands
};
static_assert(sizeof(ColsumJob) == 56, "ColsumJob layout is mirrored in cupyffn/cuda/kernels.py");

extern "C" __global__ void __launch_bounds__(256) colsum_kernel(const __grid_constant__ ColsumJob job) {
  __shared__ float part[8][128];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int bx = (int)(blockIdx.x % job.col_blocks), by = (int)(blockIdx.x / job.col_blocks);
  const int c = bx * 128 + 4 * lane;
  const long long r0 = (long long)by * job.band;
  const long long r1 = min(job.rows, r0 + job.band);
  float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (job.vec && c < job.cols) {
#pragma unroll 8
    for (long long r = r0 + warp; r < r1; r += 8) {
      const float4 v = __ldcs(reinterpret_cast<const float4*>(job.src + r * job.ld + c));
      s[0] += v.x;
      s[1] += v.y;
      s[2] += v.z;
      s[3] += v.w;
    }
  } else if (!job.vec) {
    for (long long r = r0 + warp; r < r1; r += 8) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (c + i < job.cols) s[i] += __ldcs(job.src + r * job.ld + c + i);
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) part[warp][4 * lane + i] = s[i];
  __syncthreads();
  const int col = bx * 128 + threadIdx.x;
  if (threadIdx.x < 128 && col < job.cols) {
    float t = part[0][threadIdx.x];
#pragma unroll
    for (int w = 1; w < 8; ++w) t += part[w][threadIdx.x];
    float* d = job.dst + (long long)by * job.cols + col;
    *d = job.accumulate ? *d + t : t;
  }
}

extern "C" __global__ void __launch_bounds__(256) bias_rows_kernel(float* dst, long long ld, long long rows, int cols,
                                                                   const float* bias) {
  for (long long r = blockIdx.x; r < rows; r += gridDim.x)
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[r * ld + c] = __ldg(bias + c);
}
