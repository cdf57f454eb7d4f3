"""Host time per backward call through the framework layers, next to the CuPy path (GPU only).

``bench.py --loop`` adds these rows to every workload (``layer_impls``, ``jax_impl``); standalone:

    PYTHONPATH=. python3 -m benchmarks.layers              # T=2048, D=1536, H=6144 by default
    PYTHONPATH=. python3 -m benchmarks.layers --tokens 256 --calls 300

Rows (all "bf16x3", the same arrays, every result checked against float64 first):
  cupy-plan                  GeluFFNBackward(...)(..., out=, stream=)   the CuPy path with a plan
  cupy-functional-out        gelu_ffn_backward(..., out=, stream=)      the CuPy path, cached plan
  cupyffn-bf16x3-functional  gelu_ffn_backward(..., stream=)            the same, outputs from CuPy's pool:
                                                                        the torch layers' host-time baseline, as in
                                                                        bench.py --loop (docs/decisions/
                                                                        022-torch-layer-eager-path.md)
  cupyffn-torch-op           torch.ops.cupyffn.backward(...)            the torch operator, eager
  cupyffn-torch-layer        cupyffn.torch.gelu_ffn_backward(...)       what the eager layer's backward runs
                                                                        (its autograd.Function), no dispatcher
  cupyffn-torch-op-compiled  torch.compile(fullgraph=True) of the op    inductor around the opaque op
  cupyffn-torch-autograd     torch.autograd.grad over a kept graph      (standalone only) the eager layer with
                                                                        torch's autograd engine around it
  jax-jit                    jax.jit of cupyffn.jax's backward          dispatch only (XLA runs it async)

Host time: median over --calls of the time to issue one call with the launch queue drained first, in two
loop styles: "dropped" (each result freed before the next call, as bench.py --loop runs them) and "kept"
(the previous result alive during the call, ``r = run()``). For each style also cupyffn's full validations
per call (``validate.validate`` calls) and the distinct grad_hidden_states addresses over 20 calls: if torch's
caching allocator alternates two output sets in the kept style, the validated-call fast path must remember
both (the front door's cache of validated calls, cupyffn/api/functional.py), which these columns show.
``layer_impls()`` returns the callables in bench.py --loop's form (name -> (run, plan))
for the torch rows; ``jax_impl()`` the JAX one with its own synchronization; ``host_impls()`` the rows of the
loop mode's host-time table (bench.py --loop / --host-only; HOST_ROWS).
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
    layer_backward = cupyffn.torch.gelu_ffn_backward

    def eager():
        return op(*targs, precision, True, True)

    impls = {"cupyffn-torch-op": (eager, None),
             "cupyffn-torch-layer": (lambda: layer_backward(*targs, precision), None)}
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


#: The host-time table of bench.py's loop mode (--loop, --host-only), one backward per call, "tf32" for cupyffn, every
#: row on the bench's stream (torch's current stream made that stream) unless it says otherwise:
HOST_ROWS = {
    "cupy-functional-out": "cupyffn.gelu_ffn_backward on CuPy arrays, out= CuPy arrays",
    "torch-functional-out": "the same call on torch tensors, out= torch tensors (read by pointer, no DLPack)",
    "torch-functional-out-other-stream": "the same, torch's current stream another stream (one event wait per call)",
    "torch-layer-backward": "cupyffn.torch.gelu_ffn_backward: the eager layer's backward body (outputs from torch)",
    "torch-layer-autograd": "torch.autograd.grad through the eager layer (cupyffn.torch.gelu_ffn), graph kept",
    "torch-eager-autograd": "torch.autograd.grad through F.linear -> F.gelu(tanh) -> F.linear (nn.Linear + GELU), "
                            "graph kept",
    "cupy-functional": "cupyffn.gelu_ffn_backward on CuPy arrays, outputs allocated by the call",
    "jax-functional": "the same call on jax.Array inputs (imported through DLPack), outputs allocated by the call",
}
#: (numerator, denominator, target) ratios the table reports: torch tensors vs CuPy arrays (target 1.3x), the
#: layer's backward vs torch eager's (target: at or below, 1.0x), jax.Array inputs vs CuPy arrays (issue 32's "any
#: __dlpack__ producer", the same 1.3x).
HOST_RATIOS = (("torch-functional-out", "cupy-functional-out", 1.3),
               ("torch-layer-autograd", "torch-eager-autograd", 1.0),
               ("jax-functional", "cupy-functional", 1.3))


def host_impls(args2d, stream, precision="tf32"):
    """{name: (run, torch_stream)} for HOST_ROWS: run() issues one backward; torch_stream: the torch stream to make
    torch's current one while timing it (None: the bench's `stream`). The CuPy row only where torch has no CUDA.
    Call with torch's current stream already `stream` (the autograd rows' forward runs here, and autograd runs a
    backward on its forward's stream)."""
    import cupy

    shapes = [args2d[1].shape, args2d[2].shape, args2d[3].shape]
    out_c = tuple(cupy.empty(s, dtype=cupy.float32) for s in shapes)
    rows = {"cupy-functional-out": (
        lambda: cupyffn.gelu_ffn_backward(*args2d, precision=precision, out=out_c, stream=stream), None)}
    rows.update(_jax_rows(args2d, stream, precision))
    try:
        import torch
        import torch.nn.functional as F

        if not torch.cuda.is_available():
            return rows
    except ImportError:
        return rows
    import cupyffn.torch as ct

    targs = [torch.from_dlpack(a) for a in args2d]
    out_t = tuple(torch.empty(tuple(s), device=targs[0].device) for s in shapes)

    def functional():
        return cupyffn.gelu_ffn_backward(*targs, precision=precision, out=out_t, stream=stream)

    rows["torch-functional-out"] = (functional, None)
    rows["torch-functional-out-other-stream"] = (functional, torch.cuda.Stream(device=targs[0].device))
    rows["torch-layer-backward"] = (lambda: ct.gelu_ffn_backward(*targs, precision=precision), None)
    dy = targs[0]
    x, w1, w2 = (t.detach().clone().requires_grad_() for t in targs[1:4])
    y_layer = ct.gelu_ffn(x, w1, w2, precision)
    y_eager = F.linear(F.gelu(F.linear(x, w1), approximate="tanh"), w2)
    rows["torch-layer-autograd"] = (
        lambda: torch.autograd.grad(y_layer, (x, w1, w2), dy, retain_graph=True), None)
    rows["torch-eager-autograd"] = (
        lambda: torch.autograd.grad(y_eager, (x, w1, w2), dy, retain_graph=True), None)
    return rows


