"""Where the host time of one torch operator call goes (GPU machine; a measurement, not a test; issue 46):

    PYTHONPATH=. python3 dev/op_host_cost.py [--tokens 2048] [--calls 200] [--new-outputs] [--out FILE]

The operators that a compiled swapped model calls (``torch.ops.cupyffn.forward`` / ``backward``), called directly
with a GPT-2 MLP's tensors (bf16 activations, fp32 master Conv1D weights stored [in, out], biases): the same tensors
every call, as a training loop's caching allocator gives them, so the calls run the route's graph replay. The median
host time per call with the queue drained first, and the inclusive host time of each stage of the body (the
functions below wrapped with timers: torch's casts and allocations, the door's three stages, the engine's parts),
per call. Beside it, the host time of torch eager's addmm + GELU + addmm and of its autograd backward; and a whole
layer's forward + backward as a model runs it (autocast, parameters and input requiring grad): torch eager, torch
inductor's code (torch.compile, default mode), cupyffn's block eager and under the same torch.compile, which is
what a compiled swapped model pays per MLP on the host against what the plain compiled model pays.

--new-outputs keeps every call's results (and every layer step's output and gradients) alive until the row is
measured, so each call's outputs are at addresses no earlier call had: a training step whose tensors the allocator
does not hand back at the same addresses (issue 59: the validated calls remembered by configuration serve it, where
remembering them by address validated and routed each such call again). Without it the allocator reuses the freed
blocks and the calls repeat their addresses. To compare two trees on one machine, run this file against each
(PYTHONPATH=<tree> python3 <this file>): a stage the older tree lacks is left out of its table.
"""

import argparse
import collections
import json
import os
import time

from _event_timing import host_median_us

D, H = 1536, 6144


def stages():
    """(module or class, attribute) wrapped with a timer: the stages of an operator's body, outermost first (imported
    here: the tool loads and answers --help without the GPU's modules)."""
    import cupyffn.torch  # noqa: F401 (registers the operators)
    from cupyffn.api import execute, functional, routes, validate
    from cupyffn.cuda import graph_cache, stream_engine
    from cupyffn.frameworks import torch_ops

    device_context = getattr(torch_ops, "TorchDevice", None) or getattr(torch_ops, "Call")  # its name in older trees
    return [(torch_ops, "forward_impl"), (torch_ops, "backward_impl"), (functional, "run"), (validate, "check"),
            (routes, "route"), (execute, "run"), (execute, "outputs"), (execute, "_run_gpu"), (execute, "_issue"),
            (graph_cache.GraphCache, "launch"), (graph_cache.GraphCache, "run"),
            (stream_engine.StreamEngine, "order_after_previous"), (stream_engine.StreamEngine, "record_done"),
            (device_context, "__enter__"), (torch_ops, "weights"), (torch_ops, "readable")]


def wrap(spent):
    """Wrap the stages with timers adding into spent[name] (seconds); returns a function that unwraps them."""
    saved = []
    for owner, name in stages():
        real = getattr(owner, name, None)
        if real is None:  # an older tree without this stage
            continue
        label = f"{getattr(owner, '__name__', owner)}.{name}".replace("cupyffn.", "")

        def timed(*a, _real=real, _label=label, **k):
            t0 = time.perf_counter()
            try:
                return _real(*a, **k)
            finally:
                spent[_label] += time.perf_counter() - t0

        setattr(owner, name, timed)
        saved.append((owner, name, real))

    def unwrap():
        for owner, name, real in saved:
            setattr(owner, name, real)

    return unwrap


def host_us(run, calls):
    """Median host microseconds of run() over `calls` calls after 10 warm-ups, the queue drained before each."""
    import torch

    return host_median_us(run, calls, torch.cuda.synchronize)


