// Per-tensor power-of-two scales for the fp16 operands of the "tf32" plan, decided on the device.
//
// A tensor is converted as fp16(x * 2^e) with the exponent e its slot held after the previous call
// (delayed scaling), while the pass gathers max |x|. f16_decide then checks that exponent against
// the maximum just seen: the scaled maximum must lie in [2^8, 2^15) (no overflow, at least 2^22 of
// headroom above fp16's smallest normal). If it does not, e moves so that the maximum lands in
// [2^13, 2^14) and the slot is flagged; the rescue pass of the same kernel then converts the
// flagged tensors again. No host synchronization is involved, so all of it can be captured in a
// CUDA graph. GEMM alphas 2^-(e_a + e_b) undo the scaling; they are read from device memory.
#include "common.cuh"

// consts[0] = 0, consts[1] = 1 and consts[2 + g] is the alpha of GEMM g.
// GEMM g multiplies the tensors in slots kGemmSlots[g][0] and kGemmSlots[g][1] (cupyffn/_precision.py).
__device__ const int kGemmSlots[4][2] = {{0, 1}, {0, 2}, {5, 4}, {5, 3}};

extern "C" __global__ void f16_decide(int* state, float* consts, int slot_mask) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int* exponent = state;
  unsigned int* amax_bits = reinterpret_cast<unsigned int*>(state + kSlots);
  int* again = state + 2 * kSlots;
  for (int s = 0; s < kSlots; ++s) {
    if (((slot_mask >> s) & 1) == 0) continue;
    const float amax = __uint_as_float(amax_bits[s]);
    amax_bits[s] = 0u;  // ready for the next call
    int flag = 0;
    if (amax > 0.0f) {
      int k;
      frexpf(amax, &k);  // amax < 2^k <= 2 * amax
      const int top = k + exponent[s];  // the scaled maximum is below 2^top
      if (top < 9 || top > 15) {
        const int e = min(max(14 - k, -126), 127);
        if (e != exponent[s]) {
          exponent[s] = e;
          flag = 1;
        }
      }
    }
    again[s] = flag;
  }
  for (int g = 0; g < 4; ++g) consts[2 + g] = ldexpf(1.0f, -(exponent[kGemmSlots[g][0]] + exponent[kGemmSlots[g][1]]));
}
