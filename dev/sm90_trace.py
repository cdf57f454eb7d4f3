"""Per-tile timeline of the sm90 GEMM's consumers (GPU only; a measurement, not a test):

    PYTHONPATH=. python3 dev/sm90_trace.py [--tokens 8192] [--schedules bn256,bn128pp] [--epilogues staged]
                                           [--rasters 0] [--out PATH]

Runs the traced variants (Sm90Config(trace=True): compiled with CUPYFFN_SM90_TRACE, kernels_cu/sm90/trace.cuh: each
consumer warpgroup stamps the global timer when a tile's iteration starts, when it has its turn on the tensor
cores, when its mainloop and when its epilogue end; the results are the untraced kernel's) of the fused GEMM1 +
dgelu (M = T, N = H = 6144, K = D = 1536, fp16 operands and out, B as stored), one traced launch after a warm-up,
L2 flushed.
Per schedule it reports the medians per tile of the wait for the turn, the mainloop and the epilogue, the
kernel's span, and "tensor busy": the share of each CTA's span covered by some consumer's mainloop (the
ping-pong schedule exists to keep that near 1; the cooperative one leaves the epilogue uncovered).
JSON at --out (default $OUT/sm90_trace.json, OUT or .).
"""

import argparse
import os
import statistics
import sys

from _json_out import save_json

D, H = 1536, 6144
TRACE_TILES = 64  # kTraceTiles in kernels_cu/sm90/trace.cuh


def summarize(stamps, ctas):
    """stamps: [ctas, 2 consumers, TRACE_TILES, 4] global-timer ns (0: not recorded). Returns per-tile medians
    (us) of the turn wait, mainloop and epilogue, the span (us) and the mean share of each CTA's span that
    some consumer's mainloop covers."""
    waits, mains, epis, busy = [], [], [], []
    first, last = None, None
    for cta in range(ctas):
        intervals, lo, hi = [], None, None
        for consumer in range(2):
            for tile in range(TRACE_TILES):
                t0, t1, t2, t3 = (int(v) for v in stamps[cta][consumer][tile])
                if not (t0 and t1 and t2 and t3):
                    continue
                waits.append((t1 - t0) / 1e3)
                mains.append((t2 - t1) / 1e3)
                epis.append((t3 - t2) / 1e3)
                intervals.append((t1, t2))
                lo = t0 if lo is None else min(lo, t0)
                hi = t3 if hi is None else max(hi, t3)
        if not intervals:
            continue
        covered, end = 0, None
        for a, b in sorted(intervals):  # union of the mainloop intervals of both consumers
            if end is None or a > end:
                covered += b - a
                end = b
            elif b > end:
                covered += b - end
                end = b
        busy.append(covered / (hi - lo))
        first = lo if first is None else min(first, lo)
        last = hi if last is None else max(last, hi)
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"tiles": len(mains), "turn_wait_us": med(waits), "mainloop_us": med(mains), "epilogue_us": med(epis),
            "span_us": (last - first) / 1e3 if first is not None else None,
            "tensor_busy": statistics.mean(busy) if busy else None}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--schedules", default="bn256,bn128pp")
    parser.add_argument("--epilogues", default="staged", help="comma-separated, of direct, staged, warps")
    parser.add_argument("--rasters", default="0")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "sm90_trace.json"))
    args = parser.parse_args(argv)
    import cupy
    import numpy

    from cupyffn.cuda import kernels as _kernels
    from cupyffn.gemm import sm90 as G

    device = cupy.cuda.Device().id
    ctas = _kernels.sm_count(device)
    T = args.tokens
    rng = numpy.random.default_rng(3)
    a = cupy.asarray(rng.standard_normal((T, D), dtype=numpy.float32).astype(numpy.float16))
    b = cupy.asarray((0.02 * rng.standard_normal((D, H))).astype(numpy.float16))
    x = cupy.asarray(rng.standard_normal((T, H), dtype=numpy.float32))
    t = cupy.tanh(x)
    o16 = cupy.empty((T, H), cupy.float16)
    flush = cupy.empty(256 << 20, dtype=cupy.uint8)
    buf = cupy.zeros((ctas, 2, TRACE_TILES, 4), dtype=cupy.uint64)
    rows = []
    for schedule in args.schedules.split(","):
        block_n, pingpong = int(schedule[2:5]), schedule.endswith("pp")
        for raster in (int(r) for r in args.rasters.split(",")):
            for epi in args.epilogues.split(","):
                kw = dict(block_n=block_n, pingpong=pingpong, epilogue=epi, raster=raster, trace=True)
                G.gemm_tn_dgelu(a, b, x, t, o16, **kw)  # compiles the variant
                module = G.module(G.Sm90Config(G.OP_F16, block_n, pingpong, G.EPI_DGELU_F16, epi, trace=True), device)
                pointer = cupy.ndarray((1,), cupy.uint64, memptr=module.get_global("cupyffn_sm90_trace"))
                pointer[0] = buf.data.ptr
                buf.fill(0)
                flush.fill(0)
                cupy.cuda.Device().synchronize()
                G.gemm_tn_dgelu(a, b, x, t, o16, **kw)
                cupy.cuda.Device().synchronize()
                pointer[0] = 0
                stamps = buf.get()
                row = {"T": T, "schedule": schedule, "raster": raster, "epilogue": epi,
                       **summarize(stamps, ctas),
                       "cta0": [[[int(v) for v in tile] for tile in cons if tile[0]] for cons in stamps[0]]}
                rows.append(row)
                print(f"T={T} {schedule:8s} raster {raster:2d} {epi:10s} tiles {row['tiles']:5d} span {row['span_us']:7.1f} us"
                      f" per tile: turn wait {row['turn_wait_us']:6.2f} mainloop {row['mainloop_us']:6.2f} epilogue "
                      f"{row['epilogue_us']:6.2f} us; tensor busy {row['tensor_busy']:.3f}", flush=True)
    save_json({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "command": " ".join(sys.argv),
               "results": rows}, args.out)


if __name__ == "__main__":
    main()
