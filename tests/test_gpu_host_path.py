"""torch tensors in the functional API, read by pointer (no DLPack import), on the GPU: results bit-for-bit those of
the same call on CuPy arrays, outputs written (NaN-poisoned first), strided views, dtype and layout errors naming the
argument, one validation per signature, and the stream ordering the DLPack handshake gave: work torch has queued on
its current stream is done before cupyffn reads (docs/decisions/048-dlpack-free-import.md; CPU side:
tests/test_host_path.py)."""

import numpy
import pytest

import cupyffn
from cupyffn.api import validate as _validate
from cupyffn import workloads as W

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

LEAD, D, H = (2, 150), 256, 1024
PRECISIONS = ("tf32", "bf16x3", "fp16+fp8")


@pytest.fixture(autouse=True)
def _cuda_torch():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    cupy.cuda.Device().synchronize()
    torch.cuda.synchronize()
    yield
    cupy.cuda.Device().synchronize()
    torch.cuda.synchronize()


def _inputs(seed, lead=LEAD):
    inputs = W.make_inputs(lead, D, H, xp=cupy, seed=seed)
    cupy.cuda.Device().synchronize()
    return [inputs[n] for n in W.INPUT_NAMES]


def _as_torch(arrays):
    """torch copies (own memory) of CuPy arrays, made and finished before the call."""
    out = [torch.from_dlpack(a).clone() for a in arrays]
    torch.cuda.synchronize()
    return out


def _nan_torch(shapes):
    return [torch.full(tuple(s), float("nan"), device="cuda") for s in shapes]


def _nan_cupy(shapes):
    return [cupy.full(tuple(s), numpy.nan, dtype=cupy.float32) for s in shapes]


def _out_shapes(arrays):
    return [arrays[1].shape, arrays[2].shape, arrays[3].shape]


def _bits(a):
    a = a if isinstance(a, cupy.ndarray) else cupy.from_dlpack(a)
    return cupy.ascontiguousarray(a).view(cupy.uint32)


def assert_same_bits(got, want, label=""):
    g, w = _bits(got), _bits(want)
    assert g.shape == w.shape, label
    assert not bool(cupy.isnan(cupy.from_dlpack(got) if not isinstance(got, cupy.ndarray) else got).any()), label
    assert bool((g == w).all()), f"{label}: {int((g != w).sum())} of {g.size} elements differ"


# ---------------------------------------------------------------------------------------------
# results: bit-for-bit the CuPy path's
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", PRECISIONS)
def test_functional_torch_equals_cupy_bit_for_bit(precision):
    arrays = _inputs(1)
    tensors = _as_torch(arrays)
    want = cupyffn.gelu_ffn_backward(*arrays, precision=precision, out=_nan_cupy(_out_shapes(arrays)))
    for rep in range(3):  # the first call validates; the others reuse the validated call
        outs = _nan_torch(_out_shapes(arrays))
        got = cupyffn.gelu_ffn_backward(*tensors, precision=precision, out=outs)
        assert all(g is o for g, o in zip(got, outs))  # the out= tensors themselves come back
        torch.cuda.synchronize()
        for g, w, label in zip(got, want, W.OUTPUT_NAMES):
            assert_same_bits(g, w, f"{precision} rep {rep} {label}")


def test_functional_torch_without_out_and_memory_mode():
    arrays = _inputs(2)
    tensors = _as_torch(arrays)
    want = cupyffn.gelu_ffn_backward(*arrays[:5], precision="tf32")
    got = cupyffn.gelu_ffn_backward(*tensors[:5], precision="tf32")  # memory mode, outputs from CuPy's pool
    for g, w, label in zip(got, want, W.OUTPUT_NAMES):
        assert isinstance(g, cupy.ndarray)
        assert_same_bits(g, w, label)


def test_plan_call_with_torch_tensors():
    arrays = _inputs(3)
    tensors = _as_torch(arrays)
    T = arrays[0].shape[0] * arrays[0].shape[1]
    plan = cupyffn.GeluFFNBackward(T, D, H, precision="tf32")
    try:
        want = plan(*arrays, out=_nan_cupy(_out_shapes(arrays)))
        for _ in range(2):
            outs = _nan_torch(_out_shapes(arrays))
            got = plan(*tensors, out=outs)
            torch.cuda.synchronize()
            for g, w, label in zip(got, want, W.OUTPUT_NAMES):
                assert_same_bits(g, w, label)
    finally:
        plan.close()


