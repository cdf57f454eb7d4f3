"""Times the sm_90a GEMM (cupyffn/_sm90_gemm.py) against cuBLAS on the four backward GEMM shapes,
and GEMM1 with the fused GELU derivative against cuBLAS GEMM1 + a separate pass.

    PYTHONPATH=. python3 tools/sm90_gemm_bench.py        # writes $OUT/sm90_gemm_bench.json (OUT or .)

Shapes (D = 1536, H = 6144, T in 256, 1024, 4096, 8192), C[M, N] = A[M, K] @ B[N, K]^T, both K-major:
  gemm1 grad_gelu    M=T N=H K=D      gemm3 grad_hidden  M=T N=D K=H
  gemm2 grad_weight2 M=D N=H K=T      gemm4 grad_weight1 M=H N=D K=T
Implementations: ours (block_n 128 / 256, fp16 in, fp32 out); cuBLAS gemmEx fp16 in, fp32 out
(cupyffn's own binding, as the engine calls it); cupy.matmul on fp16 arrays (fp16 out).
Protocol: L2 flushed (256 MiB written) before each sample, CUDA events around the call only, median
of 20 after 3 warm-ups. Each of our results is also checked against cuBLAS's (rel. L2).
"""

import ctypes
import json
import os
import statistics
import sys
import time

import numpy

D, H = 1536, 6144
TS = (256, 1024, 4096, 8192)
REPS = 20
WARMUP = 3


def config_name(block_n, pingpong):
    return f"bn{block_n}{'pp' if pingpong else ''}"


def shapes(t):
    return {"gemm1": (t, H, D), "gemm2": (D, H, t), "gemm3": (t, D, H), "gemm4": (H, D, t)}


