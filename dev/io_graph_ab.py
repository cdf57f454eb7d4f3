"""Graphs per set of arrays against the re-pointed call graph, in one process (GPU machine; a measurement, not a test):

    PYTHONPATH=. python3 dev/io_graph_ab.py [--tokens 256 512] [--out results/io-graph-ab.json]

A tf32 plan at the official dim 1536 / hidden 6144 is called on three input sets in rotation (as bench.py rotates
them), its engine's graphs per set of arrays on ("replay", the product) or replaced by a stand-in that sees every set
for the first time ("re-pointed": the call graph re-pointed at each call's arrays, the route before
docs/decisions/052-io-graphs.md). The two alternate round by round. Per sample the L2 is flushed first, then:
- idle: the GPU drained, an event, the call, an event: what the benchmark's CUDA-event fallback sees (host included);
- queued: a ~0.3 ms spin kernel ahead of the same events, so that the host's enqueue ends before the GPU reaches the
  call: the GPU's span of the call;
- host: the host's time to issue the call (perf_counter, GPU idle).
Medians over the rounds' samples; writes the JSON and prints a table.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _json_out import save_json  # noqa: E402

D, H = 1536, 6144
SPIN = r'''extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}'''


def sample(cupy, s, call, flush, spin, queued):
    with s:
        flush()
    if queued:
        spin((1,), (1,), (cupy.int64(600_000),), stream=s)  # ~0.3 ms at ~1.9 GHz
    else:
        s.synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(s)
    t0 = time.perf_counter()
    call()
    host = time.perf_counter() - t0
    stop.record(s)
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop), host * 1e3


def measure(cupy, cupyffn, T, reps, rounds):
    from cupyffn.api import functional, routes
    from cupyffn.api.validate import Request

    sets = []
    for k in range(3):
        rng = cupy.random.default_rng(100 * T + k)
        x, dy = (rng.standard_normal((T, D), dtype=cupy.float32) for _ in range(2))
        w1 = rng.standard_normal((H, D), dtype=cupy.float32) / 40
        w2 = rng.standard_normal((D, H), dtype=cupy.float32) / 80
        fwd = [cupy.empty((T, n), cupy.float32) for n in (D, H, H, H)]
        cupyffn.gelu_ffn_forward(x, w1, w2, out=fwd)
        args = (dy, x, w1, w2, fwd[1], fwd[2], fwd[3])
        out = [cupy.empty(sh, cupy.float32) for sh in ((T, D), (H, D), (D, H))]
        sets.append((args, out))
    flush_buf = cupy.empty(256 * 2 ** 20 // 4, cupy.float32)
    spin = cupy.RawKernel(SPIN, "spin")
    cupy.cuda.Device().synchronize()  # the inputs were made on the null stream; s does not wait for it
    s = cupy.cuda.Stream(non_blocking=True)
    plan = cupyffn.GeluFFNBackward(T, D, H, precision="tf32")
    replays = plan.engine.graph_cache(routes.REPEATED)
    request = Request("backward", "tf32")
    # the plan's route (REPEATED: a graph per set of arrays) against the same calls routed EAGER (every call re-points)
    modes = {"replay": None, "re-pointed": routes.EAGER}
    got = {m: {"idle": [], "queued": [], "host": []} for m in modes}
    for _ in range(rounds):
        for mode, graphs in modes.items():
            for i in range(6 + reps):  # 6 warm-ups: every set seen twice (the second sighting captures)
                args, out = sets[i % 3]

                def call():
                    functional.run(request, args, out, s, plan=plan, graphs=graphs)

                for timer in ("idle", "queued"):
                    ms, host = sample(cupy, s, call, lambda: flush_buf.fill(1), spin, timer == "queued")
                    if i >= 6:
                        got[mode][timer].append(ms)
                        if timer == "idle":
                            got[mode]["host"].append(host)
    row = {"tokens": T, "captures": replays.captures, "graph_launches": replays.launches}
    for mode, timers in got.items():
        row[mode] = {k: round(statistics.median(v), 4) for k, v in timers.items()}
        row[mode]["idle / queued"] = round(row[mode]["idle"] / row[mode]["queued"], 3)
    plan.close()
    return row


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 512])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "io-graph-ab.json"))
    a = p.parse_args(argv)
    import cupy

    import cupyffn

    rows = [measure(cupy, cupyffn, T, a.reps, a.rounds) for T in a.tokens]
    print("T     mode        idle ms  queued ms  idle/queued  host ms")
    for r in rows:
        for mode in ("replay", "re-pointed"):
            m = r[mode]
            print(f"{r['tokens']:<5} {mode:<11} {m['idle']:8.4f} {m['queued']:10.4f} {m['idle / queued']:12.3f} "
                  f"{m['host']:8.4f}")
    save_json({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
               "command": "python3 dev/io_graph_ab.py " + " ".join(argv or sys.argv[1:]), "rows": rows}, a.out)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
