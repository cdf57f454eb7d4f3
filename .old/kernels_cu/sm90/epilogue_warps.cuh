// sm90 GEMM: the dgelu epilogue in warps of its own (XS = 2; docs/decisions/045-epilogue-warps.md).
// The consumers hand each finished 128 x 128 accumulator tile to shared memory (fp32, 64 KiB) and go on with the
// next tile's mainloop at once; seven epilogue warps (warps 1-3 of the producer warpgroup, idle otherwise, and a
// fourth warpgroup: 512 threads) run the dgelu epilogue from there, streaming x and t through rings of their own.
// So the epilogue's DRAM traffic and instructions overlap the next tile's MMAs instead of following them. A tile's
// rows go to the warps in pairs (pair p to warp p % 7): lane l takes columns 4l ... 4l + 3 of both rows, so every
// load and store of a warp is one whole 512-byte (x, t, accumulator) or 256-byte (codes) row segment. Handshake, one
// mbarrier each way: acc_full (the 256 consumer threads arrive once their accumulators are in shared memory),
// acc_empty (the epilogue threads arrive once they have read theirs). Arithmetic, rounding and amax are those of the
// staged epilogue (bit for bit the same outputs).
#pragma once

namespace sm90 {

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

// Where an epilogue warp's walk is: tile `tile` of the walk (at tile row mb, column nb; the CTA's tiles, as the
// consumers walk them) and its row pair; the pairs of a warp are ew, ew + 7, ... of each tile.
struct EwCursor {
  int tile, pair, mb, nb;
};

__device__ __forceinline__ void ew_locate(EwCursor& c, const GemmArgs& args, int tiles, int m_tiles, int n_tiles) {
  if (c.tile < tiles) tile_coords(c.tile, m_tiles, n_tiles, args.raster, c.mb, c.nb);
}

__device__ __forceinline__ void ew_advance(EwCursor& c, const GemmArgs& args, int tiles, int m_tiles, int n_tiles,
                                           int ew) {
  c.pair += kEwWarps;
  if (c.pair >= kBM / 2) {  // the next tile: its coordinates once per tile, not per item
    c.pair = ew;
    c.tile += gridDim.x;
    ew_locate(c, args, tiles, m_tiles, n_tiles);
  }
}

// Requests the item at c into `slot` (x and t of its two rows, this lane's 16-byte chunk of each) and commits one
// cp.async group; past the CTA's last tile it commits an empty group (the count stays one per item).
template <bool HAS_T>
__device__ __forceinline__ void ew_request(unsigned slot, const GemmArgs& args, const EwCursor& c, int tiles,
                                           int lane) {
  if (c.tile < tiles) {
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
template <int EPI, bool HAS_T>
__device__ __forceinline__ void ew_epilogue(const GemmArgs& args, unsigned acc_smem, unsigned ring, unsigned acc_full,
                                            unsigned acc_empty, int tiles, int m_tiles, int n_tiles, int ew,
                                            int lane) {
  static_assert(EPI == kEpiDgeluF16 || EPI == kEpiDgeluF16G, "one-plane dgelu epilogues");
  const unsigned my_ring = ring + ew * (kEwRing * kEwItemBytes);
  EwCursor rq{(int)blockIdx.x, ew, 0, 0};  // the next item to request
  ew_locate(rq, args, tiles, m_tiles, n_tiles);
#pragma unroll 1
  for (int i = 0; i < kEwRing; ++i) {
    ew_request<HAS_T>(my_ring + i * kEwItemBytes, args, rq, tiles, lane);
    ew_advance(rq, args, tiles, m_tiles, n_tiles, ew);
  }
  unsigned slot_index = 0;
  int local = 0;
#pragma unroll 1
  for (int tile_id = blockIdx.x; tile_id < tiles; tile_id += gridDim.x, ++local) {
    int mb, nb;
    tile_coords(tile_id, m_tiles, n_tiles, args.raster, mb, nb);
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
    unsigned acc_tile = acc_smem;
    mbar_wait(acc_full, (unsigned)local & 1u);
    asm volatile("mov.b32 %0, %0;\n" : "+r"(acc_tile) : : "memory");  // the tile's reads stay after the wait
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
        const float4 a = ld_shared_f4(acc_tile + ew_acc_offset(r, lane));
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
        codes[q][0] = pair_codes(v0, v1, out_scale);
        codes[q][1] = pair_codes(v2, v3, out_scale);
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
      ew_request<HAS_T>(slot, args, rq, tiles, lane);
      ew_advance(rq, args, tiles, m_tiles, n_tiles, ew);
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
template <int EPI>
__device__ __forceinline__ void ew_run(const GemmArgs& args, unsigned xt_smem, unsigned acc_full, unsigned acc_empty,
                                       int tiles, int m_tiles, int n_tiles, int ew) {
  if constexpr (EPI == kEpiDgeluF16 || EPI == kEpiDgeluF16G) {
    const unsigned ring = xt_smem + kEwAccBytes;
    if (args.t != nullptr) {
      ew_epilogue<EPI, true>(args, xt_smem, ring, acc_full, acc_empty, tiles, m_tiles, n_tiles, ew, threadIdx.x & 31);
    } else {
      ew_epilogue<EPI, false>(args, xt_smem, ring, acc_full, acc_empty, tiles, m_tiles, n_tiles, ew, threadIdx.x & 31);
    }
  }
}

}  // namespace sm90
