"""Times split_e4m3.cu's scheduling variants side by side at the fp16+fp8 engine's real job mixes:

    PYTHONPATH=. python3 dev/split_bench.py --out $OUT/split-bench.json [--reps 20] [--tokens 2048,4096,8192]
                                              [--waves 1,2] [--budget-s 55]

Per T (D = 1536, H = 6144) a GpuEngine for "fp16+fp8" is built and its three split_e4m3 stages are taken
exactly as _gpu_engine._build_split_launches builds them (_split_spec of each operand: which encodings, row
strides, K padding, orders, bf16x3 patterns):
  convert A  KIND 0: engine.cvt_a (grad_output, weight2)
  convert B  KIND 0: engine.cvt_b (gelu_out from the matrix itself, as outside memory mode; hidden_states; weight1)
  dgelu      KIND 1: grad_linear1 from grad_gelu, linear1_out and tanh_inner (all given)
but with outputs in the bench's own buffers (same shapes and strides) and random normal fp32 sources.
Candidates: every variant of _kernels.SPLIT_VARIANTS for the stage's KIND times each --waves (gathering-pass
grid = waves x SMs x resident blocks, shared out over the jobs by split_launch); the baseline is variant 0 at
2 waves (the first kernel, the engine's grid).

Protocol: the scale state is settled first (two gathering passes of the baseline), then kept as a snapshot.
Identity: per candidate every output buffer is poisoned (0xFF, e4m3 K padding 0x00), the snapshot restored,
one gathering pass run, and all output bytes and the state compared with the baseline's: "identical yes/no"
(with the first differing byte when not). Timing: one gathering pass per sample (the rescue pass, a flag read
when nothing moved, is not timed), the L2 flushed before each sample (a memset of 2x its size), CUDA events
around the launch only, median of --reps after --warmup. GB/s = (4 bytes per source element read + the bytes
the encodings write) / time.

One line per (T, stage, candidate); the JSON (--out, default $OUT/split-bench.json) is rewritten after each
(T, stage), with the per-KIND recommendation for _kernels.SPLIT_VARIANT: the identical candidate with the
least total time over all measured T and stages of that KIND. When --budget-s is spent (checked between
(T, stage) items) the rest are listed as skipped.
"""

import argparse
import ctypes
import os
import sys
import time

from _gpu_bench import GpuBench, int_list  # dev/ (the script's folder is on sys.path)
from _json_out import save_json

D, H = 1536, 6144
TOKENS = (2048, 4096, 8192)
STAGES = (("convert A", 0), ("convert B", 0), ("dgelu", 1))
COUNTER = {"convert A": 0, "convert B": 1, "dgelu": 2}  # the engine's arrival counters
BASELINE = (0, 2)  # (variant, waves): the first kernel on the engine's grid


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON path (default: $OUT/split-bench.json, OUT or .)")
    p.add_argument("--reps", type=int, default=20, help="timed samples per candidate (median; default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed launches before the samples (default 3)")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated T (default 2048,4096,8192)")
    p.add_argument("--waves", default="1,2", help="comma-separated grid sizes in resident-block waves (default 1,2)")
    p.add_argument("--budget-s", type=float, default=55.0,
                   help="wall-clock seconds after which no new (T, stage) starts (default 55)")
    args = p.parse_args(argv)
    args.tokens = int_list(args.tokens, "--tokens", p)
    args.waves = int_list(args.waves, "--waves", p)
    if args.reps < 1 or args.warmup < 0:
        p.error(f"--reps must be >= 1 and --warmup >= 0, got {args.reps}, {args.warmup}")
    if not args.budget_s > 0:
        p.error(f"--budget-s must be > 0, got {args.budget_s}")
    if args.out is None:
        args.out = os.path.join(os.environ.get("OUT", "."), "split-bench.json")
    return args


def candidates(variants, waves):
    """[(variant, waves)] of one KIND, the baseline first (timed even when --waves leaves its waves out)."""
    out = [BASELINE]
    for v in sorted(variants):
        for w in waves:
            if (v, w) != BASELINE:
                out.append((v, w))
    return out


