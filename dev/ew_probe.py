"""The epilogue warps (gemm_tn_dgelu epilogue="warps", XS = 2 in gemm_sm90.cu) on the GPU: bit for bit against the
staged epilogue of the cooperative 128 x 128 tile (the same arithmetic) on fresh inputs with NaN-poisoned outputs,
rel. L2 against float64, then GEMM1's shape timed against the engine's schedule, every other schedule and cuBLAS's
GEMM1 alone (fp16 in, fp32 out), L2 flushed, alternating rounds.

    python dev/ew_probe.py [--tokens 256,1024,...] [--rounds 3] [--out FILE.json]
        [--timing-only] [--forms warps,bn128pp,...] [--ew STAGES,RING] [--probe N]

--ew and --probe (sm90 set_trace's probes 1-3: no global stores, no x/t copies, no wgmma; WRONG RESULTS, timing
only) are measurement builds: with them the bitwise part is skipped.
"""
import argparse
import json
import os
import statistics
import sys

import numpy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="256,512,1024,2048,3142,4096,8192")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ew-probe.json"))
    p.add_argument("--timing-only", action="store_true")
    p.add_argument("--forms", default="cublas_gemm1_f32out,bn128,bn128pp,warps,warps_cl2,f32_bn128,f32_bn128_cl2,"
                                      "f32_bn256")
    p.add_argument("--ew", default=None, help="STAGES,RING of the epilogue warps (set_ew; default 4,2)")
    p.add_argument("--probe", type=int, default=0)
    args = p.parse_args(argv)

    import cupy

    from _event_timing import flushed_median_ms
    from cupyffn import _kernels, _sm90_gemm as G
    from sm90_gemm_bench import Bench

    if args.ew:
        G.set_ew(*(int(v) for v in args.ew.split(",")))
    if args.probe:
        G.set_trace(True, args.probe)
    rng = numpy.random.default_rng(20261202)
    stream = cupy.cuda.get_current_stream()
    res = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "bitwise": [], "timing": [],
           "ew_stages": G.EW_STAGES, "ew_ring": G.EW_RING, "probe": args.probe}

    def operands(m, n, k, kn):
        a = cupy.asarray(rng.standard_normal((m, k), dtype=numpy.float32).astype(numpy.float16))
        b = cupy.asarray((0.05 * rng.standard_normal((k, n) if kn else (n, k))).astype(numpy.float16))
        x = cupy.asarray(2 * rng.standard_normal((m, n), dtype=numpy.float32))
        return a, b, x, cupy.tanh((x + x * x * x * 0.044715) * 0.7978845608028654)

    def run(a, b, x, t, dtype, kn, epilogue, gelu, pad, cluster=1):
        # pad: out (and gelu_out) are views into rows of n + pad elements (a row stride that is no multiple of 4
        # takes the epilogue's one-code-at-a-time stores)
        m, n = x.shape
        out = cupy.full((m, n + pad), numpy.nan if dtype == numpy.float16 else 0x7FC0, dtype=dtype)[:, :n]
        g_out = cupy.full((m, n + pad), numpy.nan, dtype=numpy.float16)[:, :n] if gelu else None
        amax, g_amax = cupy.zeros(1, cupy.uint32), (cupy.zeros(1, cupy.uint32) if gelu else None)
        kw = dict(alpha=2.0 ** -3) if dtype == numpy.float16 else {}
        if gelu:
            kw.update(gelu_out=g_out, gelu_alpha=2.0 ** 2, gelu_amax=g_amax)
        G.gemm_tn_dgelu(a, b, x, t, out, amax=amax, block_n=128, pingpong=False, epilogue=epilogue,
                        b_layout="kn" if kn else "nk", raster=G.FUSED_RASTER, cluster=cluster, **kw)
        stream.synchronize()
        return out, g_out, amax, g_amax

    ok = True
    f16, bf16 = numpy.float16, numpy.uint16
    cases = [(1, 6144, 1536, True, f16, True, 0), (300, 1000, 200, True, f16, True, 0),
             (257, 6144, 64, True, f16, True, 0), (1000, 776, 1536, True, f16, False, 0),
             (2048, 6144, 1536, True, f16, True, 0), (8192, 6144, 1536, True, f16, True, 0),
             (4096, 6144, 1536, False, f16, False, 0), (777, 2008, 1000, True, bf16, False, 2),
             (129, 132, 4000, False, bf16, False, 0), (515, 6152, 1536, True, f16, True, 2),
             (3000, 6144, 1536, True, f16, True, 0)]
    if args.timing_only or args.ew or args.probe:
        cases = []
    for m, n, k, kn, dt, gelu, pad, cluster in [c + (cl,) for c in cases for cl in (1, 2)]:
        a, b, x, t = operands(m, n, k, kn)
        if dt == numpy.uint16:
            a, b = Bench.to_bf16_bits(a), Bench.to_bf16_bits(b)
        for mode, tt in (("t", t), ("memory", None)):
            ref = run(a, b, x, tt, dt, kn, "staged", gelu, pad)
            got = run(a, b, x, tt, dt, kn, G.WARPS, gelu, pad, cluster)
            same = all(bool((r.view(cupy.uint16) == g.view(cupy.uint16)).all()) for r, g in zip(ref[:2], got[:2])
                       if r is not None)
            same &= all(int(r[0]) == int(g[0]) for r, g in zip(ref[2:], got[2:]) if r is not None)
            vals = got[0].astype(cupy.float32) if dt == numpy.float16 else (got[0].astype(cupy.uint32) << 16).view(cupy.float32)
            nan = int((~cupy.isfinite(vals)).sum())
            acc = a.astype(cupy.float64) if dt == numpy.float16 else (a.astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64)
            bb = b.astype(cupy.float64) if dt == numpy.float16 else (b.astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64)
            prod = acc @ (bb if kn else bb.T)
            xd = x.astype(cupy.float64)
            td = t.astype(cupy.float64) if tt is not None else cupy.tanh(0.7978845608028654 * (xd + 0.044715 * xd ** 3))
            g = prod * (0.5 * (1 + td) + 0.5 * xd * (1 - td * td) * 0.7978845608028654 * (1 + 3 * 0.044715 * xd * xd))
            scale = 8.0 if dt == numpy.float16 else 1.0
            rel = float(cupy.linalg.norm(vals.astype(cupy.float64) * scale - g) / cupy.linalg.norm(g))
            # untouched padding: nothing written past N
            pads = all(bool(cupy.isnan(r.base[:, n:].astype(cupy.float32)).all()) if r.dtype == numpy.float16
                       else bool((r.base[:, n:] == 0x7FC0).all()) for r in got[:2] if r is not None and pad)
            row = dict(M=m, N=n, K=k, b_layout="kn" if kn else "nk", dtype=str(numpy.dtype(dt)), gelu_out=gelu,
                       ldc=n + pad, cluster=cluster, mode=mode, same_as_staged=same, non_finite=nan, padding_untouched=pads,
                       rel_l2_vs_float64=rel)
            res["bitwise"].append(row)
            print("bitwise", row, flush=True)
            ok &= same and nan == 0 and pads and rel < (2e-3 if dt == f16 else 6e-3)

    bench = Bench(reps=10, warmup=2)
    flush = cupy.empty(256 << 20, dtype=cupy.uint8)
    H, D = 6144, 1536
    sms = _kernels.sm_count(0)
    for T in [int(v) for v in args.tokens.split(",")]:
        a, b, x, t = operands(T, H, D, True)
        out, g_out = cupy.empty((T, H), cupy.float16), cupy.empty((T, H), cupy.float16)
        acc = cupy.empty((T, H), cupy.float32)
        bt = cupy.ascontiguousarray(b.T)
        run_cublas = bench.cublas_tn(a, bt, acc)
        chosen = G.choose_config(T, H, sms, gelu_out=True)
        forms = {"cublas_gemm1_f32out": run_cublas}
        for name, (bn, pp, epi, cl) in {"bn128": (128, False, "staged", 1), "bn128pp": (128, True, "staged", 1),
                                        "bn256_direct": (256, False, "direct", 1), "warps": (128, False, G.WARPS, 1),
                                        "warps_cl2": (128, False, G.WARPS, 2)}.items():
            forms[name] = (lambda bn=bn, pp=pp, epi=epi, cl=cl: G.gemm_tn_dgelu(
                a, b, x, t, out, alpha=2.0 ** -3, block_n=bn, pingpong=pp, epilogue=epi, b_layout="kn",
                raster=G.FUSED_RASTER, gelu_out=g_out, cluster=cl))
        # the same GEMM with fp32 out and no epilogue work: the mainloop's own time per tile shape
        for name, (bn, cl) in {"f32_bn128": (128, 1), "f32_bn128_cl2": (128, 2), "f32_bn256": (256, 1)}.items():
            forms[name] = (lambda bn=bn, cl=cl: G.gemm_tn(a, b, acc, block_n=bn, b_layout="kn", cluster=cl,
                                                         raster=G.FUSED_RASTER))
        forms = {k: v for k, v in forms.items() if k in args.forms.split(",")}
        samples = {k: [] for k in forms}
        for _ in range(args.rounds):
            for k, f in forms.items():
                samples[k].append(flushed_median_ms(cupy, stream, f, lambda: flush.fill(0), 10, 2))
        med = {k: statistics.median(v) for k, v in samples.items()}
        engine = "bn128pp" if chosen == (128, True) else "bn128" if chosen == (128, False) else "bn256_direct"
        line = dict(T=T, engine_schedule=engine, ms=med, samples=samples)
        for num, den in (("warps", engine), ("warps", "cublas_gemm1_f32out"), (engine, "cublas_gemm1_f32out")):
            if num in med and den in med:
                line[f"{num}_over_{den}"] = med[num] / med[den]
        res["timing"].append(line)
        print(f"T={T:5d} " + "  ".join(f"{k} {v:.4f}" for k, v in med.items()) + "  "
              + " ".join(f"{k} {v:.3f}" for k, v in line.items() if k.endswith(("_over_" + engine, "_f32out"))),
              flush=True)
    bench.close()
    res["all_bitwise_same"] = bool(ok)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print("ALL BITWISE SAME" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