def layer_rows(x, dy, w1s, w2s, b1, b2, calls, keep=None):
    """Host us of one layer's forward + backward, each way a model runs it (module docstring)."""
    import torch

    from cupyffn.frameworks.torch_layer import block

    params = [w1s.clone().requires_grad_(), w2s.clone().requires_grad_(), b1.clone().requires_grad_(),
              b2.clone().requires_grad_()]
    xin = x.detach().clone().requires_grad_()

    def torch_mlp(h):  # transformers' Conv1D: h @ W[in, out] + b
        z = torch.addmm(params[2], h.flatten(0, -2), params[0])
        return torch.addmm(params[3], torch.nn.functional.gelu(z, approximate="tanh"), params[1])

    def cupyffn_mlp(h):  # what replace_mlps runs for it: the weights as [out, in] views of the same storage
        return block(h, params[0].t(), params[1].t(), params[2], params[3])

    rows = {}
    for name, fn in (("torch eager", torch_mlp), ("torch.compile", torch.compile(torch_mlp)),
                     ("cupyffn", cupyffn_mlp), ("cupyffn + torch.compile", torch.compile(cupyffn_mlp))):
        def step(fn=fn):
            for q in params:
                q.grad = None
            xin.grad = None
            with torch.autocast(xin.device.type, dtype=torch.bfloat16):
                y = fn(xin)
            y.backward(dy)
            if keep is not None:  # --new-outputs: nothing of this step is freed for the next one's
                keep.append((y, xin.grad, [q.grad for q in params]))

        rows[f"layer forward + backward: {name}"] = host_us(step, calls)
        if keep is not None:
            keep.clear()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--new-outputs", action="store_true",
                   help="keep every call's results alive, so that each call's outputs are at new addresses")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "op-host-cost.json"))
    a = p.parse_args(argv)
    import torch

    stages()  # registers the operators
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(a.tokens, D, device="cuda", generator=g).bfloat16()
    dy = torch.randn(a.tokens, D, device="cuda", generator=g).bfloat16()
    w1s = (0.02 * torch.randn(D, H, device="cuda", generator=g))  # Conv1D storage [in, out], fp32 master
    w2s = (0.02 * torch.randn(H, D, device="cuda", generator=g))
    b1, b2 = torch.zeros(H, device="cuda"), torch.zeros(D, device="cuda")
    w1, w2 = w1s.t(), w2s.t()  # seen as [out, in]
    fwd = torch.ops.cupyffn.forward
    bwd = torch.ops.cupyffn.backward
    saved = fwd(x, w1, w2, b1, b2, None, "all")
    y, z, t, gl, w1c, w2c = saved

    keep = [] if a.new_outputs else None

    def forward():
        r = fwd(x, w1, w2, b1, b2, None, "all")
        if keep is not None:
            keep.append(r)

    def backward():
        r = bwd(dy, x, w1, w2, z, None, gl, None, True, True, True, w1c, w2c)
        if keep is not None:
            keep.append(r)

    rows = {}
    for name, run in (("forward op", forward), ("backward op", backward)):
        rows[name] = host_us(run, a.calls)
        if keep is not None:
            keep.clear()
    per_call = {}
    for name, run in (("forward op", forward), ("backward op", backward)):
        spent = collections.defaultdict(float)
        unwrap = wrap(spent)
        try:
            for _ in range(10):
                run()
            spent.clear()
            torch.cuda.synchronize()
            for _ in range(a.calls):
                torch.cuda.synchronize()
                run()
        finally:
            unwrap()
            if keep is not None:
                keep.clear()
        per_call[name] = {k: round(1e6 * v / a.calls, 1) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
    # torch eager's layer, same tensors: addmm, GELU, addmm with autocast's casts, and its autograd backward
    params = [w1s.clone().requires_grad_(), w2s.clone().requires_grad_(), b1.clone().requires_grad_(),
              b2.clone().requires_grad_()]

    def torch_forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = torch.nn.functional.gelu(torch.addmm(params[2], x, params[0]), approximate="tanh")
            return torch.addmm(params[3], h, params[1])

    out = torch_forward()
    rows["torch eager forward"] = host_us(torch_forward, a.calls)

    def torch_backward():
        for q in params:
            q.grad = None
        out.backward(dy, retain_graph=True)

    rows["torch eager backward"] = host_us(torch_backward, a.calls)
    rows.update(layer_rows(x, dy, w1s, w2s, b1, b2, a.calls, keep))
    print(f"T = {a.tokens}, D = {D}, H = {H}: host us per call (median, queue drained)")
    for k, v in rows.items():
        print(f"  {k:<24} {v:8.1f}")
    for name, timed in per_call.items():
        print(f"{name}: inclusive host us per call, timers on")
        for k, v in timed.items():
            print(f"  {k:<40} {v:8.1f}")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": a.tokens,
              "new_outputs": a.new_outputs, "commit": os.environ.get("CUPYFFN_GIT_COMMIT"), "host_us": rows, "stages_us": per_call}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