def stage_bytes(jobs, sources):
    """Bytes one pass moves: per job rows * cols * (4 * `sources` read + the encodings' bytes written);
    jobs: [(rows, cols, written bytes per element)]."""
    return sum(r * c * (4 * sources + w) for r, c, w in jobs)


def recommend(records):
    """{kind: {"variant", "waves", "total_us", "baseline_us", "speedup"}}: per KIND the identical candidate with
    the least summed time over the (T, stage) items where every candidate was timed."""
    out = {}
    for kind in (0, 1):
        items = {}
        for r in records:
            if r["kind"] == kind:
                items.setdefault((r["T"], r["stage"]), []).append(r)
        totals, bad = {}, set()
        for recs in items.values():
            for r in recs:
                key = (r["variant"], r["waves"])
                totals[key] = totals.get(key, 0.0) + r["us"]
                if not r["identical"]:
                    bad.add(key)
        counts = {}
        for recs in items.values():
            for r in recs:
                counts[(r["variant"], r["waves"])] = counts.get((r["variant"], r["waves"]), 0) + 1
        full = [k for k in totals if counts[k] == len(items) and k not in bad]
        if not full or BASELINE not in totals:
            continue
        best = min(full, key=lambda k: totals[k])
        out[kind] = dict(variant=best[0], waves=best[1], total_us=round(totals[best], 2),
                         baseline_us=round(totals[BASELINE], 2), speedup=round(totals[BASELINE] / totals[best], 3))
    return out


def format_line(r):
    return (f"T={r['T']:<5} {r['stage']:<9} KIND {r['kind']} variant {r['variant']} waves {r['waves']} "
            f"grid {r['grid']:>5}: {r['us']:8.1f} us {r['gbps']:6.0f} GB/s  x{r['speedup']:.3f} vs baseline  "
            f"identical {'yes' if r['identical'] else 'no'}" + ("" if r["identical"] else f" ({r['mismatch']})"))


def save(result, path):
    save_json(result, path, sort_keys=True)


