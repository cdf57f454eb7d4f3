"""What the dgelu epilogue of the sm90 GEMM costs on top of its mainloop (GPU only):

    PYTHONPATH=. python3 dev/fused_epilogue_cost.py [--tokens 1024,8192] [--reps 10] [--sweep] [--forms fp16,bf16x3]
        [--clusters 1,2] [--rasters 0] [--staging COLS,DROP] [--memory-mode] [--gelu-out] [--against DIR[,DIR...] --rounds N]
        [--out PATH]

GEMM1 of the backward (M = T, N = H = 6144, B = weight2 as stored, "kn") in the two forms the engine fuses:
fp16 with K = D = 1536 (the tf32 plan) and bf16 with K = 3D = 4608 (the bf16x3 plan's three planes stacked
along K). For each: cuBLAS (gemmEx, fp32 out) alone, our kernel with the fp32 epilogue (the mainloop and a
plain store), and our kernel with the dgelu epilogue writing one 16-bit plane and (bf16) three planes, each
at the engine's tile config (choose_config), with clusters of one and of two CTAs (TMA multicast of B);
--gelu-out adds (fp16) the epilogue that also writes gelu_out's codes (EPI_DGELU_F16G, the tf32 plan's
GEMM1 from T = 4096 on) at its choose_config(gelu_out=True) schedule;
--sweep times every (block_n, pingpong) schedule instead of choose_config's alone, --rasters each tile order
(GemmArgs::raster: 0 down each column of tiles, R bands of R tile rows). Protocol: random operands, L2 flushed (256 MiB written) before
each sample, CUDA events around the call, median of --reps after 2 warm-ups. --against DIRS times each of our
cases also with each DIR's gemm_sm90.cu and common.cuh (e.g. `git archive` of an older commit), alternating the
sources round by round (--rounds), and reports the median over rounds: an A/B in one process, so that a drift of
the GPU's clock between runs does not pass for a code change. JSON at --out (default
$OUT/fused_epilogue_cost.json, OUT or .).
"""

import argparse
import collections
import os
import statistics
import sys

from _event_timing import flushed_median_ms  # dev/_event_timing.py (the script's folder is on sys.path)
from _json_out import save_json