def test_forward_with_torch_tensors():
    arrays = _inputs(4)
    x, w1, w2 = arrays[1], arrays[2], arrays[3]
    tx, tw1, tw2 = _as_torch([x, w1, w2])
    shapes = [x.shape] + [x.shape[:-1] + (H,)] * 3
    want = cupyffn.gelu_ffn_forward(x, w1, w2, precision="tf32", out=_nan_cupy(shapes))
    outs = _nan_torch(shapes)
    got = cupyffn.gelu_ffn_forward(tx, tw1, tw2, precision="tf32", out=outs)
    torch.cuda.synchronize()
    for g, w, o in zip(got, want, outs):
        assert g is o
        assert_same_bits(g, w)


def test_torch_layer_backward_equals_cupy_bit_for_bit():
    import cupyffn.torch as ct

    arrays = _inputs(5)
    tensors = _as_torch(arrays)
    want = cupyffn.gelu_ffn_backward(*arrays, precision="tf32")
    for _ in range(2):
        got = ct.gelu_ffn_backward(*tensors, precision="tf32")
        torch.cuda.synchronize()
        for g, w, label in zip(got, want, W.OUTPUT_NAMES):
            assert_same_bits(g, w, label)


def test_strided_torch_views():
    """Slices of wider tensors and 3-D activations: read in place (no copy), as the same CuPy views are."""
    arrays = _inputs(6)
    tensors = _as_torch(arrays)
    # hidden_states and grad_output as columns [0, D) of [..., 3 D] buffers; linear1_out as rows of a taller one
    wide = []
    for i in (0, 1):
        buf = torch.full(LEAD + (3 * D,), float("nan"), device="cuda")
        buf[..., :D] = tensors[i]
        wide.append(buf[..., :D])
    tall = torch.full((LEAD[0] + 1,) + LEAD[1:] + (H,), float("nan"), device="cuda")
    tall[1:] = tensors[4]
    # weight2 as a column slice [:, :H] of a [D, 2 H] buffer
    w2buf = torch.full((D, 2 * H), float("nan"), device="cuda")
    w2buf[:, :H] = tensors[3]
    strided = [wide[0], wide[1], tensors[2], w2buf[:, :H], tall[1:], tensors[5], tensors[6]]
    assert not strided[0].is_contiguous() and not strided[3].is_contiguous()
    torch.cuda.synchronize()
    views = [cupy.from_dlpack(t) for t in strided]  # the same memory as CuPy arrays
    want = cupyffn.gelu_ffn_backward(*views, precision="tf32", out=_nan_cupy(_out_shapes(arrays)))
    base = cupyffn.gelu_ffn_backward(*arrays, precision="tf32")
    for _ in range(2):
        outs = _nan_torch(_out_shapes(arrays))
        got = cupyffn.gelu_ffn_backward(*strided, precision="tf32", out=outs)
        torch.cuda.synchronize()
        for g, w, b, label in zip(got, want, base, W.OUTPUT_NAMES):
            assert_same_bits(g, w, label)
            err = W.relative_l2(cupy.from_dlpack(g), b, xp=cupy)
            assert err <= 1e-5, f"{label}: {err}"  # the strided call computes the contiguous call's gradients


def test_no_dlpack_import_for_float32_cuda_tensors(monkeypatch):
    arrays = _inputs(7)
    tensors = _as_torch(arrays)
    outs = _nan_torch(_out_shapes(arrays))

    def refuse(*a, **k):
        raise AssertionError("cupy.from_dlpack was called")

    monkeypatch.setattr(cupy, "from_dlpack", refuse)
    cupyffn.gelu_ffn_backward(*tensors, precision="tf32", out=outs)
    cupyffn.gelu_ffn_backward(*tensors, precision="tf32", out=outs)
    torch.cuda.synchronize()
    assert not any(bool(torch.isnan(o).any()) for o in outs)


def test_one_validation_per_configuration(monkeypatch):
    """A call is validated once per configuration (its arrays' shapes, strides, dtypes, devices, alignment; not their
    addresses): also the process's first call with torch tensors is remembered, and new outputs of the same
    configuration, a training step's, are not validated again. (The cache is emptied first: an earlier test's
    remembered call may rightly have this configuration.)"""
    cupyffn.clear_cache()
    arrays = _inputs(8)
    tensors = _as_torch(arrays)
    outs = _nan_torch(_out_shapes(arrays))
    cupyffn.gelu_ffn_backward(*tensors, precision="tf32", out=outs)  # validates: a new signature
    count = [0]
    real = _validate.validate

    def counting(*a, **k):
        count[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(_validate, "validate", counting)
    for _ in range(5):
        cupyffn.gelu_ffn_backward(*tensors, precision="tf32", out=outs)
    assert count[0] == 0
    reference = [o.clone() for o in outs]
    for _ in range(3):  # other output memory: no validation, the same results
        other = _nan_torch(_out_shapes(arrays))
        cupyffn.gelu_ffn_backward(*tensors, precision="tf32", out=other)
        assert all(bool((_bits(a) == _bits(b)).all()) for a, b in zip(other, reference))
    assert count[0] == 0


# ---------------------------------------------------------------------------------------------
# errors: as clear as through DLPack, naming the argument
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,name", [(torch.float16, "float16"), (torch.float64, "float64"),
                                        (torch.bfloat16, None)])
