"""One set of shape, dtype and precision rules (cupyffn/core/rules.py): the same bad call gives the same error, type and
words, from the NumPy door (cupyffn.gelu_ffn_forward / gelu_ffn_backward), the JAX layer on tracers (cupyffn.jax under
jax.jit) and the torch operators on fake and meta tensors (their fake implementations, as torch.compile traces
them). CPU only: nothing here runs a kernel."""

import importlib

import numpy
import pytest

import cupyffn
from cupyffn.core import views

T, D, H = 4, 16, 32
GOOD = {"hidden_states": ((T, D), "float32"), "weight1": ((H, D), "float32"), "weight2": ((D, H), "float32"),
        "bias1": ((H,), "float32"), "bias2": ((D,), "float32")}
FORWARD = ("hidden_states", "weight1", "weight2", "bias1", "bias2")

#: (id, changes to GOOD, precision): each a bad forward
FORWARD_CASES = [
    ("int-activations", {"hidden_states": ((T, D), "int32")}, None),
    ("weight1-dtype", {"weight1": ((H, D), "bfloat16")}, None),
    ("weight2-dtype", {"weight2": ((D, H), "float16")}, None),
    ("bias-dtype", {"hidden_states": ((T, D), "bfloat16"), "bias1": ((H,), "bfloat16")}, None),
    ("16-bit-weights-of-another-dtype", {"hidden_states": ((T, D), "bfloat16"), "weight1": ((H, D), "float16")},
     None),
    ("weight1-shape", {"weight1": ((H, D + 1), "float32")}, None),
    ("weight1-no-rows", {"weight1": ((0, D), "float32")}, None),
    ("weight2-transposed", {"weight2": ((H, D), "float32")}, None),
    ("bias1-shape", {"bias1": ((D,), "float32")}, None),
    ("bias2-shape", {"bias2": ((H,), "float32")}, None),
    ("empty-dim", {"hidden_states": ((T, 0), "float32"), "weight1": ((H, 0), "float32"),
                   "weight2": ((0, H), "float32"), "bias2": ((0,), "float32")}, None),
    ("precision-with-16-bit", {"hidden_states": ((T, D), "bfloat16"), "weight1": ((H, D), "bfloat16"),
                               "weight2": ((D, H), "bfloat16"), "bias1": ((H,), "bfloat16"),
                               "bias2": ((D,), "bfloat16")}, "tf32"),
]

#: backward: (id, its arguments changed, its need flags): each a bad backward
BACKWARD = ("grad_output", "hidden_states", "weight1", "weight2", "linear1_out", "tanh_inner", "gelu_out")
GOOD_BACKWARD = {"grad_output": (T, D), "hidden_states": (T, D), "weight1": (H, D), "weight2": (D, H),
                 "linear1_out": (T, H), "tanh_inner": (T, H), "gelu_out": (T, H)}
BACKWARD_CASES = [
    ("hidden-states-shape", {"hidden_states": (T + 1, D)}, (True, True, False)),
    ("linear1-out-shape", {"linear1_out": (T, H + 1)}, (True, True, False)),
    ("gelu-out-shape", {"gelu_out": (T + 1, H)}, (True, True, False)),
    ("weight2-shape", {"weight2": (D + 1, H)}, (True, True, False)),
    ("nothing-needed", {}, (False, False, False)),
]


def spec(changes):
    return [dict(GOOD, **changes)[n] for n in FORWARD]


def numpy_arrays(specs):
    return [numpy.zeros(shape, views.numpy_dtype(dtype)) for shape, dtype in specs]


def error(fn, *args, **kwargs):
    with pytest.raises((TypeError, ValueError)) as e:
        fn(*args, **kwargs)
    return type(e.value), str(e.value)


def door_forward(specs, precision):
    x, w1, w2, b1, b2 = numpy_arrays(specs)
    return error(cupyffn.gelu_ffn_forward, x, w1, w2, bias1=b1, bias2=b2, precision=precision)


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    importlib.import_module("cupyffn.torch")  # registers torch.ops.cupyffn
    return torch


def torch_forward(torch, specs, precision, where):
    """The forward operator on fake tensors (FakeTensorMode, as torch.compile traces) or meta tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def tensors():
        device = "meta" if where == "meta" else "cpu"
        return [torch.empty(shape, dtype=getattr(torch, dtype), device=device) for shape, dtype in specs]

    if where == "meta":
        return error(torch.ops.cupyffn.forward, *tensors(), precision, "all")
    with FakeTensorMode():
        return error(torch.ops.cupyffn.forward, *tensors(), precision, "all")


@pytest.mark.parametrize("changes,precision", [pytest.param(c, p, id=i) for i, c, p in FORWARD_CASES])
def test_one_forward_error_everywhere(changes, precision, torch):
    specs = spec(changes)
    want = door_forward(specs, precision)
    assert torch_forward(torch, specs, precision, "fake") == want
    assert torch_forward(torch, specs, precision, "meta") == want


@pytest.mark.parametrize("changes,precision", [pytest.param(c, p, id=i) for i, c, p in FORWARD_CASES])
def test_one_forward_error_from_jax(changes, precision):
    jax = pytest.importorskip("jax", reason="jax is not installed")
    import cupyffn.jax as cj

    specs = spec(changes)
    x, w1, w2, b1, b2 = (jax.numpy.zeros(shape, dtype) for shape, dtype in specs)
    traced = jax.jit(lambda x, w1, w2, b1, b2: cj.gelu_ffn(x, w1, w2, precision, bias1=b1, bias2=b2))
    assert error(traced, x, w1, w2, b1, b2) == door_forward(specs, precision)


@pytest.mark.parametrize("changes,needs", [pytest.param(c, n, id=i) for i, c, n in BACKWARD_CASES])
def test_one_backward_error_everywhere(changes, needs, torch):
    shapes = [dict(GOOD_BACKWARD, **changes)[n] for n in BACKWARD]
    want = error(cupyffn.gelu_ffn_backward, *(numpy.zeros(s, numpy.float32) for s in shapes),
                 need_grad_hidden=needs[0], need_weight_grads=needs[1], need_bias_grads=needs[2])
    meta = [torch.empty(s, device="meta") for s in shapes]
    assert error(torch.ops.cupyffn.backward, *meta, None, *needs) == want