def _jax_rows(args2d, stream, precision):
    """The JAX rows of HOST_ROWS where JAX sees a GPU (jax.Array views of the same buffers), else none."""
    try:
        import jax
        import jax.dlpack

        if not any(d.platform == "gpu" for d in jax.devices()):
            return {}
    except Exception:  # not installed, or no GPU backend
        return {}
    jargs = [jax.dlpack.from_dlpack(a) for a in args2d]
    return {"cupy-functional": (lambda: cupyffn.gelu_ffn_backward(*args2d, precision=precision, stream=stream), None),
            "jax-functional": (lambda: cupyffn.gelu_ffn_backward(*jargs, precision=precision, stream=stream), None)}


def _host_us(run, sync, calls, keep=False):
    """Median host us to issue one call; `keep`: the previous result stays alive during the call."""
    for _ in range(5):
        sync(run())
    issue = []
    r = None
    for _ in range(calls):
        if not keep:
            r = None
        a = time.perf_counter()
        r = run()
        issue.append(time.perf_counter() - a)
        sync(r)
    return statistics.median(issue) * 1e6


def _addresses(run, calls, keep):
    """(validations per call, distinct addresses of the first result) over `calls` calls."""
    from cupyffn.api import validate as _validate

    original, count, seen = _validate.validate, [0], set()

    def counting(*a, **k):
        count[0] += 1
        return original(*a, **k)

    r = run()
    _validate.validate = counting
    try:
        for _ in range(calls):
            if not keep:
                r = None
            r = run()
            g = r[0]
            seen.add(g.data_ptr() if hasattr(g, "data_ptr") else g.data.ptr)
    finally:
        _validate.validate = original
    return count[0] / calls, len(seen)