@pytest.mark.parametrize("index", [0, 2, 6])
def test_wrong_dtype_names_the_argument(dtype, name, index):
    arrays = _inputs(9)
    tensors = _as_torch(arrays)
    tensors[index] = tensors[index].to(dtype)
    arg = W.INPUT_NAMES[index]
    if index == 0:  # grad_output's dtype is the activation dtype: a 16-bit one makes float32 hidden_states wrong
        want = {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype)
        match = (rf"^hidden_states must be {want} \(grad_output's dtype\); got float32$" if want else
                 r"^grad_output must be float32 \(or bfloat16 / float16: docs/precisions.md\); got float64$")
        with pytest.raises(TypeError, match=match):
            cupyffn.gelu_ffn_backward(*tensors, precision="tf32")
        return
    # float16 / float64 as DLPack always reported them; bfloat16 (no NumPy dtype) through DLPack's own message
    match = rf"^{arg} must be float32; got {name}$" if name else rf"^{arg} "
    with pytest.raises(TypeError, match=match):
        cupyffn.gelu_ffn_backward(*tensors, precision="tf32")


def test_wrong_dtype_out_names_the_entry():
    arrays = _inputs(10)
    tensors = _as_torch(arrays)
    outs = _nan_torch(_out_shapes(arrays))
    outs[1] = outs[1].half()
    with pytest.raises(TypeError, match=r"^out\[1\] \(grad_weight1\) must be float32; got float16$"):
        cupyffn.gelu_ffn_backward(*tensors, precision="tf32", out=outs)


def test_unreadable_layout_and_non_contiguous_out():
    arrays = _inputs(11)
    tensors = _as_torch(arrays)
    bad = list(tensors)
    bad[2] = tensors[2].t().contiguous().t()  # weight1 transposed in memory: last dimension not unit-stride
    with pytest.raises(ValueError, match=r"^weight1 has strides \(4, \d+\) \(bytes\) for shape"):
        cupyffn.gelu_ffn_backward(*bad, precision="tf32")
    outs = _nan_torch(_out_shapes(arrays))
    outs[2] = torch.full((D, 2 * H), float("nan"), device="cuda")[:, :H]
    with pytest.raises(ValueError, match=r"^out\[2\] \(grad_weight2\) must be C-contiguous"):
        cupyffn.gelu_ffn_backward(*tensors, precision="tf32", out=outs)


# ---------------------------------------------------------------------------------------------
# stream ordering: what torch queued on its current stream is done before cupyffn reads
# ---------------------------------------------------------------------------------------------
def _long_kernel():
    """Some tens of milliseconds of GPU work on torch's current stream (plain fp32 matmuls)."""
    a = torch.randn(8192, 8192, device="cuda")
    for _ in range(3):
        a = a @ a
        a = a / a.abs().amax()
    return a


@pytest.mark.parametrize("entry", ["functional", "plan", "forward"])
@pytest.mark.parametrize("cupyffn_stream", ["explicit", "current"])
def test_torch_side_stream_work_is_ordered_before_the_call(entry, cupyffn_stream):
    """torch writes new inputs on a side stream, behind a long kernel, just before the call; cupyffn runs on
    another stream. Its results must be those of the new inputs, every repetition (the first validates, the
    next reuse the validated call)."""
    old = _inputs(12)
    T = old[0].shape[0] * old[0].shape[1]
    tensors = _as_torch(old)
    s = cupy.cuda.Stream(non_blocking=True)
    plan = cupyffn.GeluFFNBackward(T, D, H, precision="tf32") if entry == "plan" else None
    try:
        for rep in range(3):
            new = _inputs(100 + rep)
            staged = _as_torch(new)  # the new values, already in torch memory (finished)
            if entry == "forward":
                shapes = [new[1].shape] + [new[1].shape[:-1] + (H,)] * 3
                want = cupyffn.gelu_ffn_forward(new[1], new[2], new[3], precision="tf32", out=_nan_cupy(shapes))
                outs = _nan_torch(shapes)
            else:
                want = cupyffn.gelu_ffn_backward(*new, precision="tf32", out=_nan_cupy(_out_shapes(new)))
                outs = _nan_torch(_out_shapes(new))
            cupy.cuda.Device().synchronize()
            torch.cuda.synchronize()
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                _long_kernel()
                for t, v in zip(tensors, staged):
                    t.copy_(v)  # queued behind the long kernel on torch's current stream
                if entry == "forward":
                    args = (tensors[1], tensors[2], tensors[3])
                    kw = dict(precision="tf32", out=outs)
                else:
                    args, kw = tuple(tensors), dict(out=outs)
                    if entry == "functional":
                        kw["precision"] = "tf32"
                if cupyffn_stream == "explicit":
                    kw["stream"] = s
                    run = (cupyffn.gelu_ffn_forward if entry == "forward"
                           else plan if entry == "plan" else cupyffn.gelu_ffn_backward)
                    run(*args, **kw)
                else:
                    with s:  # CuPy's current stream: s
                        run = (cupyffn.gelu_ffn_forward if entry == "forward"
                               else plan if entry == "plan" else cupyffn.gelu_ffn_backward)
                        run(*args, **kw)
            s.synchronize()
            side.synchronize()
            for g, w in zip(outs, want):
                assert_same_bits(g, w, f"{entry} rep {rep}")
            del staged
    finally:
        if plan is not None:
            plan.close()