D, H = 1536, 6144


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1024,8192")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="every schedule of CONFIGS, not only choose_config's")
    parser.add_argument("--forms", default="fp16,bf16x3")
    parser.add_argument("--clusters", default="1,2")
    parser.add_argument("--rasters", default="0")
    parser.add_argument("--memory-mode", action="store_true", help="also the dgelu epilogue without tanh_inner (recomputed)")
    parser.add_argument("--gelu-out", action="store_true", help="also the fp16 dgelu epilogue writing gelu_out's codes")
    parser.add_argument("--staging", default=None, help="the staged epilogue's shape, _sm90_gemm.set_staging(cols, drop); "
                        "default: the launcher's")
    parser.add_argument("--against", default=None, help="other kernels_cu folders, comma-separated (e.g. an older "
                        "commit's): every case is timed with each one's gemm_sm90.cu + common.cuh too, interleaved, "
                        "--rounds times each")
    parser.add_argument("--rounds", type=int, default=1, help="with --against: rounds of (this tree, the others)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fused_epilogue_cost.json"))
    args = parser.parse_args(argv)
    import cupy
    import numpy

    from cupyffn import _cublas, _kernels, _sm90_gemm

    sources = {"this": _sm90_gemm.module_source()}
    for folder in (args.against.split(",") if args.against else ()):
        sources[folder] = _kernels.source_with_common(_sm90_gemm.SOURCE, folder)

    def use_source(which):
        """Measurement only: the sm90 variants compiled from sources[which] from now on (CuPy's disk cache,
        keyed by the source text, makes a switch back cheap)."""
        _sm90_gemm.module_source = lambda: sources[which]
        _sm90_gemm._module.cache_clear()
        _sm90_gemm._function.cache_clear()

    if args.staging:
        _sm90_gemm.set_staging(*(int(v) for v in args.staging.split(",")))
    staging = [_sm90_gemm.XT_COLS, _sm90_gemm.XS_STAGE_DROP]

    flush = cupy.empty(256 << 20, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    handle = _cublas.acquire(cupy.cuda.Device().id)
    handle.bind(stream.ptr)
    consts = cupy.asarray([0.0, 1.0], dtype=cupy.float32)
    rng = numpy.random.default_rng(5)
    rows = []

    def timed(run):
        return flushed_median_ms(cupy, stream, run, lambda: flush.fill(0), args.reps, warmup=2)

    for T in (int(t) for t in args.tokens.split(",")):
        x = cupy.asarray(rng.standard_normal((T, H), dtype=numpy.float32))
        t = cupy.tanh(x)
        for form, k, dtype, code in (("fp16", D, numpy.float16, _cublas.R_16F), ("bf16x3", 3 * D, numpy.uint16,
                                                                                _cublas.R_16BF)):
            if form not in args.forms.split(","):
                continue
            a32 = rng.standard_normal((T, k), dtype=numpy.float32)
            b32 = (0.02 * rng.standard_normal((k, H))).astype(numpy.float32)
            if dtype == numpy.float16:
                a, b = cupy.asarray(a32.astype(numpy.float16)), cupy.asarray(b32.astype(numpy.float16))
            else:  # bf16 bits by truncation: the values do not matter for the timing
                a = cupy.asarray((a32.view(numpy.uint32) >> 16).astype(numpy.uint16))
                b = cupy.asarray((b32.view(numpy.uint32) >> 16).astype(numpy.uint16))
            c32 = cupy.empty((T, H), cupy.float32)
            g = _cublas.Gemm(T, H, k, code, code, _cublas.R_32F, name="gemm1")
            g.a.value, g.b.value, g.c.value = a.data.ptr, b.data.ptr, c32.data.ptr
            g.alpha.value, g.beta.value = consts.data.ptr + 4, consts.data.ptr
            chosen = _sm90_gemm.choose_config(T, H, _kernels.sm_count(cupy.cuda.Device().id))
            out1 = cupy.empty((T, H), cupy.float16 if dtype == numpy.float16 else cupy.uint16)
            out3 = cupy.empty((T, 3 * H), cupy.uint16)
            cases = [("cublas fp32 out", None, 1, lambda: g(handle))]
            if args.gelu_out and form == "fp16":
                outg = cupy.empty((T, H), cupy.float16)
                block_n, pp = _sm90_gemm.choose_config(T, H, _kernels.sm_count(cupy.cuda.Device().id), gelu_out=True)
                cfg = dict(block_n=block_n, pingpong=pp, b_layout="kn", cluster=1, raster=_sm90_gemm.FUSED_RASTER,
                           stream=stream)
                cases.append(("ours dgelu + gelu_out", cfg, 1, lambda cfg=cfg: _sm90_gemm.gemm_tn_dgelu(
                    a, b, x, t, out1, gelu_out=outg, **cfg)))
            for block_n, pp in (_sm90_gemm.CONFIGS if args.sweep else (chosen,)):
                for cluster, raster in ((int(c), int(r)) for c in args.clusters.split(",") for r in args.rasters.split(",")):
                    cfg = dict(block_n=block_n, pingpong=pp, b_layout="kn", cluster=cluster, raster=raster, stream=stream)
                    cases += [("ours fp32 out", cfg, cluster, lambda cfg=cfg: _sm90_gemm.gemm_tn(a, b, c32, **cfg)),
                              ("ours dgelu 1 plane", cfg, cluster,
                               lambda cfg=cfg: _sm90_gemm.gemm_tn_dgelu(a, b, x, t, out1, **cfg))]
                    if args.memory_mode:  # tanh_inner recomputed in the epilogue
                        cases.append(("ours dgelu memory", cfg, cluster,
                                      lambda cfg=cfg: _sm90_gemm.gemm_tn_dgelu(a, b, x, None, out1, **cfg)))
                    if form == "bf16x3":
                        cases.append(("ours dgelu 3 planes", cfg, cluster,
                                      lambda cfg=cfg: _sm90_gemm.gemm_tn_dgelu(a, b, x, t, out3, planes=3, **cfg)))
            samples = collections.defaultdict(list)  # (case index, source) -> ms of each round
            for _ in range(args.rounds if args.against else 1):
                for which in sources:
                    use_source(which)
                    for i, (name, cfg, cluster, run) in enumerate(cases):
                        if cfg is not None or which == "this":  # cuBLAS does not depend on the source
                            samples[i, which].append(timed(run))
            for i, (name, cfg, cluster, run) in enumerate(cases):
                schedule = "cublas" if cfg is None else f"bn{cfg['block_n']}{'pp' if cfg['pingpong'] else ''}"
                raster = 0 if cfg is None else cfg["raster"]
                for which in sources:
                    if (i, which) not in samples:
                        continue
                    ms = statistics.median(samples[i, which])
                    row = {"T": T, "form": form, "K": k, "case": name, "schedule": schedule, "cluster": cluster,
                           "raster": raster, "staging": staging, "source": which, "rounds": samples[i, which],
                           "chosen": cfg is not None and (cfg["block_n"], cfg["pingpong"]) == chosen, "ms": ms,
                           "tflops": 2 * T * H * k / ms / 1e9}
                    rows.append(row)
                    ratio = ""
                    if which != "this":
                        ratio = f"  this / it {statistics.median(samples[i, 'this']) / ms:.3f}"
                    print(f"T={T:5d} {form:6s} K={k:5d} {name:20s} {schedule:8s} cl{cluster} r{raster:<2d} "
                          f"{which[-12:]:12s} {ms:8.4f} ms {row['tflops']:6.1f} TFLOP/s"
                          f" (rounds {min(samples[i, which]):.4f}-{max(samples[i, which]):.4f}){ratio}", flush=True)
    save_json({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "command": " ".join(sys.argv),
               "reps": args.reps, "against": args.against, "results": rows}, args.out)


if __name__ == "__main__":
    main()