# ------------------------------------------------------------------ GPU part (cupy imported here only)
class Bench(GpuBench):
    def __init__(self, args):
        super().__init__(args)
        from cupyffn import _kernels, _precision

        self.K, self.P = _kernels, _precision
        self.rng = self.cupy.random.RandomState(4321)

    def info(self):
        return self.device_info(D=D, H=H, sms=self.K.sm_count(self.device.id),
                                variants={str(k): {str(v): d for v, d in vs.items()}
                                          for k, vs in self.K.SPLIT_VARIANTS.items()},
                                split_variant_now={str(k): list(v) for k, v in self.K.SPLIT_VARIANT.items()})

    def randn(self, shape, scale):
        with self.stream:
            return self.rng.standard_normal(shape, dtype=self.cupy.float32) * self.cupy.float32(scale)

    # -------------------------------------------------------------- outputs: own buffers of the engine's shapes
    def outputs(self, spec):
        """(SplitSpec like `spec` but writing into new buffers, {field: (uint8 view, e4 padding or None)})."""
        cupy, K = self.cupy, self.K
        bufs, kw = {}, {}
        with self.stream:
            if spec.f16 is not None:
                _, ld = spec.f16
                b = cupy.empty(spec.rows * ld, dtype=cupy.uint16)
                kw["f16"] = (b.data.ptr, ld)
                bufs["f16"] = (b.view(cupy.uint8), None)
            if spec.x3 is not None:
                _, ld, part, pattern = spec.x3
                b = cupy.empty(2 * part + spec.rows * ld, dtype=cupy.uint16)
                kw["x3"] = (b.data.ptr, ld, part, pattern)
                bufs["x3"] = (b.view(cupy.uint8), None)
            for field, n, k in (("e4n", spec.rows, spec.cols), ("e4t", spec.cols, spec.rows)):
                e = getattr(spec, field)
                if e is None:
                    continue
                _, ld, kpad, order = e
                b = cupy.empty((n, ld), dtype=cupy.uint8)
                kw[field] = (b.data.ptr, ld, kpad, order)
                bufs[field] = (b, (k, kpad))
        return K.SplitSpec(spec.rows, spec.cols, spec.slot, kind=spec.kind, **kw), bufs

    def poison(self, bufs):
        with self.stream:
            for buf, pad in bufs.values():
                buf.fill(0xFF)
                if pad is not None:  # the e4m3 K padding: zero, and the kernel must leave it so
                    k, kpad = pad
                    buf[:, k:kpad] = 0
                    buf[:, kpad + k:2 * kpad] = 0

    def time(self, launch):
        """Median us of one launch (GpuBench.median_ms)."""
        return 1000.0 * self.median_ms(lambda: launch(self.stream.ptr))

    # -------------------------------------------------------------- one T
    def engine(self, t):
        from cupyffn._gpu_engine import GpuEngine

        with self.stream:
            return GpuEngine(t, D, H, self.P.lookup("fp16+fp8"), self.device.id)

    def measure_stage(self, eng, t, stage, kind, srcs):
        """Records of every candidate of one stage of engine `eng` (srcs: name -> cupy array)."""
        cupy, K = self.cupy, self.K
        dev = self.device.id
        vp = ctypes.c_void_p
        names = {"convert A": eng.cvt_a, "convert B": eng.cvt_b, "dgelu": ["grad_linear1"]}[stage]
        if not names:
            return []
        made = [self.outputs(eng._split_spec(n)) for n in names]
        specs = [m[0] for m in made]
        all_bufs = [m[1] for m in made]
        with self.stream:
            state = cupy.zeros(4 * K.STATE_SLOTS, dtype=cupy.int32)
            consts = cupy.asarray([0, 1, 1, 1, 1, 1, 0, 0], dtype=cupy.float32)
        counter = COUNTER[stage]

        def build(variant, waves):
            kernel, grid = K.split_kernel(kind, dev, variant, waves)
            launch = K.split_launch(kernel, specs, grid, 0, counter, 0, vp(state.data.ptr), vp(consts.data.ptr))
            for k, name in enumerate(names):
                job = launch.args[0].job[k]
                if kind == 1:
                    K.split_set_sources(job, *((a.data.ptr, a.shape[1]) for a in srcs["dgelu"]))
                else:
                    a = srcs[name]
                    K.split_set_sources(job, (a.data.ptr, a.shape[1]), kind=0)
            return launch

        def run_once(launch, snapshot):
            self.poison_all(all_bufs)
            with self.stream:
                state[...] = snapshot
            launch(self.stream.ptr)
            self.stream.synchronize()

        base = build(*BASELINE)
        snapshot = self.settled_state(state, base, run_once)
        run_once(base, snapshot)
        with self.stream:
            ref = [{f: b.copy() for f, (b, _) in bufs.items()} for bufs in all_bufs]
            ref_state = state.copy()
        self.stream.synchronize()

        moved = stage_bytes([(s.rows, s.cols, s.written_bytes_per_element()) for s in specs], 3 if kind == 1 else 1)
        records = []
        base_us = None
        for variant, waves in candidates(K.SPLIT_VARIANTS[kind], self.args.waves):
            launch = build(variant, waves)
            run_once(launch, snapshot)
            mismatch = None
            with self.stream:
                for name, bufs, want in zip(names, all_bufs, ref):
                    for f, (b, _) in bufs.items():
                        diff = b.ravel() != want[f].ravel()
                        n = int(diff.sum())
                        if n and mismatch is None:
                            i = int(cupy.flatnonzero(diff)[0])
                            mismatch = (f"{name}.{f}: {n} bytes differ, first at byte {i}: "
                                        f"{int(b.ravel()[i]):#x} vs {int(want[f].ravel()[i]):#x}")
                if mismatch is None and not bool((state == ref_state).all()):
                    mismatch = f"state differs: {state.get().tolist()} vs {ref_state.get().tolist()}"
                state[...] = snapshot
            us = self.time(launch)
            if (variant, waves) == BASELINE:
                base_us = us
            records.append(dict(T=t, stage=stage, kind=kind, variant=variant, waves=waves, grid=launch.grid,
                                jobs=names, us=round(us, 2), gbps=round(moved / us / 1e3, 1), bytes=moved,
                                speedup=round(base_us / us, 3), identical=mismatch is None, mismatch=mismatch))
        return records

    def poison_all(self, all_bufs):
        for bufs in all_bufs:
            self.poison(bufs)

    def sources(self, t):
        """Random fp32 sources of one T: the convert operands and (grad_gelu, linear1_out, tanh_inner)."""
        cupy = self.cupy
        s = {"grad_output": self.randn((t, D), 0.02), "weight2": self.randn((D, H), 0.03),
             "gelu_out": self.randn((t, H), 0.5), "hidden_states": self.randn((t, D), 1.0),
             "weight1": self.randn((H, D), 0.03)}
        z = self.randn((t, H), 1.5)
        with self.stream:
            s["dgelu"] = (self.randn((t, H), 0.01), z, cupy.tanh(z))
        return s


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start = time.perf_counter()
    bench = Bench(args)
    result = dict(tool="split_bench", **bench.info(), records=[], errors=[], skipped=[], complete=False)
    print(f"{result['device']} cc {result['cc']}, {result['sms']} SMs, driver {result['driver']}, CuPy "
          f"{result['cupy_version']}; reps {args.reps}, L2 flush {bench.flush_bytes >> 20} MiB, waves {args.waves} "
          f"-> {args.out}", flush=True)
    for kind, vs in bench.K.SPLIT_VARIANTS.items():
        for v, text in vs.items():
            print(f"  KIND {kind} variant {v}: {text}")
    items = [(t, stage, kind) for t in args.tokens for stage, kind in STAGES]
    eng = srcs = None
    eng_t = None
    for i, (t, stage, kind) in enumerate(items):
        if time.perf_counter() - start > args.budget_s:
            result["skipped"] = [f"T={tt} {ss}" for tt, ss, _ in items[i:]]
            print(f"budget spent: skipped {result['skipped']}", flush=True)
            break
        try:
            if eng_t != t:
                if eng is not None:
                    eng.close()
                eng = srcs = None
                bench.cupy.get_default_memory_pool().free_all_blocks()
                eng, eng_t = bench.engine(t), t
                srcs = bench.sources(t)
                print(f"T={t}: forms {eng.gemm_forms}, convert A {eng.cvt_a}, convert B {eng.cvt_b}", flush=True)
            if eng.fmt != bench.P.FMT_F16E4M3:
                result["errors"].append(f"T={t}: the fp16+fp8 plan runs the bf16x3 kernels here (no split_e4m3)")
                continue
            records = bench.measure_stage(eng, t, stage, kind, srcs)
        except Exception as e:  # noqa: BLE001 -- recorded; the next item still runs
            result["errors"].append(f"T={t} {stage}: {type(e).__name__}: {e}")
            print(f"T={t} {stage}: ERROR {type(e).__name__}: {e}", flush=True)
            continue
        for r in records:
            print(format_line(r), flush=True)
        result["records"] += records
        result["recommended"] = recommend(result["records"])
        result["elapsed_s"] = round(time.perf_counter() - start, 2)
        save(result, args.out)
    if eng is not None:
        eng.close()
    result["complete"] = not result["skipped"] and not result["errors"]
    result["recommended"] = recommend(result["records"])
    result["elapsed_s"] = round(time.perf_counter() - start, 2)
    save(result, args.out)
    for kind, rec in sorted(result["recommended"].items()):
        print(f"recommended KIND {kind}: SPLIT_VARIANT[{kind}] = ({rec['variant']}, {rec['waves']}): "
              f"{rec['total_us']} us vs baseline {rec['baseline_us']} us (x{rec['speedup']})")
    n_bad = sum(not r["identical"] for r in result["records"])
    print(f"{len(result['records'])} records, {n_bad} not identical, {len(result['errors'])} errors; "
          f"wrote {args.out} ({result['elapsed_s']} s)")
    return 1 if n_bad or result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