def main(tokens=2048, dim=1536, hidden_dim=6144, calls=200, jax_too=True):
    import cupy
    import torch

    import cupyffn.torch as ct

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
            "cupy-functional-out": (lambda: cupyffn.gelu_ffn_backward(*args2d, out=out, stream=stream), None),
            "cupyffn-bf16x3-functional": (lambda: cupyffn.gelu_ffn_backward(*args2d, stream=stream), None)}
    rows.update(layer_impls(args2d))
    results = {}
    sync = lambda r: stream.synchronize()  # noqa: E731
    with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)):
        # the eager layer through autograd: its forward on this stream, so autograd's backward runs here too
        x, w1, w2 = (torch.from_dlpack(a).detach().requires_grad_() for a in args2d[1:4])
        y = ct.gelu_ffn(x, w1, w2, "bf16x3")
        assert y.grad_fn.name() == "EagerGeluFFNBackward", y.grad_fn.name()
        dy = torch.from_dlpack(args2d[0])
        rows["cupyffn-torch-autograd"] = (
            lambda: torch.autograd.grad(y, (x, w1, w2), dy, retain_graph=True), None)
        stream.synchronize()
        # its backward reads the forward's own linear1_out / tanh_inner / gelu_out: the reference from those
        saved = dict(zip(W.INPUT_NAMES[1:], (cupy.from_dlpack(t.detach()) for t in y.grad_fn.saved_tensors)))
        refs = {"cupyffn-torch-autograd": W.reference(dict(saved, grad_output=args2d[0]), xp=cupy)}
        for name, (run, _) in rows.items():
            for g in out:  # NaN-poisoned: a row that writes nothing fails the check
                g.fill(float("nan"))
            grads = run()
            stream.synchronize()
            for g, r, label in zip(grads, refs.get(name, ref64), W.OUTPUT_NAMES):
                g = g if isinstance(g, cupy.ndarray) else cupy.from_dlpack(g)
                err = W.relative_l2(g, r, xp=cupy)
                assert err <= contract, f"{name} {label}: {err}"
            del grads, g
            res = results[name] = {"dropped": _host_us(run, sync, calls), "kept": _host_us(run, sync, calls, True)}
            res["prepare_dropped"], res["addresses_dropped"] = _addresses(run, 20, False)
            res["prepare_kept"], res["addresses_kept"] = _addresses(run, 20, True)
            stream.synchronize()
    if jax_too:
        run, sync = jax_impl(args2d)
        grads = sync(run())
        for g, r, label in zip(grads, ref64, W.OUTPUT_NAMES):
            err = W.relative_l2(cupy.asarray(g.__array__()), r, xp=cupy)
            assert err <= contract, f"jax-jit {label}: {err}"
        results["jax-jit"] = {"dropped": _host_us(run, sync, calls), "kept": _host_us(run, sync, calls, True)}
    base = results["cupyffn-bf16x3-functional"]["dropped"]
    print(f"T={tokens} D={dim} H={hidden_dim}: host us per call (median of {calls}), ratio to "
          f"cupyffn-bf16x3-functional (dropped); prepare() per call and distinct grad_hidden addresses over 20 calls")
    print(f"{'':28s} {'dropped':>9s} {'ratio':>6s} {'kept':>9s} {'ratio':>6s}   prep/addr dropped  prep/addr kept")
    for name, res in results.items():
        extra = ""
        if "prepare_kept" in res:
            extra = (f"   {res['prepare_dropped']:4.2f} / {res['addresses_dropped']:<2d}        "
                     f"{res['prepare_kept']:4.2f} / {res['addresses_kept']:<2d}")
        print(f"{name:28s} {res['dropped']:9.1f} {res['dropped'] / base:5.2f}x {res['kept']:9.1f} "
              f"{res['kept'] / base:5.2f}x{extra}")
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
