// sm90 GEMM: the tile scheduler. Persistent: the grid is at most one CTA per SM; CTA b walks the output tiles
// b, b + gridDim.x, ... in the order tile_coords gives. Producer, consumers and epilogue warps walk it alike.
#pragma once

namespace sm90 {

// The output tile at position `tile` of the walk: raster = 0 goes down each column (M fastest, then N); raster = R > 0
// cuts the rows into bands of R and walks each band column by column, so that the CTAs running at one time touch R
// rows' worth of A and a few columns' worth of B (a smaller L2 working set than all of A;
// docs/decisions/032-raster-bands.md).
__device__ __forceinline__ void tile_coords(int tile, int m_tiles, int n_tiles, int raster, int& mb, int& nb) {
  if (raster <= 0 || raster >= m_tiles) {
    mb = tile % m_tiles;
    nb = tile / m_tiles;
    return;
  }
  const int per_band = raster * n_tiles;
  const int band = tile / per_band, within = tile - band * per_band;
  const int rows = min(raster, m_tiles - band * raster);  // the last band may be shorter
  mb = band * raster + within % rows;
  nb = within / rows;
}

}  // namespace sm90
