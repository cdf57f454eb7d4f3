// sm90 GEMM: the staged dgelu epilogue (XS = 1; docs/decisions/026-staged-epilogue.md, 027-xt-whole-row-segments.md).
// x and t are copied with cp.async into a per-consumer ring of shared-memory slots, one slot per "group" (64 rows x
// kXtCols columns of the consumer's block, x and t): the first kXtSlots groups are requested when the tile starts
// (they land during its mainloop), each later one as soon as the epilogue frees a slot. Each warp copies the 16 rows
// of its own accumulator fragment as whole row segments (64-128 contiguous bytes per row, where the fragment layout
// gives 32: DRAM and L2 serve whole sectors, not scattered halves of lines), and only that warp reads them back
// (swizzled: no bank conflicts), so a warp waits for its own copies (cp.async.wait_group + __syncwarp): no block
// barrier, no cross-warp hand-off, nothing that can deadlock. It costs kXsStageDrop pipeline stages to make room.
#pragma once

namespace sm90 {

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
          codes[jj][hh] = pair_codes(v0, v1, out_scale);
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
// Same arithmetic, rounding and amax as store_block_direct.
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

}  // namespace sm90
