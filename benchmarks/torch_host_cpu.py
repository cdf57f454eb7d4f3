"""Host cost per call of cupyffn.torch's layers and their pieces on the CPU, with cupyffn's own calls stubbed
out (so only the torch-side cost is timed: dispatch, views, allocations, autograd).

    python -m benchmarks.torch_host_cpu

Rows are interleaved (round robin) and the minimum over rounds is reported, to resist a noisy host. The
CUDA view rows time a cache hit of cupyffn/core/views.py (the GPU path's per-tensor cost) with a placeholder entry.
Not a GPU measurement: benchmarks.layers measures the real calls on the GPU.
"""
import time

import torch

import cupyffn.torch as ct
from cupyffn.api import functional
from cupyffn.frameworks import torch_ops


def main():
    saved = functional.gelu_ffn_backward, functional.gelu_ffn_forward
    functional.gelu_ffn_backward = lambda *a, out=None, **k: out
    functional.gelu_ffn_forward = lambda *a, out=None, **k: out
    try:
        _measure()
    finally:
        functional.gelu_ffn_backward, functional.gelu_ffn_forward = saved


def _measure():
    ROUNDS, CALLS = 40, 200
    T, D, H = 16, 32, 64
    g = torch.Generator().manual_seed(0)
    def r(*s): return torch.randn(*s, generator=g)
    dy, x, w1, w2, z, t, gg = r(T, D), r(T, D), r(H, D), r(D, H), r(T, H), r(T, H), r(T, H)
    args = (dy, x, w1, w2, z, t, gg)

    rows = {}
    op = torch.ops.cupyffn.backward
    rows["op torch.ops.cupyffn.backward"] = lambda: op(*args, "bf16x3", True, True, False)
    body = getattr(torch_ops.backward_op, "_init_fn", None)  # the function custom_op wraps (torch-private name)
    if body is not None:
        rows["op body (custom_op's own function)"] = lambda: body(*args, "bf16x3", True, True, False)
    rows["backward_impl"] = lambda: torch_ops.backward_impl(*args, "bf16x3", True, True, False)
    rows["piece readable(x)"] = lambda: torch_ops.readable(x)
    rows["piece torch.empty([T,D])"] = lambda: torch.empty((T, D), dtype=torch.float32, device=x.device)
    rows["piece x.detach().numpy()"] = lambda: x.detach().numpy()
    rows["piece data_ptr+shape+stride+index"] = lambda: (x.data_ptr(), tuple(x.shape), x.stride(), x.device.index)
    rows["piece data_ptr+shape+stride (new)"] = lambda: (x.data_ptr(), x.shape, x.stride())
    from cupyffn.core import views as _views
    _views._views[(x.data_ptr(), tuple(x.shape), x.stride(), 0)] = object()  # placeholder: the hit path
    rows["piece CUDA view hit, old spelling"] = lambda: _views.float32_view(x.data_ptr(), tuple(x.shape), x.stride(),
                                                                         x.device.index or 0)
    rows["piece CUDA view hit, new spelling"] = lambda: _views.float32_view(x.data_ptr(), x.shape, x.stride(), 0)
    def call_ctx():
        with torch_ops.TorchDevice(x.device):
            pass
    rows["piece TorchDevice enter/exit (CPU)"] = call_ctx
    xs, w1s, w2s = (a.clone().requires_grad_() for a in (x, w1, w2))
    def layer_step():
        xs.grad = w1s.grad = w2s.grad = None
        torch.autograd.backward(ct.gelu_ffn(xs, w1s, w2s, "bf16x3"), dy)
    rows["layer gelu_ffn fwd + autograd bwd"] = layer_step
    rows["layer gelu_ffn fwd only"] = lambda: ct.gelu_ffn(xs, w1s, w2s, "bf16x3")
    y_keep = ct.gelu_ffn(xs, w1s, w2s, "bf16x3")
    rows["layer autograd.grad of a kept graph"] = lambda: torch.autograd.grad(y_keep, (xs, w1s, w2s), dy,
                                                                             retain_graph=True)
    def mm_step():
        xs.grad = w1s.grad = None
        torch.autograd.backward(xs @ w1s.t(), z)
    rows["ref: one torch mm fwd + autograd bwd"] = mm_step

    best = {k: float("inf") for k in rows}
    for _ in range(ROUNDS):
        for name, fn in rows.items():
            for _ in range(10): fn()
            a = time.perf_counter()
            for _ in range(CALLS): fn()
            best[name] = min(best[name], (time.perf_counter() - a) / CALLS * 1e6)
    for name, us in best.items():
        print(f"{name:40s} {us:8.2f} us")
    _views.clear()


if __name__ == "__main__":
    main()
