"""The tf32 plan's weight-gradient GEMMs (fp16 operands, fp32 out) on cuBLAS against our sm90 kernel's fp16 stages.

    PYTHONPATH=. python3 dev/f16_wgrad_probe.py [--tokens 256,512,1024,2048,4096,8192] [--out $OUT/f16-wgrad.json]

GEMM2 grad_weight2 [D, H] = grad_output^T @ gelu_out and GEMM4 grad_weight1 [H, D] = grad_linear1^T @ hidden_states
(K = T, A read as stored [K, M]) as the tf32 plan runs them (cublasGemmEx, fp16 in, fp32 out), against the fp16+fp8
plan's sm90 pair kernel (kernels_cu/gemm_sm90.cu gemm_sm90_pair_kernel) with no e4m3 stage (k8 = 0: the kernel's
fp16 stages and fp32 epilogue alone, a plain fp16 GEMM), each tile width of PAIR_SCHEDULES. At small T these GEMMs
write 37.7 MB of fp32 output (issue 58: 19-20 us against ~8 us for the bytes). L2 flushed before each sample, CUDA
events, median of --reps; the sm90 outputs' rel. L2 against cuBLAS's on the same operands. Writes the JSON (--out)
and prints a table.
"""

import argparse
import os
import sys

D, H = 1536, 6144


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="256,512,1024,2048,4096,8192")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "f16-wgrad.json"))
    args = ap.parse_args(argv)

    import cupy

    from benchmarks.timing import flushed_median_ms
    from cupyffn.gemm import cublas, sm90
    from dev._json_out import save_json

    dev = cupy.cuda.Device()
    stream = cupy.cuda.Stream(non_blocking=True)
    flush_buf = cupy.empty(2 * int(cupy.cuda.runtime.getDeviceProperties(dev.id)["l2CacheSize"]), dtype=cupy.uint8)
    handle = cublas.acquire(dev.id)
    handle.bind(stream.ptr)
    consts = cupy.asarray([1.0, 0.0], dtype=cupy.float32)
    rng = cupy.random.default_rng(5)
    dummy8 = cupy.ones((max(D, H), 16), dtype=cupy.uint8)  # the e4m3 maps need a buffer; k8 = 0 never reads it
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        for gemm, m, n in (("gemm2", D, H), ("gemm4", H, D)):
            with stream:
                a = rng.standard_normal((T, m), dtype=cupy.float32).astype(cupy.float16)  # [K, M]
                b = rng.standard_normal((T, n), dtype=cupy.float32).astype(cupy.float16)  # [K, N]
                ref = cupy.full((m, n), cupy.nan, dtype=cupy.float32)
                out = cupy.full((m, n), cupy.nan, dtype=cupy.float32)
            g = cublas.Gemm(m, n, T, cublas.R_16F, cublas.R_16F, cublas.R_32F, a_trans=True, name=gemm)
            g.a.value, g.b.value, g.c.value = a.data.ptr, b.data.ptr, ref.data.ptr
            g.alpha.value, g.beta.value = consts.data.ptr, consts.data.ptr + 4
            row = {"tokens": T, "gemm": gemm, "m": m, "n": n, "k": T,
                   "cublas_ms": flushed_median_ms(cupy, stream, lambda: g(handle), lambda: flush_buf.fill(0),
                                                  reps=args.reps, warmup=3),
                   "sm90": {}}
            stream.synchronize()
            refn = float(cupy.linalg.norm(ref.astype(cupy.float64)))
            for block_n, pingpong in sm90.PAIR_SCHEDULES:
                launch = sm90.PairLaunch(a.data.ptr, m, "km", b.data.ptr, n, "kn", dummy8.data.ptr, 16, dummy8.data.ptr,
                                         16, m, n, T, 16, device_id=dev.id, alpha=1.0, block_n=block_n,
                                         pingpong=pingpong, out_ptr=out.data.ptr, ldc=n,
                                         raster=sm90.choose_pair_raster(m, n))
                launch.args.k8 = 0  # no e4m3 stage: the fp16 stages alone
                with stream:
                    out.fill(cupy.nan)
                    launch(stream.ptr)
                    stream.synchronize()
                    ok = bool(cupy.isfinite(out).all())
                    err = float(cupy.linalg.norm(out.astype(cupy.float64) - ref) / refn) if ok else None
                ms = flushed_median_ms(cupy, stream, lambda: launch(stream.ptr), lambda: flush_buf.fill(0),
                                       reps=args.reps, warmup=3)
                row["sm90"][f"bn{block_n}{'pp' if pingpong else ''}"] = {"ms": ms, "rel_l2_vs_cublas": err}
            best = min(row["sm90"].items(), key=lambda kv: kv[1]["ms"])
            row["best_sm90"], row["sm90_over_cublas"] = best[0], best[1]["ms"] / row["cublas_ms"]
            row["output_gbps_cublas"] = 4 * m * n / (row["cublas_ms"] * 1e-3) / 1e9
            rows.append(row)
            print(f"T={T:5d} {gemm}: cuBLAS {1e3 * row['cublas_ms']:7.1f} us; sm90 " + ", ".join(
                f"{k} {1e3 * v['ms']:.1f} us (err {v['rel_l2_vs_cublas']})" for k, v in row["sm90"].items())
                + f"; best/cuBLAS {row['sm90_over_cublas']:.3f}", flush=True)
            del a, b, ref, out
    cublas.release(handle)
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"]
    save_json({"device": name.decode() if isinstance(name, bytes) else str(name), "reps": args.reps, "rows": rows},
              args.out)
    bad = [r for r in rows for v in r["sm90"].values() if not (v["rel_l2_vs_cublas"] is not None
                                                               and v["rel_l2_vs_cublas"] < 1e-5)]
    if bad:
        print(f"FAILED: {len(bad)} sm90 outputs differ from cuBLAS's by rel. L2 >= 1e-5 (or NaN)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
