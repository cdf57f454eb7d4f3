"""The configurations of the torch layer whose training step the GPU capture tests record (tests/test_gpu_capture_
torch_graph.py: torch.cuda.graph; tests/test_gpu_capture_reduce_overhead.py: torch.compile(mode="reduce-overhead")),
the history of other calls each capture follows, and the float64 reference a replay is checked against. Imported by
those tests (tests/ is on sys.path under pytest's rootdir conftest)."""

import math

DIM, HIDDEN = 128, 512
LEAD = (2, 64)

# id -> (parameter dtype, autocast dtype or None, precision or None, Conv1D [in, out] weights)
CONFIGS = {
    "float32": ("float32", None, None, False),
    "float32-tf32": ("float32", None, "tf32", False),
    "float32-conv1d": ("float32", None, None, True),
    "bf16-fp32-master": ("float32", "bfloat16", None, False),
    "fp16-fp32-master": ("float32", "float16", None, False),
    "bf16-weights": ("bfloat16", None, None, False),
    "fp16-weights": ("float16", None, None, False),
    "bf16-conv1d": ("float32", "bfloat16", None, True),
}


def make_layer(torch, config, bias, seed=0):
    """A fresh GeluFFN of `config` on CUDA (Conv1D: built from two [in, out] layers, used as stored)."""
    import cupyffn.torch as ct

    dtype, _, precision, conv1d = CONFIGS[config]
    dtype = getattr(torch, dtype)
    torch.manual_seed(seed)
    if not conv1d:
        return ct.GeluFFN(DIM, HIDDEN, bias=bias, precision=precision, device="cuda", dtype=dtype)

    class Conv1D(torch.nn.Module):
        """transformers' Conv1D layout (weight [in, out], y = x @ weight + bias), by the name replace_mlps reads."""

        def __init__(self, n_in, n_out):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(n_in, n_out, device="cuda", dtype=dtype) / math.sqrt(n_in))
            self.bias = torch.nn.Parameter(0.1 * torch.randn(n_out, device="cuda", dtype=dtype)) if bias else None

    return ct.GeluFFN.from_linears(Conv1D(DIM, HIDDEN), Conv1D(HIDDEN, DIM), precision=precision)


def step(torch, ffn, config, x, r):
    """One training step's forward and backward: the layer (under the config's autocast) and sum(y * r)."""
    autocast = CONFIGS[config][1]
    with torch.autocast("cuda", dtype=getattr(torch, autocast or "float32"), enabled=autocast is not None):
        y = ffn(x)
    (y.float() * r).sum().backward()
    return y


def params(ffn):
    """(weight1 [H, D], bias1, weight2 [D, H], bias2) as the block uses them (Conv1D's transposed)."""
    w1, w2 = (ffn.weight1.t(), ffn.weight2.t()) if ffn.weights_transposed else (ffn.weight1, ffn.weight2)
    return w1, ffn.bias1, w2, ffn.bias2


def grads(ffn, x):
    """The gradients a step leaves: x's, then weight1, bias1, weight2, bias2 (as `params`; None where no bias)."""
    w1, b1, w2, b2 = (ffn.weight1.grad, ffn.bias1.grad if ffn.bias1 is not None else None, ffn.weight2.grad,
                      ffn.bias2.grad if ffn.bias2 is not None else None)
    if ffn.weights_transposed:
        w1, w2 = w1.t(), w2.t()
    return [x.grad, w1, b1, w2, b2]


def reference(torch, ffn, config, x, r):
    """float64 autograd of the block on the layer's current parameter values (rounded to the activation dtype
    where the config computes in 16 bits, as the layer's GEMMs multiply them): output, then `grads`' order."""
    autocast = CONFIGS[config][1]
    act = getattr(torch, autocast) if autocast else ffn.weight1.dtype

    def value(t):
        if t is None:
            return None
        t = t.detach()
        return (t.to(act) if act != torch.float32 else t).double().requires_grad_()

    xd = value(x)
    p = [value(t) for t in params(ffn)]
    F = torch.nn.functional
    y = F.linear(F.gelu(F.linear(xd, p[0], p[1]), approximate="tanh"), p[2], p[3])
    (y * r.double()).sum().backward()
    return [y, xd.grad] + [None if t is None else t.grad for t in p]


def bound(config):
    """Relative L2 bound against `reference`: the precision's contract in float32, 16-bit rounding otherwise."""
    import cupyffn

    dtype, autocast, precision, _ = CONFIGS[config]
    if autocast or dtype != "float32":
        return 2e-2
    return cupyffn.PRECISIONS[precision or cupyffn.DEFAULT_PRECISION].contract


def rel(a, ref):
    a, ref = a.detach().double(), ref.detach().double()
    assert bool(a.isfinite().all()), "not finite: an output the replay did not write, or a wrong value"
    return float((a - ref).norm() / ref.norm())


def check(torch, ffn, config, x, r, y):
    """y and every gradient against the float64 reference, at `bound`."""
    b = bound(config)
    for name, got, want in zip(("y", "dx", "dw1", "db1", "dw2", "db2"), [y] + grads(ffn, x),
                               reference(torch, ffn, config, x, r)):
        if want is None:
            continue
        assert rel(got, want) <= b, (config, name, rel(got, want), b)


def history(torch, ffn, config):
    """What a process does before it captures, on the legacy default stream: eager steps of this very layer (its
    AccumulateGrad nodes are made there; each step's graph is freed before the capture), a step of another layer
    of another shape and configuration, torch's functional gelu_ffn, and CuPy calls of the functions (a float32
    backward three times on the same arrays: the engine's own graph cache captures it)."""
    import cupy

    import cupyffn
    import cupyffn.torch as ct
    from cupyffn import workloads as W

    for seed in range(2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(*LEAD, DIM, device="cuda", generator=g, requires_grad=True)
        step(torch, ffn, config, x, torch.randn(*LEAD, DIM, device="cuda", generator=g))
    other = ct.GeluFFN(64, 256, bias=True, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        other(torch.randn(3, 64, device="cuda")).float().sum().backward()
    xs = torch.randn(5, 64, device="cuda", requires_grad=True)
    ct.gelu_ffn(xs, other.weight1, other.weight2).sum().backward()
    inputs = W.make_inputs((96,), 64, 256, xp=cupy, seed=3)
    arrays = [inputs[n] for n in W.INPUT_NAMES]
    for _ in range(3):
        cupyffn.gelu_ffn_backward(*arrays, precision="tf32")
    cupyffn.gelu_ffn_forward(inputs["hidden_states"], inputs["weight1"], inputs["weight2"])
    torch.cuda.synchronize()
    ffn.zero_grad(set_to_none=True)


def fresh_inputs(torch, seed):
    g = torch.Generator(device="cuda").manual_seed(1000 + seed)
    return (torch.randn(*LEAD, DIM, device="cuda", generator=g), torch.randn(*LEAD, DIM, device="cuda", generator=g))


def nudge(torch, ffn, seed):
    """An optimizer's in-place update of every parameter: a replay must read the current values."""
    g = torch.Generator(device="cuda").manual_seed(2000 + seed)
    with torch.no_grad():
        for p in ffn.parameters():
            p.add_(0.01 * torch.randn(p.shape, device="cuda", generator=g).to(p.dtype))
