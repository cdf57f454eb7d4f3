// sm90 GEMM: the dgelu epilogues' arithmetic per element, shared by the direct, staged and warps epilogues:
// g = (acc_scale * acc) * gelu'(x, t), its amax, its rounding (fp16 after a power-of-two scale, or three bf16
// planes), and gelu_out = 0.5 x (1 + t) as fp16 codes (kEpiDgeluF16G). The formulas are common.cuh's.
#pragma once

namespace sm90 {

// result before it is rounded to fp16 (1 for the bf16 planes). Read at each epilogue (L1 hits), not held in registers
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

// The two fp16 codes of one pair of a one-plane (fp16) dgelu epilogue, v0 in the low half: the same rounding as
// f16_bits of each.
__device__ __forceinline__ unsigned pair_codes(float v0, float v1, float out_scale) {
  return cupyffn::f16x2_bits(v0, v1, out_scale);
}

// Both dgelu epilogues: fold g = (v0, v1) into amax (finite values only; v1 only if `both`, nothing unless
// `both` or `one`), round (fp16 after out_scale, or bf16 planes) and store the codes at p: a 4-byte pair if `both`,
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
  const unsigned codes = pair_codes(v0, v1, out_scale);
  if (both) *reinterpret_cast<unsigned*>(p) = codes;
  if (one) p[0] = (unsigned short)codes;
}

// kEpiDgeluF16G's second output: gelu_out = 0.5 x (1 + t) of the pair (x0, t0), (x1, t1), written 0.5 * x * (1 + t)
// as the forward (and convert.cu's gelu_out_of) writes it, folded into gamax (finite values only), rounded to fp16
// after g_scale and stored at p as store_dgelu_pair stores (the same rounding and amax as convert.cu's FMT_F16S).
// Both values go into gamax unpredicated: an element outside the matrix has x = t = 0 (zero-filled slots, or the
// direct epilogue's zeros), so gelu_out = 0 there. (The 128 x 256 cooperative staged variant spills with this
// epilogue, 52 bytes, with or without the predicates: no such variant exists, cupyffn/gemm/sm90/config.py.)
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

}  // namespace sm90
