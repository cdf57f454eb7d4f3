"""Wave quantization of the backward's GEMMs by output tile (no GPU needed; issue 47's tile shapes):

    python3 dev/wave_table.py [--sms 132] [--tiles 128x128 128x192 192x128 128x256 256x128] [--dim 1536 --hidden 6144]

For each GEMM of the backward (cupyffn/core/precision.py GEMM_MNK: output M x N) at each token count of the 16
official workloads, and each output tile BM x BN: the tiles, the waves they make on `--sms` SMs (one tile per SM at a
time, a persistent kernel's schedule), and the fill: tiles / (whole waves x SMs), the share of the last wave's SM
slots that do work. A fill below 1 is time the GEMM pays for idle SMs, whatever its per-tile speed; it says nothing of
what a tile's shape costs inside the mainloop (shared memory, registers, the operands' reuse).
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cupyffn import workloads as W  # noqa: E402
from cupyffn.core.precision import GEMM_MNK, dims  # noqa: E402


def fill(m, n, tile, sms):
    """(tiles, waves, fill) of an m x n output in `tile` (bm, bn) tiles on `sms` SMs."""
    bm, bn = tile
    tiles = math.ceil(m / bm) * math.ceil(n / bn)
    waves = tiles / sms
    return tiles, waves, tiles / (math.ceil(waves) * sms)


def table(tokens, dim, hidden, tiles, sms):
    """{(gemm, T): {tile: (tiles, waves, fill)}} for every GEMM of the backward at every T."""
    return {(g, t): {tile: fill(*dims(GEMM_MNK[g][:2], t, dim, hidden), tile, sms) for tile in tiles}
            for g in GEMM_MNK for t in tokens}


def parse_tile(text):
    bm, bn = (int(v) for v in text.lower().split("x"))
    return bm, bn


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sms", type=int, default=132, help="SMs (H100 SXM and H200: 132)")
    p.add_argument("--tiles", nargs="+", default=["128x128", "128x192", "192x128", "128x256", "256x128"])
    p.add_argument("--dim", type=int, default=W.DIM)
    p.add_argument("--hidden", type=int, default=W.HIDDEN_DIM)
    a = p.parse_args(argv)
    tiles = [parse_tile(t) for t in a.tiles]
    tokens = sorted({w.tokens for w in W.WORKLOADS})
    rows = table(tokens, a.dim, a.hidden, tiles, a.sms)
    print(f"fill (waves) on {a.sms} SMs, D = {a.dim}, H = {a.hidden}; GEMM output M x N")
    print("gemm   T      M x N        " + "".join(f"{bm}x{bn:<13}" for bm, bn in tiles))
    for (g, t), cells in rows.items():
        m, n = dims(GEMM_MNK[g][:2], t, a.dim, a.hidden)
        line = "".join(f"{f:5.2f} ({w:5.2f})  " for _, w, f in cells.values())
        print(f"{g}  {t:<6} {m:>5} x {n:<6} {line}")


if __name__ == "__main__":
    main()
