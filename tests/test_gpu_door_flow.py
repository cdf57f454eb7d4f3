"""The door's flow on the GPU itself (issue 59, item 9; tests/test_door_gpu_route.py runs the same checks on the CPU
with the device stubbed): a first call enters validate, route and execute once each; a repeated call neither
validates nor routes again, with CuPy arrays and with torch tensors."""

import pytest

import cupyffn
from cupyffn import workloads as W

from door_trace import trace

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

T, D, H = 256, 256, 1024


def _follows(ptr):
    def carries(obj):
        if type(obj) is int:
            return obj == ptr
        data = getattr(obj, "data", None)
        return getattr(data, "ptr", None) == ptr or getattr(obj, "ptr", None) == ptr or (
            hasattr(obj, "data_ptr") and callable(obj.data_ptr) and obj.data_ptr() == ptr)

    return carries


def _flows(run, ptr, out, new_out):
    """The flows of run(out) twice, then of run(new_out) (a training step's new outputs)."""
    return [trace(lambda: run(o), _follows(ptr)) for o in (out, out, new_out)]


def _check(flows):
    first = flows[0]
    for stage in ("api/validate.py", "api/routes.py", "api/execute.py"):
        assert first.entries[stage] == 1, (stage, first.files)
    assert first.functions["api/validate.py:validate"] == 1 and first.functions["api/routes.py:route"] == 1
    for again in flows[1:]:
        assert again.entries["api/validate.py"] == 1 and again.entries["api/execute.py"] == 1, again.files
        assert again.functions["api/validate.py:validate"] == 0 and "api/routes.py" not in again.entries


@pytest.mark.parametrize("precision", ["tf32", "bf16x3"])
def test_cupy_backward(precision):
    cupyffn.clear_cache()
    inputs = W.make_inputs((T,), D, H, xp=cupy, seed=1)
    args = [inputs[n] for n in W.INPUT_NAMES]
    out, new_out = ([cupy.empty_like(args[1]), cupy.empty_like(args[2]), cupy.empty_like(args[3])] for _ in range(2))
    flows = _flows(lambda o: cupyffn.gelu_ffn_backward(*args, precision=precision, out=o), args[0].data.ptr, out,
                   new_out)
    _check(flows)
    cupy.testing.assert_array_equal(out[0], new_out[0])


def test_torch_bf16_backward_and_forward():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    cupyffn.clear_cache()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    w1 = 0.05 * torch.randn(H, D, device="cuda", generator=g)
    w2 = 0.05 * torch.randn(D, H, device="cuda", generator=g)
    outs = [[torch.empty(T, n, device="cuda", dtype=torch.bfloat16) for n in (D, H, H)] for _ in range(2)]
    y, z, g_out = outs[0]
    _check(_flows(lambda o: cupyffn.gelu_ffn_forward(x, w1, w2, out=[o[0], o[1], None, o[2]]), x.data_ptr(), *outs))
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    grads = [[torch.empty(T, D, device="cuda", dtype=torch.bfloat16), torch.empty_like(w1), torch.empty_like(w2)]
             for _ in range(2)]
    _check(_flows(lambda o: cupyffn.gelu_ffn_backward(dy, x, w1, w2, z, None, g_out, out=o), dy.data_ptr(), *grads))
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(*grads))
