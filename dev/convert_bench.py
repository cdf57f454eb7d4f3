"""Times convert.cu's conversion pass (the tf32 plan's scaled fp16 codes) in candidate builds side by side, at the
engine's own job mixes (GPU only):

    PYTHONPATH=. python3 dev/convert_bench.py --out $OUT/convert-bench.json [--against OLD_KERNELS_CU]
        [--tokens 256,512,1024,2048,4096,8192] [--unroll 1,2,4,8] [--waves 1,2] [--reps 20] [--budget-s 120]

Per T (D = 1536, H = 6144) a GpuEngine for "tf32" is built and its convert stages taken as the engine groups
them (convert A = engine.cvt_a, convert B = engine.cvt_b: at T <= 512 all five matrices in one launch), each
matrix written into the bench's own buffers of the engine's geometry (_Operand: row stride, planes) from random
fp32 sources (normal; weights 0.02 N(0, 1), as the benchmark's).

Candidates, each the gathering pass (rescue = 0) of one build of convert.cu:
  baseline   --against DIR: that folder's convert.cu + common.cuh (an older checkout's kernels_cu, the A/B
             against the code before a change); without it, this checkout's source with -DCUPYFFN_CONVERT_DENSE=0
             (every job on the (row, chunk) path);
  unroll U   this checkout's source with -DCUPYFFN_CONVERT_UNROLL=U (the dense path's groups in flight per thread),
  each on grids of --waves x SMs x resident blocks (the engine's grid: 2 waves), shared out by convert_launch.

Protocol: the scale state is settled first (two gathering passes of the baseline), then kept as a snapshot.
Identity: per candidate every output buffer is poisoned (0xFFFF), the snapshot restored, one gathering pass run,
and all codes and the state (exponents, maxima) compared with the baseline's: "identical yes/no". Timing: one
gathering pass per sample, the L2 flushed before each (a memset of 2x its size, outside the events), CUDA events
around the launch only, median of --reps after --warmup. GB/s = (4 bytes read + 2 written per element) / time.
The JSON (--out) is rewritten after each (T, stage); when --budget-s is spent the rest is listed as skipped.
"""

import argparse
import ctypes
import os
import sys
import time

from _gpu_bench import GpuBench, int_list  # dev/ (the script's folder is on sys.path)
from _json_out import save_json

D, H = 1536, 6144
TOKENS = (256, 512, 1024, 2048, 4096, 8192)
COUNTER = {"convert A": 0, "convert B": 1}  # the engine's arrival counters
ENGINE_WAVES = 2  # _gpu_engine._build_launches: sms * blocks_per_sm * 2


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON path (default: $OUT/convert-bench.json, OUT or .)")
    p.add_argument("--against", default=None, help="kernels_cu folder of the baseline build (default: this "
                   "checkout's source with the dense path off)")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated T")
    p.add_argument("--unroll", default="1,2,4,8", help="comma-separated CUPYFFN_CONVERT_UNROLL values")
    p.add_argument("--waves", default="1,2", help="comma-separated grid sizes in resident-block waves")
    p.add_argument("--reps", type=int, default=20, help="timed samples per candidate (median; default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed launches before the samples (default 3)")
    p.add_argument("--budget-s", type=float, default=120.0,
                   help="wall-clock seconds after which no new (T, stage) starts (default 120)")
    args = p.parse_args(argv)
    args.tokens = int_list(args.tokens, "--tokens", p)
    args.unroll = int_list(args.unroll, "--unroll", p)
    args.waves = int_list(args.waves, "--waves", p)
    if args.reps < 1 or args.warmup < 0:
        p.error(f"--reps must be >= 1 and --warmup >= 0, got {args.reps}, {args.warmup}")
    if not args.budget_s > 0:
        p.error(f"--budget-s must be > 0, got {args.budget_s}")
    if args.against is not None and not os.path.isfile(os.path.join(args.against, "convert.cu")):
        p.error(f"--against must be a kernels_cu folder holding convert.cu, got {args.against!r}")
    if args.out is None:
        args.out = os.path.join(os.environ.get("OUT", "."), "convert-bench.json")
    return args


