// The elementwise work of the 16-bit activation plans (cupyffn/lt/engine.py); their GEMMs, and the bias, GELU, GELU
// derivative and bias gradients fused into them, are cuBLASLt's epilogues.
// Template argument HALF: 0 bf16, 1 fp16 (cupyffn/lt/engine.py HALF_CODE).
//   to_half_kernel<HALF>:   dst = T(src), fp32 weights or biases to the activation dtype, rounded to nearest even
//                        (what torch's autocast does to an fp32 parameter)
//   gelu_half_kernel<HALF>: gelu_out = T(gelu_tanh(z)) from linear1_out z, in fp32 (memory mode: no gelu_out saved)
// Both walk a [rows, cols] matrix with row strides in elements; `vec` (4 | cols and every row start 16-byte
// aligned on both sides) lets a thread move 4 elements at once.
#include "common.cuh"

template <typename T> __device__ __forceinline__ T round_to(float x);
template <> __device__ __forceinline__ __nv_bfloat16 round_to<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half round_to<__half>(float x) { return __float2half_rn(x); }

__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }

template <int HALF> struct Half { using T = __nv_bfloat16; };
template <> struct Half<1> { using T = __half; };

template <int HALF>
__global__ void __launch_bounds__(256) to_half_kernel(const float* __restrict__ src, long long src_ld,
                                                      typename Half<HALF>::T* __restrict__ dst, long long dst_ld,
                                                      long long rows, long long cols, int vec) {
  using T = typename Half<HALF>::T;
  const long long step = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (vec) {
    const long long quads = cols / 4, n = rows * quads;
    for (long long i = first; i < n; i += step) {
      const long long r = i / quads, c = 4 * (i - r * quads);
      const float4 v = *reinterpret_cast<const float4*>(src + r * src_ld + c);
      T* d = dst + r * dst_ld + c;
      d[0] = round_to<T>(v.x);
      d[1] = round_to<T>(v.y);
      d[2] = round_to<T>(v.z);
      d[3] = round_to<T>(v.w);
    }
    return;
  }
  const long long n = rows * cols;
  for (long long i = first; i < n; i += step) {
    const long long r = i / cols, c = i - r * cols;
    dst[r * dst_ld + c] = round_to<T>(src[r * src_ld + c]);
  }
}

template <int HALF>
__global__ void __launch_bounds__(256) gelu_half_kernel(const typename Half<HALF>::T* __restrict__ z, long long z_ld,
                                                        typename Half<HALF>::T* __restrict__ g, long long g_ld,
                                                        long long rows, long long cols) {
  using T = typename Half<HALF>::T;
  const long long step = (long long)gridDim.x * blockDim.x;
  const long long n = rows * cols;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    const long long r = i / cols, c = i - r * cols;
    const float x = widen(z[r * z_ld + c]);
    g[r * g_ld + c] = round_to<T>(cupyffn::gelu_of(x, cupyffn::tanh_inner_of(x)));
  }
}