def main():
    import cupy

    from cupyffn import _cublas, _kernels, _sm90_gemm

    device = cupy.cuda.Device()
    if not _sm90_gemm.device_supported(device.id):
        print(f"sm90 GEMM bench: device {device.id} is compute capability {device.compute_capability}, not 9.0; nothing to do")
        return 2
    out_dir = os.environ.get("OUT", ".")
    stream = cupy.cuda.get_current_stream()
    flush = cupy.empty(256 << 20, dtype=cupy.uint8)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()

    def timed(fn):
        samples = []
        for i in range(WARMUP + REPS):
            flush.fill(i & 0xFF)
            start.record(stream)
            fn()
            stop.record(stream)
            stop.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, stop))
        return statistics.median(samples[WARMUP:])

    handle = _cublas.acquire(device.id)
    handle.bind(stream.ptr)
    one = cupy.ones(1, cupy.float32)
    zero = cupy.zeros(1, cupy.float32)

    def cublas_tn(a, b, c):
        """c[M, N] fp32 = a[M, K] @ b[N, K]^T through cublasGemmEx (fp16 or bf16 in, fp32 out)."""
        m, k = a.shape
        n = b.shape[0]
        code = _cublas.R_16F if a.dtype == numpy.float16 else _cublas.R_16BF
        g = _cublas.Gemm(m, n, k, code, code, _cublas.R_32F, b_trans=True, lda=k, ldb=k, ldc=n, name="bench")
        g.a.value, g.b.value, g.c.value = a.data.ptr, b.data.ptr, c.data.ptr
        g.alpha.value, g.beta.value = one.data.ptr, zero.data.ptr
        return lambda: g(handle)

    def rel_l2(x, ref):
        ref = ref.astype(cupy.float64)
        return float(cupy.linalg.norm(x.astype(cupy.float64) - ref) / cupy.linalg.norm(ref))

    records = []
    errors = []
    t0 = time.perf_counter()
    _sm90_gemm._kernel(_sm90_gemm.OP_F16, 256, _sm90_gemm.EPI_F32, False, device.id)
    compile_s = time.perf_counter() - t0

    # ---- the four GEMMs --------------------------------------------------------------------------
    for t in TS:
        for name, (m, n, k) in shapes(t).items():
            a = cupy.random.standard_normal((m, k), dtype=cupy.float32).astype(cupy.float16)
            b = cupy.random.standard_normal((n, k), dtype=cupy.float32).astype(cupy.float16)
            ref = cupy.empty((m, n), cupy.float32)
            flops = 2.0 * m * n * k
            run_cublas = cublas_tn(a, b, ref)
            ms = timed(run_cublas)
            records.append(dict(gemm=name, T=t, M=m, N=n, K=k, impl="cublas_f16_f32out", ms=ms, tflops=flops / ms * 1e-9))
            c16 = cupy.empty((m, n), cupy.float16)
            ms = timed(lambda: cupy.matmul(a, b.T, out=c16))
            records.append(dict(gemm=name, T=t, M=m, N=n, K=k, impl="cupy_matmul_f16_f16out", ms=ms, tflops=flops / ms * 1e-9))
            for bn, pp in _sm90_gemm.CONFIGS:
                c = cupy.full((m, n), cupy.nan, cupy.float32)
                try:
                    ms = timed(lambda: _sm90_gemm.gemm_tn(a, b, c, block_n=bn, pingpong=pp))
                    err = rel_l2(c, ref)
                except Exception as e:  # record and go on: one run should tell as much as it can
                    errors.append(f"{name} T={t} {config_name(bn, pp)}: {type(e).__name__}: {e}")
                    continue
                records.append(dict(gemm=name, T=t, M=m, N=n, K=k, impl="sm90_" + config_name(bn, pp), ms=ms,
                                    tflops=flops / ms * 1e-9, rel_l2_vs_cublas=err))
    # ---- GEMM1 + GELU derivative -----------------------------------------------------------------
    pass_f16 = cupy.ElementwiseKernel(
        "float32 g, float32 x, float32 t, float32 alpha", "float16 y",
        "const float d = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 0.134145f * x * x);"
        "y = (float16)(g * d * alpha);", "sm90_bench_dgelu_pass")
    dgelu_bf16 = _kernels.get_function("dgelu", "dgelu_kernel<1>", device.id)  # the engine's pass, bf16 out
    fused = []
    for t in TS:
        m, n, k = t, H, D
        a = cupy.random.standard_normal((m, k), dtype=cupy.float32).astype(cupy.float16)
        b = cupy.random.standard_normal((n, k), dtype=cupy.float32).astype(cupy.float16)
        a_bf = (a.astype(cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)  # bf16 truncation: any values do
        b_bf = (b.astype(cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)
        x = 2 * cupy.random.standard_normal((m, n), dtype=cupy.float32)
        tt = cupy.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)).astype(cupy.float32)
        acc = cupy.empty((m, n), cupy.float32)
        out16 = cupy.empty((m, n), cupy.float16)
        outbf = cupy.empty((m, n), cupy.uint16)
        row = dict(T=t, M=m, N=n, K=k)
        gemm = cublas_tn(a, b, acc)
        row["cublas_gemm1_ms"] = timed(gemm)
        alpha = numpy.float32(0.25)
        row["cublas_plus_cupy_pass_f16_ms"] = timed(lambda: (gemm(), pass_f16(acc, x, tt, alpha, out16)))
        job = _kernels.DgeluJob(acc.data.ptr, x.data.ptr, tt.data.ptr, outbf.data.ptr, n, n, n, n, 0, m, n,
                                0, 0, 1, 0, 0, 0, 0)
        launch = _kernels.KernelLaunch(dgelu_bf16, job, ctypes.c_void_p(0), ctypes.c_void_p(0))
        items = m * -(-n // (8 * _kernels.BLOCK))  # the engine's grid (GpuEngine, _gpu_engine.py)
        launch.grid = max(1, min(items, _kernels.sm_count(device.id) * _kernels.blocks_per_sm("dgelu", "dgelu_kernel<1>", device.id) * 2))
        gemm_bf = cublas_tn(a_bf, b_bf, acc)
        row["cublas_bf16_gemm1_ms"] = timed(gemm_bf)
        row["cublas_plus_engine_pass_bf16_ms"] = timed(lambda: (gemm_bf(), launch(stream.ptr)))
        row["engine_pass_bf16_ms"] = timed(lambda: launch(stream.ptr))
        ref_bf = outbf.copy()  # cuBLAS (bf16 operands) + the engine's pass: the reference of the fused bf16 result
        gemm()
        pass_f16(acc, x, tt, alpha, out16)
        ref16 = out16.astype(cupy.float32)
        for bn, pp in _sm90_gemm.CONFIGS:
            cfg = config_name(bn, pp)
            try:
                out16.fill(cupy.nan)
                row[f"fused_f16_{cfg}_ms"] = timed(
                    lambda: _sm90_gemm.gemm_tn_dgelu(a, b, x, tt, out16, alpha=0.25, block_n=bn, pingpong=pp))
                row[f"fused_f16_{cfg}_rel_l2"] = rel_l2(out16.astype(cupy.float32), ref16)
                outbf.fill(0x7FC0)
                row[f"fused_bf16_{cfg}_ms"] = timed(
                    lambda: _sm90_gemm.gemm_tn_dgelu(a_bf, b_bf, x, tt, outbf, block_n=bn, pingpong=pp))
                row[f"fused_bf16_{cfg}_rel_l2"] = rel_l2((outbf.astype(cupy.uint32) << 16).view(cupy.float32),
                                                         (ref_bf.astype(cupy.uint32) << 16).view(cupy.float32))
                row[f"fused_f16_{cfg}_memory_mode_ms"] = timed(
                    lambda: _sm90_gemm.gemm_tn_dgelu(a, b, x, None, out16, alpha=0.25, block_n=bn, pingpong=pp))
            except Exception as e:
                errors.append(f"fused T={t} {cfg}: {type(e).__name__}: {e}")
        fused.append(row)
    # ---- host cost --------------------------------------------------------------------------------
    host = {}
    a = cupy.ones((4096, 1536), cupy.float16)
    b = cupy.ones((6144, 1536), cupy.float16)
    c = cupy.empty((4096, 6144), cupy.float32)
    t0 = time.perf_counter()
    for _ in range(100):
        _sm90_gemm.encode_tensor_map(a.data.ptr, 4096, 1536, 1536 * 2, _sm90_gemm.OP_F16, 128)
    host["encode_tensor_map_us"] = (time.perf_counter() - t0) / 100 * 1e6
    _sm90_gemm.gemm_tn(a, b, c)
    stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(100):
        _sm90_gemm.gemm_tn(a, b, c)
    host["gemm_tn_call_cached_maps_us"] = (time.perf_counter() - t0) / 100 * 1e6
    stream.synchronize()
    _cublas.release(handle)

    result = dict(device=cupy.cuda.runtime.getDeviceProperties(device.id)["name"].decode(), cupy=cupy.__version__,
                  compile_s=compile_s, gemms=records, fused=fused, host=host, errors=errors)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "sm90_gemm_bench.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)

    print_tables(result, path, _sm90_gemm.CONFIGS)
    if errors:
        print("ERRORS:\n  " + "\n  ".join(errors))
        return 1
    return 0


def print_tables(result, path, configs):
    """The compact tables (stdout, last), from the JSON result alone."""
    records, fused, host, compile_s = result["gemms"], result["fused"], result["host"], result["compile_s"]
    cfgs = [config_name(bn, pp) for bn, pp in configs]
    by = {(r["gemm"], r["T"], r["impl"]): r for r in records}
    print(f"\nsm90 GEMM bench ({result['device']}; compile {compile_s:.1f} s; json: {path})")
    print("TFLOP/s (ms) per GEMM: cuBLAS fp16->fp32 (the engine's call), cupy.matmul fp16->fp16, ours fp16->fp32 "
          "(bn = tile N, pp = ping-pong); ratio = best ours / cuBLAS fp32-out time; err = worst rel L2 of ours vs cuBLAS")
    impls = ["cublas_f16_f32out", "cupy_matmul_f16_f16out"] + ["sm90_" + c for c in cfgs]
    heads = ["cuBLAS", "cupy f16out"] + ["ours " + c for c in cfgs]
    print(f"{'gemm':5} {'T':>5} | " + " | ".join(f"{h:>14}" for h in heads) + " | ratio | err")
    for t in TS:
        for name in ("gemm1", "gemm2", "gemm3", "gemm4"):
            cells, ours = [], []
            for impl in impls:
                r = by.get((name, t, impl))
                cells.append(f"{r['tflops']:4.0f} ({r['ms']:.3f})" if r else "failed")
                if r and impl.startswith("sm90"):
                    ours.append(r)
            base = by.get((name, t, "cublas_f16_f32out"))
            ratio = f"{min(r['ms'] for r in ours) / base['ms']:5.2f}" if ours and base else "    -"
            err = f"{max(r['rel_l2_vs_cublas'] for r in ours):.1e}" if ours else "-"
            print(f"{name:5} {t:5d} | " + " | ".join(f"{c:>14}" for c in cells) + f" | {ratio} | {err}")
    print("\nGEMM1 + GELU derivative, ms. Separate: cuBLAS GEMM1 (fp32 out) + a CuPy elementwise pass (fp16 out), "
          "and cuBLAS bf16 GEMM1 + the engine's dgelu kernel (bf16 out). Fused: ours (f16 = scaled fp16 out, bf16 out, "
          "mem = memory mode, fp16). ratio = best fused fp16 / cuBLAS GEMM1 alone (target <= 1.05 at T >= 2048)")
    print(f"{'T':>5} | {'cuBLAS':>7} | {'+cupy':>7} | {'bf16 cuBLAS':>11} | {'+engine':>7} | {'fused f16':>16} | "
          f"{'fused bf16':>16} | {'fused mem':>16} | ratio | worst err f16, bf16")
    for row in fused:
        def best(pattern):
            """(fastest time, its config) over the configs, for keys fused_<pattern with CFG replaced>_ms."""
            keys = [(f"fused_{pattern.replace('CFG', c)}_ms", c) for c in cfgs]
            found = [(row[key], c) for key, c in keys if key in row]
            return min(found) if found else None

        def cell(b):
            return f"{b[0]:.3f} {b[1]:>8}" if b else "-"

        f16, bf16, mem = best("f16_CFG"), best("bf16_CFG"), best("f16_CFG_memory_mode")
        sep = [f"{row[k]:.3f}" if k in row else "-" for k in ("cublas_gemm1_ms", "cublas_plus_cupy_pass_f16_ms",
                                                              "cublas_bf16_gemm1_ms", "cublas_plus_engine_pass_bf16_ms")]
        ratio = f"{f16[0] / row['cublas_gemm1_ms']:5.2f}" if f16 else "    -"
        errs = []
        for f in ("f16", "bf16"):
            e = [row[f"fused_{f}_{c}_rel_l2"] for c in cfgs if f"fused_{f}_{c}_rel_l2" in row]
            errs.append(f"{max(e):.1e}" if e else "-")
        print(f"{row['T']:5d} | {sep[0]:>7} | {sep[1]:>7} | {sep[2]:>11} | {sep[3]:>7} | {cell(f16):>16} | "
              f"{cell(bf16):>16} | {cell(mem):>16} | {ratio} | {', '.join(errs)}")
    print(f"\nhost: encode_tensor_map {host['encode_tensor_map_us']:.1f} us, gemm_tn call (maps cached) "
          f"{host['gemm_tn_call_cached_maps_us']:.1f} us")


if __name__ == "__main__":
    sys.exit(main())