class Bench(GpuBench):
    def __init__(self, args):
        super().__init__(args)
        from cupyffn import _kernels, _precision

        self.K, self.P = _kernels, _precision
        self.rng = self.cupy.random.RandomState(4321)
        self.sms = _kernels.sm_count(self.device.id)
        self.expr = f"convert_kernel<{_precision.FMT_F16S}>"
        self.builds = {"baseline": self._compile(args.against, ())}
        for u in args.unroll:
            self.builds[f"unroll {u}"] = self._compile(None, (f"-DCUPYFFN_CONVERT_UNROLL={u}",))

    def _compile(self, folder, defines):
        """(kernel, resident blocks per SM, registers) of convert_kernel<FMT_F16S> built from `folder` (None: this
        checkout, with the dense path off when no define is given: the baseline)."""
        cupy, K = self.cupy, self.K
        if folder is None and not defines:
            defines = ("-DCUPYFFN_CONVERT_DENSE=0",)
        source = K.source_with_common("convert.cu", folder)
        module = cupy.RawModule(code=source, options=K.NVRTC_OPTIONS + tuple(defines), name_expressions=[self.expr])
        kernel = module.get_function(self.expr)
        from cupy_backends.cuda.api import driver

        bps = max(1, driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, K.BLOCK, 0))
        return kernel, bps, kernel.num_regs

    def info(self):
        return self.device_info(D=D, H=H, sms=self.sms, against=self.args.against,
                                builds={k: dict(blocks_per_sm=b, registers=r) for k, (_, b, r) in self.builds.items()})

    def time(self, launch):
        """Median us of one launch (GpuBench.median_ms)."""
        return 1000.0 * self.median_ms(lambda: launch(self.stream.ptr))

    def measure_stage(self, eng, t, stage, names):
        """Records of every candidate of one convert stage of engine `eng`."""
        cupy, K, P = self.cupy, self.K, self.P
        from cupyffn._gpu_engine import convert_launch

        vp = ctypes.c_void_p
        with self.stream:
            src = {n: self.rng.standard_normal((eng.ops[n].rows, eng.ops[n].cols), dtype=cupy.float32)
                   * cupy.float32(0.02 if n.startswith("weight") else 1.0) for n in names}
            dst = {n: cupy.empty(eng.ops[n].rows * eng.ops[n].dst_ld, dtype=cupy.uint16) for n in names}
            state = cupy.zeros(4 * K.STATE_SLOTS, dtype=cupy.int32)
            consts = cupy.zeros(8, dtype=cupy.float32)
        targets = [(eng.ops[n], dst[n].data.ptr, P.PATTERN[n], P.SLOT[n]) for n in names]

        def build(kernel, bps, waves):
            launch = convert_launch(kernel, targets, self.sms * bps * waves, 0, COUNTER[stage], 0,
                                    vp(state.data.ptr), vp(consts.data.ptr))
            for k, n in enumerate(names):
                job = launch.args[0].job[k]
                job.kind, job.src, job.src_ld, job.vec = 0, src[n].data.ptr, src[n].shape[1], 1
            return launch

        def run_once(launch, snapshot):
            with self.stream:
                for b in dst.values():
                    b.fill(0xFFFF)
                state[...] = snapshot
            launch(self.stream.ptr)
            self.stream.synchronize()

        kernel, bps, _ = self.builds["baseline"]
        base = build(kernel, bps, ENGINE_WAVES)
        snapshot = self.settled_state(state, base, run_once)
        run_once(base, snapshot)
        with self.stream:
            ref = {n: b.copy() for n, b in dst.items()}
            ref_state = state.copy()
        moved = sum(6 * eng.ops[n].rows * eng.ops[n].cols for n in names)
        records, base_us = [], None
        for build_name, (kernel, bps, regs) in self.builds.items():
            for waves in sorted(set(self.args.waves) | ({ENGINE_WAVES} if build_name == "baseline" else set())):
                launch = build(kernel, bps, waves)
                run_once(launch, snapshot)
                mismatch = None
                with self.stream:
                    for n in names:
                        diff = int((dst[n] != ref[n]).sum())
                        if diff and mismatch is None:
                            mismatch = f"{n}: {diff} codes differ"
                    if mismatch is None and not bool((state == ref_state).all()):
                        mismatch = f"state differs: {state.get().tolist()} vs {ref_state.get().tolist()}"
                us = self.time(launch)
                if build_name == "baseline" and waves == ENGINE_WAVES:
                    base_us = us
                records.append(dict(T=t, stage=stage, jobs=list(names), build=build_name, waves=waves,
                                    grid=launch.grid, blocks_per_sm=bps, registers=regs, us=round(us, 2),
                                    gbps=round(moved / us / 1e3, 1), bytes=moved, identical=mismatch is None,
                                    mismatch=mismatch))
        for r in records:
            r["speedup"] = round(base_us / r["us"], 3)
        return records


