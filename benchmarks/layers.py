"""Host time per backward call through the framework layers, next to the CuPy path (GPU only).

``bench.py --loop`` adds these rows to every workload (``layer_impls``, ``jax_impl``); standalone:

    PYTHONPATH=. python3 -m benchmarks.layers              # T=2048, D=1536, H=6144 by default
    PYTHONPATH=. python3 -m benchmarks.layers --tokens 256 --calls 300

Rows (all "bf16x3", the same arrays, every result checked against float64 first):
  cupy-plan         GeluFFNBackward(...)(..., out=, stream=)          the CuPy path with a plan
  cupy-functional   gelu_ffn_backward(..., out=, stream=)              the CuPy path, cached plan
  torch-op          torch.ops.cupyffn.backward(...)                    through the torch layer, eager
  torch-op-compiled torch.compile(fullgraph=True) of the same call     inductor around the opaque op
  jax-jit           jax.jit of cupyffn.jax's backward (buffer callback) dispatch only (XLA runs it async)

Host time: median over --calls of the time to issue one call with the launch queue drained first (as
bench.py --loop measures it). ``layer_impls()`` returns the callables in bench.py --loop's form
(name -> (run, plan)) for the torch rows; ``jax_impl()`` the JAX one with its own synchronization.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")  # before JAX starts: leave CuPy room

import cupyffn
from cupyffn import workloads as W


def layer_impls(args2d, precision="bf16x3", compile=True):
    """torch rows for bench.py --loop: {name: (run, None)}; run() issues one backward on torch's current
    stream (the loop sets it to its own stream with torch.cuda.stream(torch.cuda.ExternalStream(ptr)))."""
    import torch

    import cupyffn.torch  # noqa: F401 (registers torch.ops.cupyffn)

    targs = [torch.from_dlpack(a) for a in args2d]
    op = torch.ops.cupyffn.backward

    def eager():
        return op(*targs, precision, True, True)

    impls = {"cupyffn-torch-op": (eager, None)}
    if compile:
        if precision not in _compiled:  # one compilation for every shape (dynamic), as bench.py's torch rows
            _compiled[precision] = torch.compile(lambda *a: op(*a, precision, True, True), fullgraph=True,
                                                 dynamic=True)
        compiled = _compiled[precision]
        impls["cupyffn-torch-op-compiled"] = (lambda: compiled(*targs), None)
    return impls


_compiled = {}


def jax_impl(args2d, precision="bf16x3"):
    """(run, sync): run() dispatches one jitted backward (XLA runs it on its stream); sync(result) waits."""
    import jax

    import cupyffn.jax as cj

    jargs = [jax.device_put(a.get()) for a in args2d]

    @jax.jit
    def backward(dy, x, w1, w2, z, t, g):
        return cj._gelu_ffn_bwd(precision, (x, w1, w2, z, t, g), dy)

    return (lambda: backward(*jargs)), jax.block_until_ready


def _host_us(run, sync, calls):
    for _ in range(5):
        sync(run())
    issue = []
    for _ in range(calls):
        a = time.perf_counter()
        r = run()
        issue.append(time.perf_counter() - a)
        sync(r)
    return statistics.median(issue) * 1e6


def main(tokens=2048, dim=1536, hidden_dim=6144, calls=200, jax_too=True):
    import cupy
    import torch

    inputs = W.make_inputs((tokens,), dim, hidden_dim, xp=cupy, seed=1)
    args2d = [inputs[n] for n in W.INPUT_NAMES]
    ref64 = W.reference(inputs, xp=cupy)
    contract = cupyffn.PRECISIONS["bf16x3"].contract
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    shapes = [(tokens, dim), (hidden_dim, dim), (dim, hidden_dim)]
    out = tuple(cupy.empty(s, dtype=cupy.float32) for s in shapes)
    plan = cupyffn.GeluFFNBackward(tokens, dim, hidden_dim, precision="bf16x3")
    rows = {"cupy-plan": (lambda: plan(*args2d, out=out, stream=stream), None),
            "cupy-functional": (lambda: cupyffn.gelu_ffn_backward(*args2d, out=out, stream=stream), None)}
    rows.update(layer_impls(args2d))
    results = {}
    with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)):
        for name, (run, _) in rows.items():
            grads = run()
            stream.synchronize()
            for g, r, label in zip(grads, ref64, W.OUTPUT_NAMES):
                g = g if isinstance(g, cupy.ndarray) else cupy.from_dlpack(g)
                err = W.relative_l2(g, r, xp=cupy)
                assert err <= contract, f"{name} {label}: {err}"
            results[name] = _host_us(run, lambda r: stream.synchronize(), calls)
    if jax_too:
        run, sync = jax_impl(args2d)
        grads = sync(run())
        for g, r, label in zip(grads, ref64, W.OUTPUT_NAMES):
            err = W.relative_l2(cupy.asarray(g.__array__()), r, xp=cupy)
            assert err <= contract, f"jax-jit {label}: {err}"
        results["jax-jit"] = _host_us(run, sync, calls)
    base = results["cupy-plan"]
    print(f"T={tokens} D={dim} H={hidden_dim}: host us per call (median of {calls}), ratio to cupy-plan")
    for name, us in results.items():
        print(f"{name:28s} {us:9.1f}  {us / base:5.2f}x")
    return results


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dim", type=int, default=1536)
    p.add_argument("--hidden-dim", type=int, default=6144)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--no-jax", action="store_true")
    a = p.parse_args()
    main(a.tokens, a.dim, a.hidden_dim, a.calls, not a.no_jax)
