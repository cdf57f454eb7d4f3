"""GPU: the functions' weight gradients stored as [in, out] weights are (transformers' Conv1D; decision 061) on the
cuBLASLt route: given in that layout, accumulated into, or allocated so when the other one is given; the values
those of C-contiguous gradients (the same products, operands swapped) and of float64, outputs NaN-poisoned first."""

import pytest

import cupyffn

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
pytest.importorskip("ml_dtypes")
from test_gpu_lt import DT, dev, host, make, nan_like, reference, rel  # noqa: E402  (tests/ is on sys.path)

T, D, H = 192, 64, 256


def transposed(a):
    """`a` as the transpose view of an [in, out] copy of it (what Conv1D stores)."""
    return cupy.ascontiguousarray(a.T).T


def stored_as_weights(shape, dtype, fill=None):
    """An [in, out] gradient seen as `shape` (NaN-filled, or `fill`'s values)."""
    a = nan_like(shape[::-1], dtype).T
    if fill is not None:
        a[...] = fill
    return a


@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
def test_gradients_in_the_weights_layout(weights):
    x, dy, w1, w2, b1, b2 = make(T, D, H, "bfloat16", 11, weights=weights)
    xd, dyd, w1d, w2d, b1d, b2d = dev(x, dy, w1, w2, b1, b2)
    w1t, w2t = transposed(w1d), transposed(w2d)
    f = cupyffn.gelu_ffn_forward(xd, w1t, w2t, bias1=b1d, bias2=b2d)
    args = (dyd, xd, w1t, w2t, f.linear1_out, None, f.gelu_out)
    plain = cupyffn.gelu_ffn_backward(*args, need_bias_grads=True)
    out = [nan_like((T, D), "bfloat16"), stored_as_weights((H, D), "float32"), stored_as_weights((D, H), "float32"),
           nan_like((H,), "float32"), nan_like((D,), "float32")]
    got = cupyffn.gelu_ffn_backward(*args, need_bias_grads=True, out=out)
    assert got.grad_weight1 is out[1] and got.grad_weight2 is out[2]
    _, want = reference(x, dy, *(host(a.astype(DT["bfloat16"])) for a in (w1, w2)), b1, b2)  # as the GEMMs see them
    for name, a, b, w in zip(("dx", "dw1", "dw2", "db1", "db2"), got, plain, want):
        assert rel(a, host(b)) <= 1e-6, name  # the same products, the operands swapped
        assert rel(a, w) <= 2e-2, name
    # accumulate=True adds into the [in, out] storage; the bias gradients too
    base = [None] + [stored_as_weights(s, "float32", fill=cupy.float32(0.25)) for s in ((H, D), (D, H))] + \
        [cupy.full((H,), 0.5, cupy.float32), cupy.full((D,), 0.5, cupy.float32)]
    acc = cupyffn.gelu_ffn_backward(*args, need_bias_grads=True, accumulate=True, out=base)
    for a, b, extra in zip(acc[1:], got[1:], (0.25, 0.25, 0.5, 0.5)):
        assert rel(a, host(b) + extra) <= 1e-6
    # only grad_weight1 given in the weights' layout: grad_weight2 is allocated in it too
    one = cupyffn.gelu_ffn_backward(*args, out=[None, stored_as_weights((H, D), "float32"), None])
    assert not one.grad_weight2.flags.c_contiguous and one.grad_weight2.T.flags.c_contiguous
    assert rel(one.grad_weight2, host(plain.grad_weight2)) <= 1e-6