def test_same_stream_needs_no_wait(monkeypatch):
    """cupyffn on torch's current stream (what the torch layer does): stream order holds, no event."""
    from cupyffn.core import arrays as _arrays

    waits = []
    monkeypatch.setattr(_arrays, "_wait", lambda *a: waits.append(a))
    arrays = _inputs(13)
    tensors = _as_torch(arrays)
    from cupyffn.frameworks.torch_ops import cuda_stream

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        s = cuda_stream(torch.cuda.current_device())
        assert s.ptr == side.cuda_stream
        for _ in range(2):
            cupyffn.gelu_ffn_backward(*tensors, precision="tf32", out=_nan_torch(_out_shapes(arrays)), stream=s)
    side.synchronize()
    assert waits == []


# ---------------------------------------------------------------------------------------------
# CUDA graphs: torch tensors in a capture
# ---------------------------------------------------------------------------------------------
def _refill(tensors, seed):
    new = _inputs(seed)
    for t, v in zip(tensors, new):
        t.copy_(torch.from_dlpack(v))
    torch.cuda.synchronize()
    return new


def test_torch_cuda_graph_with_torch_tensors():
    """torch.cuda.graph: torch's current stream is the capture stream and cupyffn is given it: no wait is made."""
    from cupyffn.core import views as _views

    arrays = _inputs(14)
    tensors = _as_torch(arrays)
    outs = _nan_torch(_out_shapes(arrays))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm-up (builds the plan) on a side stream
        cupyffn.gelu_ffn_backward(*tensors, precision="tf32", out=outs,
                                  stream=_views.external_stream(int(side.cuda_stream), torch.cuda.current_device()))
    side.synchronize()
    g = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    cap = _views.external_stream(int(capture.cuda_stream), torch.cuda.current_device())
    with torch.cuda.graph(g, stream=capture):
        cupyffn.gelu_ffn_backward(*tensors, precision="tf32", out=outs, stream=cap)
    try:
        for step in range(2):
            new = _refill(tensors, 200 + step)
            want = cupyffn.gelu_ffn_backward(*new, precision="tf32")
            for o in outs:
                o.fill_(float("nan"))
            torch.cuda.synchronize()
            g.replay()
            torch.cuda.synchronize()
            for o, w, label in zip(outs, want, W.OUTPUT_NAMES):
                assert_same_bits(o, w, f"replay {step} {label}")
    finally:
        del g
        cupyffn.release_captured_plans()


def test_cupy_capture_with_torch_on_its_default_stream():
    """CuPy captures cupyffn's stream while torch's current stream is its default one (not capturing): an event
    recorded outside a capture cannot be waited on inside it, so none is; the graph replays correctly."""
    arrays = _inputs(15)
    tensors = _as_torch(arrays)
    outs = _nan_torch(_out_shapes(arrays))
    s = cupy.cuda.Stream(non_blocking=True)
    cupyffn.gelu_ffn_backward(*tensors, precision="tf32", out=outs, stream=s)  # warm-up: the plan, one wait
    s.synchronize()
    s.begin_capture()
    try:
        cupyffn.gelu_ffn_backward(*tensors, precision="tf32", out=outs, stream=s)
    finally:
        graph = s.end_capture()
    try:
        new = _refill(tensors, 300)
        want = cupyffn.gelu_ffn_backward(*new, precision="tf32")
        for o in outs:
            o.fill_(float("nan"))
        torch.cuda.synchronize()
        graph.launch(stream=s)
        s.synchronize()
        for o, w, label in zip(outs, want, W.OUTPUT_NAMES):
            assert_same_bits(o, w, label)
    finally:
        del graph
        cupyffn.release_captured_plans()