def format_line(r):
    return (f"T={r['T']:<5} {r['stage']:<9} {r['build']:<9} waves {r['waves']} grid {r['grid']:>5} "
            f"({r['blocks_per_sm']}/SM, {r['registers']} regs): {r['us']:8.2f} us {r['gbps']:6.0f} GB/s  "
            f"x{r['speedup']:.3f}  identical {'yes' if r['identical'] else 'no: ' + r['mismatch']}")


def summarize(records):
    """Per (build, waves): summed us over the (T, stage) items every candidate measured, and x vs the baseline."""
    items = {(r["T"], r["stage"]) for r in records}
    totals, counts, bad = {}, {}, set()
    for r in records:
        key = f"{r['build']} waves {r['waves']}"
        totals[key] = totals.get(key, 0.0) + r["us"]
        counts[key] = counts.get(key, 0) + 1
        if not r["identical"]:
            bad.add(key)
    base = totals.get(f"baseline waves {ENGINE_WAVES}")
    return {k: dict(total_us=round(v, 2), speedup=round(base / v, 3) if base else None, identical=k not in bad)
            for k, v in sorted(totals.items(), key=lambda kv: kv[1]) if counts[k] == len(items)}


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start = time.perf_counter()
    bench = Bench(args)
    result = dict(tool="convert_bench", **bench.info(), records=[], errors=[], skipped=[], complete=False)
    print(f"{result['device']}, {result['sms']} SMs, driver {result['driver']}, CuPy {result['cupy_version']}; "
          f"builds {result['builds']}; reps {args.reps} -> {args.out}", flush=True)
    from cupyffn._gpu_engine import GpuEngine

    items = [(t, stage) for t in args.tokens for stage in COUNTER]
    eng, eng_t = None, None
    for i, (t, stage) in enumerate(items):
        if time.perf_counter() - start > args.budget_s:
            result["skipped"] = [f"T={tt} {ss}" for tt, ss in items[i:]]
            print(f"budget spent: skipped {result['skipped']}", flush=True)
            break
        try:
            if eng_t != t:
                if eng is not None:
                    eng.close()
                bench.cupy.get_default_memory_pool().free_all_blocks()
                with bench.stream:
                    eng, eng_t = GpuEngine(t, D, H, bench.P.lookup("tf32"), bench.device.id), t
            names = {"convert A": eng.cvt_a, "convert B": eng.cvt_b}[stage]
            if not names:
                continue
            records = bench.measure_stage(eng, t, stage, names)
        except Exception as e:  # noqa: BLE001 -- recorded; the next item still runs
            result["errors"].append(f"T={t} {stage}: {type(e).__name__}: {e}")
            print(f"T={t} {stage}: ERROR {type(e).__name__}: {e}", flush=True)
            continue
        for r in records:
            print(format_line(r), flush=True)
        result["records"] += records
        result["summary"] = summarize(result["records"])
        result["elapsed_s"] = round(time.perf_counter() - start, 2)
        save_json(result, args.out, sort_keys=True)
    if eng is not None:
        eng.close()
    result["complete"] = not result["skipped"] and not result["errors"]
    result["summary"] = summarize(result["records"])
    result["elapsed_s"] = round(time.perf_counter() - start, 2)
    save_json(result, args.out, sort_keys=True)
    for k, v in result["summary"].items():
        print(f"{k:<20} {v['total_us']:9.1f} us  x{v['speedup']}  identical {'yes' if v['identical'] else 'NO'}")
    n_bad = sum(not r["identical"] for r in result["records"])
    print(f"{len(result['records'])} records, {n_bad} not identical, {len(result['errors'])} errors; "
          f"wrote {args.out} ({result['elapsed_s']} s)")
    return 1 if n_bad or result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
