"""Argument checking: every error, its type and its message; a rejected call changes nothing."""

import re
import types

import numpy
import pytest

import cupyffn
import cupyffn.core.arrays
from cupyffn import workloads as W

F32 = numpy.float32
T, D, H = 12, 64, 256
INPUT_NAMES = ("grad_output", "hidden_states", "weight1", "weight2", "linear1_out", "tanh_inner", "gelu_out")
OUTPUT_NAMES = ("grad_hidden_states", "grad_weight1", "grad_weight2")
SHAPES = {"grad_output": (T, D), "hidden_states": (T, D), "weight1": (H, D), "weight2": (D, H),
          "linear1_out": (T, H), "tanh_inner": (T, H), "gelu_out": (T, H)}
OUT_SHAPES = ((T, D), (H, D), (D, H))
#: what the first activation (grad_output) may be, in its dtype error
FIRST = r"float32 \(or bfloat16 / float16: docs/precisions\.md\)"


@pytest.fixture
def inp(rng):
    return W.make_inputs((T,), D, H, xp=numpy, seed=int(rng.integers(2 ** 31)))


def random_outs(rng):
    return [rng.standard_normal(s).astype(F32) for s in OUT_SHAPES]


def shape_re(shape):
    return re.escape(str(tuple(shape)))


def expect_error(exc, match, args, **kwargs):
    """Call gelu_ffn_backward(*args, **kwargs), expect `exc` with `match`, and check that no array
    argument (inputs and out= entries) changed, bit for bit, nor its shape or strides."""
    arrays = [a for a in args if isinstance(a, numpy.ndarray)]
    out = kwargs.get("out")
    if isinstance(out, (list, tuple)):
        arrays += [a for a in out if isinstance(a, numpy.ndarray)]
    before = [(a.tobytes(), a.shape, a.strides) for a in arrays]
    with pytest.raises(exc, match=match) as info:
        cupyffn.gelu_ffn_backward(*args, **kwargs)
    for a, (data, shape, strides) in zip(arrays, before):
        assert a.shape == shape and a.strides == strides
        assert a.tobytes() == data, "a rejected call modified an argument"
    return info


def args_with(inp, **replace):
    d = dict(inp)
    d.update(replace)
    return [d[n] for n in INPUT_NAMES]


# ---------------------------------------------------------------------------------------------
# dtypes and types
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [numpy.float64, numpy.float16, numpy.int32], ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", INPUT_NAMES)
def test_wrong_dtype(inp, name, dtype):
    bad = (inp[name] * 100).astype(dtype)
    if name == "grad_output" and dtype is numpy.float16:  # 16-bit activations: the others must follow grad_output
        expect_error(TypeError, r"^hidden_states must be float16 \(grad_output's dtype\); got float32$",
                     args_with(inp, **{name: bad}))
        return
    expect_error(TypeError, rf"^{name} must be {FIRST if name == 'grad_output' else 'float32'}; "
                            rf"got {numpy.dtype(dtype).name}$", args_with(inp, **{name: bad}))


@pytest.mark.parametrize("name", INPUT_NAMES)
def test_byteswapped_float32_is_rejected(inp, name):
    bad = inp[name].astype(">f4")
    expect_error(TypeError, rf"^{name} must be {FIRST if name == 'grad_output' else 'float32'}; got >f4$",
                 args_with(inp, **{name: bad}))


@pytest.mark.parametrize("name", INPUT_NAMES)
def test_list_instead_of_array(inp, name):
    expect_error(TypeError, rf"^{name} must be a numpy\.ndarray, a cupy\.ndarray or an object with __dlpack__ .*"
                            rf"got builtins\.list$", args_with(inp, **{name: inp[name].tolist()}))


def test_numpy_scalar_is_not_an_array(inp):
    expect_error(TypeError, r"^grad_output must be a numpy\.ndarray.*got numpy\.float32$",
                 args_with(inp, grad_output=F32(1.5)))


# ---------------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad_shape", [(T - 1, D), (T, D + 1), (T * D,), (1, T, D)], ids=repr)
def test_hidden_states_shape(inp, rng, bad_shape):
    bad = rng.standard_normal(bad_shape).astype(F32)
    expect_error(ValueError, rf"^hidden_states must have the shape of grad_output {shape_re((T, D))}; "
                             rf"got {shape_re(bad_shape)}$", args_with(inp, hidden_states=bad))


def test_weight1_without_rows(inp):
    expect_error(ValueError, rf"^weight1 has no rows \(shape {shape_re((0, D))}\): hidden_dim, its first dimension, "
                             rf"must be >= 1$", args_with(inp, weight1=numpy.zeros((0, D), F32)))


@pytest.mark.parametrize("bad_shape", [(H, D + 1), (H, D - 1), (H * D,), (1, H, D)], ids=repr)
def test_weight1_shape(inp, rng, bad_shape):
    bad = rng.standard_normal(bad_shape).astype(F32)
    expect_error(ValueError, rf"^weight1 must have shape \(hidden_dim, dim\) with dim = grad_output\.shape\[-1\] = {D} "
                             rf"and hidden_dim >= 1; got {shape_re(bad_shape)}$", args_with(inp, weight1=bad))


@pytest.mark.parametrize("bad_shape", [(H, D), (D, H + 1), (D + 1, H), (D * H,)], ids=repr)
def test_weight2_shape(inp, rng, bad_shape):
    bad = rng.standard_normal(bad_shape).astype(F32)
    expect_error(ValueError, rf"^weight2 must have shape \(dim, hidden_dim\) = {shape_re((D, H))} to match "
                             rf"grad_output {shape_re((T, D))} and weight1 {shape_re((H, D))}; "
                             rf"got {shape_re(bad_shape)}$", args_with(inp, weight2=bad))


@pytest.mark.parametrize("bad_shape", [(T, H + 1), (T + 1, H), (T * H,), (2, T // 2, H)], ids=repr)
@pytest.mark.parametrize("name", ["linear1_out", "tanh_inner", "gelu_out"])
def test_activation_shapes(inp, rng, name, bad_shape):
    bad = rng.standard_normal(bad_shape).astype(F32)
    expect_error(ValueError, rf"^{name} must have shape {shape_re((T, H))} \(grad_output's leading dimensions "
                             rf"{shape_re((T,))} \+ hidden_dim {H} from weight1 {shape_re((H, D))}\); "
                             rf"got {shape_re(bad_shape)}$", args_with(inp, **{name: bad}))


def test_grad_output_without_feature_dim(inp, rng):
    zero_d = numpy.array(rng.standard_normal(), dtype=F32)
    expect_error(ValueError, r"^grad_output must have shape \[\.\.\., dim\] with dim >= 1; got \(\)$",
                 args_with(inp, grad_output=zero_d))
    empty_dim = numpy.empty((T, 0), dtype=F32)
    expect_error(ValueError, rf"^grad_output must have shape \[\.\.\., dim\] with dim >= 1; got {shape_re((T, 0))}$",
                 args_with(inp, grad_output=empty_dim, hidden_states=empty_dim.copy()))


def test_grad_output_of_other_dim_is_reported_against_hidden_states(inp, rng):
    bad = rng.standard_normal((T, D + 2)).astype(F32)
    expect_error(ValueError, rf"^hidden_states must have the shape of grad_output {shape_re((T, D + 2))}; "
                             rf"got {shape_re((T, D))}$", args_with(inp, grad_output=bad))


# ---------------------------------------------------------------------------------------------
# precision
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp8", "BF16", "", 3, ("ieee",), ["ieee"]], ids=repr)  # None: the default
def test_unknown_precision(inp, precision):
    info = expect_error(ValueError, r"^precision must be one of .*; got " + re.escape(repr(precision)) + "$",
                        args_with(inp), precision=precision)
    message = str(info.value)
    for name in cupyffn.PRECISIONS:
        assert repr(name) in message


def test_plan_unknown_precision():
    with pytest.raises(ValueError, match=r"^precision must be one of 'bf16x3', 'fp16\+fp8', 'ieee', 'tf32', 'bf16'; got 'tf16'$"):
        cupyffn.GeluFFNBackward(T, D, H, precision="tf16", device="cpu")


# ---------------------------------------------------------------------------------------------
# out=
# ---------------------------------------------------------------------------------------------
OUT_SEQUENCE_RE = (r"^out must be a sequence of three arrays \(grad_hidden_states, grad_weight1, grad_weight2\); "
                   r"an entry may be None")


@pytest.mark.parametrize("count", [0, 1, 2, 4])
def test_out_of_wrong_length(inp, rng, count):
    outs = random_outs(rng) + [rng.standard_normal((3,)).astype(F32)]
    expect_error(TypeError, OUT_SEQUENCE_RE, args_with(inp), out=tuple(outs[:count]))


@pytest.mark.parametrize("kind", ["dict", "ndarray", "str", "generator", "array"])
def test_out_of_wrong_type(inp, rng, kind):
    outs = random_outs(rng)
    bad = {"dict": dict(enumerate(outs)), "ndarray": rng.standard_normal((3, 4)).astype(F32), "str": "abc",
           "generator": (o for o in outs), "array": outs[1]}[kind]
    expect_error(TypeError, OUT_SEQUENCE_RE, args_with(inp), out=bad)
    for o, s in zip(outs, OUT_SHAPES):
        assert o.shape == s


@pytest.mark.parametrize("index", [0, 1, 2])
def test_out_entry_of_wrong_shape(inp, rng, index):
    outs = random_outs(rng)
    want = OUT_SHAPES[index]
    bad_shape = (want[0], want[1] + 1)
    outs[index] = rng.standard_normal(bad_shape).astype(F32)
    expect_error(ValueError, rf"^out\[{index}\] \({OUTPUT_NAMES[index]}\) must have shape {shape_re(want)}; "
                             rf"got {shape_re(bad_shape)}$", args_with(inp), out=outs)


def test_out_grad_hidden_must_have_the_leading_dims(rng):
    inp = W.make_inputs((3, 4), D, H, xp=numpy, seed=int(rng.integers(2 ** 31)))
    flat = rng.standard_normal((12, D)).astype(F32)
    expect_error(ValueError, rf"^out\[0\] \(grad_hidden_states\) must have shape {shape_re((3, 4, D))}; "
                             rf"got {shape_re((12, D))}$", args_with(inp), out=(flat, None, None))


@pytest.mark.parametrize("dtype", [numpy.float64, numpy.float16, numpy.int32], ids=lambda d: d.__name__)
@pytest.mark.parametrize("index", [0, 1, 2])
def test_out_entry_of_wrong_dtype(inp, rng, index, dtype):
    outs = random_outs(rng)
    outs[index] = (outs[index] * 100).astype(dtype)
    expect_error(TypeError, rf"^out\[{index}\] \({OUTPUT_NAMES[index]}\) must be float32; "
                            rf"got {numpy.dtype(dtype).name}$", args_with(inp), out=outs)


@pytest.mark.parametrize("layout", ["transposed", "fortran", "column_slice", "row_step"])
@pytest.mark.parametrize("index", [0, 1, 2])
def test_out_entry_not_c_contiguous(inp, rng, index, layout):
    outs = random_outs(rng)
    rows, cols = OUT_SHAPES[index]
    if layout == "transposed":
        bad = rng.standard_normal((cols, rows)).astype(F32).T
    elif layout == "fortran":
        bad = numpy.asfortranarray(rng.standard_normal((rows, cols)).astype(F32))
    elif layout == "column_slice":
        bad = rng.standard_normal((rows, cols + 3)).astype(F32)[:, :cols]
    else:
        bad = rng.standard_normal((2 * rows, cols)).astype(F32)[::2]
    assert bad.shape == (rows, cols) and not bad.flags.c_contiguous
    outs[index] = bad
    expect_error(ValueError, rf"^out\[{index}\] \({OUTPUT_NAMES[index]}\) must be C-contiguous; got strides "
                             rf"{shape_re(bad.strides)} for shape {shape_re((rows, cols))}$", args_with(inp), out=outs)


def transposed_weights(inp):
    """The inputs with weight1 and weight2 as views of [in, out] storage (transformers' Conv1D), same values."""
    return args_with(inp, weight1=numpy.ascontiguousarray(inp["weight1"].T).T,
                     weight2=numpy.ascontiguousarray(inp["weight2"].T).T)


def test_weight_gradients_stored_as_the_transposed_weights(inp, rng):
    """With [in, out] weights the weight gradients may be given in that layout (the parameter's own): the same
    values as C-contiguous ones, written through the views; the layout of the two must agree."""
    args = transposed_weights(inp)
    want = cupyffn.gelu_ffn_backward(*args, precision="ieee")
    outs = random_outs(rng)
    outs[1], outs[2] = (numpy.full(s[::-1], numpy.nan, F32).T for s in OUT_SHAPES[1:])
    got = cupyffn.gelu_ffn_backward(*args, precision="ieee", out=outs)
    assert got.grad_weight1 is outs[1] and got.grad_weight2 is outs[2]
    for a, b in zip(got, want):
        assert numpy.array_equal(a, b)
    mixed = random_outs(rng)
    mixed[1] = numpy.zeros(OUT_SHAPES[1][::-1], F32).T
    expect_error(ValueError, r"^out\[1\] \(grad_weight1\) and out\[2\] \(grad_weight2\) must share one layout: "
                             r"both C-contiguous or both stored as the weights are \(\[in, out\]\); got out\[1\] "
                             r"\(grad_weight1\) \[in, out\], out\[2\] \(grad_weight2\) C-contiguous$", args,
                 out=mixed, precision="ieee")


def test_weight_gradients_of_another_layout_name_both_choices(inp, rng):
    outs = random_outs(rng)
    outs[2] = rng.standard_normal((D, H + 2)).astype(F32)[:, :H]  # neither C-contiguous nor an [in, out] transpose
    expect_error(ValueError, r"^out\[2\] \(grad_weight2\) must be C-contiguous \(or, as the weights are given, the "
                             r"transpose of a C-contiguous \[in, out\] matrix\); got strides", transposed_weights(inp),
                 out=outs)


@pytest.mark.parametrize("case", ["w1_itself", "w1_view", "w2_itself", "hidden_states", "grad_output",
                                  "w1_reshaped_as_w2"])
def test_out_aliasing_an_input(inp, rng, case):
    outs = random_outs(rng)
    index, source = {"w1_itself": (1, "weight1"), "w1_view": (1, "weight1"), "w2_itself": (2, "weight2"),
                     "hidden_states": (0, "hidden_states"), "grad_output": (0, "grad_output"),
                     "w1_reshaped_as_w2": (2, "weight1")}[case]
    if case == "w1_view":
        outs[index] = inp["weight1"][:]
    elif case == "w1_reshaped_as_w2":
        outs[index] = inp["weight1"].reshape(D, H)
    else:
        outs[index] = inp[source]
    expect_error(ValueError, rf"^out\[{index}\] \({OUTPUT_NAMES[index]}\) overlaps the memory of {source}: "
                             r"outputs may not alias inputs$", args_with(inp), out=outs)


def test_out_partially_overlapping_an_input(inp, rng):
    base = rng.standard_normal(T * H + T * D).astype(F32)
    gelu_out = base[: T * H].reshape(T, H)
    gelu_out[...] = inp["gelu_out"]
    overlapping = base[T * H - 5: T * H - 5 + T * D].reshape(T, D)
    expect_error(ValueError, r"^out\[0\] \(grad_hidden_states\) overlaps the memory of gelu_out",
                 args_with(inp, gelu_out=gelu_out), out=(overlapping, None, None))
    # the adjacent, non-overlapping block of the same buffer is accepted
    adjacent = base[T * H:].reshape(T, D)
    out = cupyffn.gelu_ffn_backward(*args_with(inp, gelu_out=gelu_out), out=(adjacent, None, None))
    assert out.grad_hidden_states is adjacent
    numpy.testing.assert_array_equal(gelu_out, inp["gelu_out"])


def test_out_overlapping_a_column_sliced_input(inp, rng):
    """An out array inside the span of a row-strided input (between its rows) is refused too."""
    big = rng.standard_normal((T, 2 * D)).astype(F32)
    big[:, :D] = inp["hidden_states"]
    hidden_states = big[:, :D]
    inside = big[T // 2:, :].reshape(-1)[: T * D]
    assert inside.size == T * D
    expect_error(ValueError, r"^out\[0\] \(grad_hidden_states\) overlaps the memory of hidden_states",
                 args_with(inp, hidden_states=hidden_states), out=(inside.reshape(T, D), None, None))


@pytest.mark.parametrize("pair", [(1, 2), (0, 1), (0, 2)], ids=repr)
def test_two_outputs_overlapping(inp, rng, pair):
    first, second = pair
    outs = random_outs(rng)
    size = max(outs[first].size, outs[second].size) + 7
    buf = rng.standard_normal(size).astype(F32)
    outs[first] = buf[: outs[first].size].reshape(OUT_SHAPES[first])
    outs[second] = buf[7: 7 + outs[second].size].reshape(OUT_SHAPES[second])
    expect_error(ValueError, rf"^out\[{second}\] \({OUTPUT_NAMES[second]}\) overlaps out\[{first}\] "
                             rf"\({OUTPUT_NAMES[first]}\)$", args_with(inp), out=outs)


def test_same_array_for_two_outputs(inp, rng):
    buf = rng.standard_normal((H, D)).astype(F32)
    expect_error(ValueError, r"^out\[2\] \(grad_weight2\) overlaps out\[1\] \(grad_weight1\)$",
                 args_with(inp), out=(None, buf, buf.reshape(D, H)))


def test_out_entry_list(inp, rng):
    outs = random_outs(rng)
    expect_error(TypeError, r"^out\[1\] \(grad_weight1\) must be a numpy\.ndarray.*got builtins\.list$",
                 args_with(inp), out=(outs[0], outs[1].tolist(), outs[2]))


@pytest.mark.parametrize("flags", [{"need_grad_hidden": False}, {"need_weight_grads": False}], ids=repr)
def test_out_entry_for_a_gradient_not_computed(inp, rng, flags):
    outs = random_outs(rng)
    index = 0 if "need_grad_hidden" in flags else 1
    label = rf"out\[{index}\] \({OUTPUT_NAMES[index]}\)"
    expect_error(ValueError, rf"^{label} was given but is not computed", args_with(inp), out=outs, **flags)


def test_accumulate_without_out(inp):
    expect_error(ValueError, r"^accumulate=True adds into existing gradients: pass out=", args_with(inp),
                 accumulate=True)


@pytest.mark.parametrize("missing", [1, 2])
def test_accumulate_with_a_missing_weight_grad(inp, rng, missing):
    outs = random_outs(rng)
    outs[missing] = None
    expect_error(ValueError, rf"^accumulate=True needs out\[{missing}\] \({OUTPUT_NAMES[missing]}\): "
                             r"the gradient to add into$", args_with(inp), out=outs, accumulate=True)


def test_nothing_to_compute(inp, rng):
    nothing = dict(need_grad_hidden=False, need_weight_grads=False, need_bias_grads=False)
    expect_error(ValueError, r"^need_grad_hidden, need_weight_grads and need_bias_grads are all False: there is "
                             r"nothing to compute$", args_with(inp), **nothing)
    with pytest.raises(ValueError, match=r"need_bias_grads are all False"):
        cupyffn.GeluFFNBackward(T, D, H, device="cpu", **nothing)


def test_read_only_out_is_rejected_before_anything_is_written(inp, rng):
    outs = random_outs(rng)
    outs[0].flags.writeable = False
    expect_error(ValueError, r"^out\[0\] \(grad_hidden_states\) is read-only$", args_with(inp), out=outs)


def test_accumulate_without_weight_grads_needs_no_out(inp):
    got = cupyffn.gelu_ffn_backward(*args_with(inp), accumulate=True, need_weight_grads=False)
    assert got.grad_weight1 is None and got.grad_weight2 is None and got.grad_hidden_states.shape == (T, D)


def test_precision_accepts_the_exported_objects(inp):
    by_name = cupyffn.gelu_ffn_backward(*args_with(inp), precision="tf32")
    by_object = cupyffn.gelu_ffn_backward(*args_with(inp), precision=cupyffn.PRECISIONS["tf32"])
    for a, b in zip(by_name, by_object):
        assert numpy.array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# memory layout of the inputs
# ---------------------------------------------------------------------------------------------
def bad_layout(rng, a, layout):
    """A view with a's values whose rows cannot be described by one row stride."""
    rows, cols = a.shape
    if layout == "transposed":  # Fortran order: a.T of a C-contiguous array
        view = numpy.ascontiguousarray(a.T).T
    elif layout == "column_step":  # big[:, ::2]
        big = rng.standard_normal((rows, 2 * cols)).astype(F32)
        view = big[:, ::2]
    elif layout == "reversed_rows":  # negative row stride
        view = numpy.ascontiguousarray(a[::-1])[::-1]
    elif layout == "overlapping_rows":  # row stride shorter than a row
        flat = rng.standard_normal(rows * cols).astype(F32)
        view = numpy.lib.stride_tricks.as_strided(flat, (rows, cols), (4 * (cols - 1), 4))
        return view
    else:
        raise AssertionError(layout)
    view[...] = a
    return view


LAYOUT_RE = (r"has strides \(.*\) \(bytes\) for shape {shape}: cupyffn reads arrays whose last dimension is "
             r"contiguous and whose leading dimensions flatten to one row stride .*"
             r"Pass ascontiguousarray\({name}\) instead$")


@pytest.mark.parametrize("layout", ["transposed", "column_step", "reversed_rows", "overlapping_rows"])
@pytest.mark.parametrize("name", INPUT_NAMES)
def test_input_not_row_strided(inp, rng, name, layout):
    bad = bad_layout(rng, inp[name], layout)
    assert bad.shape == inp[name].shape
    expect_error(ValueError, rf"^{name} " + LAYOUT_RE.format(shape=shape_re(bad.shape), name=name),
                 args_with(inp, **{name: bad}))


def test_leading_dims_that_do_not_flatten(rng):
    """[2, 3, D] taken out of [2, 5, W]: rows within a block are W apart but blocks are 5W apart."""
    inp = W.make_inputs((2, 3), D, H, xp=numpy, seed=int(rng.integers(2 ** 31)))
    big = rng.standard_normal((2, 5, D + 8)).astype(F32)
    view = big[:, :3, :D]
    view[...] = inp["hidden_states"]
    expect_error(ValueError, r"^hidden_states " + LAYOUT_RE.format(shape=shape_re((2, 3, D)), name="hidden_states"),
                 args_with(inp, hidden_states=view))


def test_broadcast_rows_are_rejected(inp, rng):
    row = rng.standard_normal(D).astype(F32)
    bad = numpy.broadcast_to(row, (T, D))
    expect_error(ValueError, r"^grad_output has strides \(0, 4\)", args_with(inp, grad_output=bad))


# ---------------------------------------------------------------------------------------------
# stream= and mixing backends
# ---------------------------------------------------------------------------------------------
def test_stream_with_numpy_inputs(inp):
    expect_error(ValueError, r"^stream= is for GPU arrays; these inputs are NumPy \(CPU\) arrays$",
                 args_with(inp), stream=types.SimpleNamespace(ptr=0))


def test_stream_of_wrong_type(inp):
    expect_error(TypeError, r"^stream must be a cupy\.cuda\.Stream \(or ExternalStream\) or None; got object$",
                 args_with(inp), stream=object())


class _Sentinel:
    """Stands for a GPU array; cupyffn.core.arrays.import_array is patched to report it as one."""


def _patch_gpu(monkeypatch, stand_ins):
    real = cupyffn.core.arrays.import_array

    def fake(obj, name, stream, torch_devices=None):
        for sentinel, array in stand_ins:
            if obj is sentinel:
                return "gpu", array
        return real(obj, name, stream, torch_devices)

    monkeypatch.setattr(cupyffn.core.arrays, "import_array", fake)


@pytest.mark.parametrize("gpu_name", INPUT_NAMES)
def test_mixing_numpy_and_gpu_arrays(inp, monkeypatch, gpu_name):
    sentinel = _Sentinel()
    _patch_gpu(monkeypatch, [(sentinel, inp[gpu_name].copy())])
    cpu_name = next(n for n in INPUT_NAMES if n != gpu_name)
    info = expect_error(ValueError, rf"^cannot mix NumPy \(CPU\) and GPU arrays: {cpu_name} is on the CPU but "
                                    rf"{gpu_name} is on a GPU$", args_with(inp, **{gpu_name: sentinel}))
    assert gpu_name in str(info.value) and cpu_name in str(info.value)


def test_gpu_out_entry_with_numpy_inputs(inp, rng, monkeypatch):
    sentinel = _Sentinel()
    _patch_gpu(monkeypatch, [(sentinel, rng.standard_normal((H, D)).astype(F32))])
    outs = random_outs(rng)
    expect_error(ValueError, r"^out\[1\] \(grad_weight1\) is a GPU array but the inputs are NumPy \(CPU\) arrays$",
                 args_with(inp), out=(outs[0], sentinel, outs[2]))


def test_the_patch_itself_is_harmless(inp, monkeypatch):
    """Control for the tests above: with the patch in place, ordinary NumPy calls still work."""
    _patch_gpu(monkeypatch, [(_Sentinel(), inp["weight1"])])
    out = cupyffn.gelu_ffn_backward(*args_with(inp), precision="ieee")
    ref = W.reference(inp)
    assert W.relative_l2(out.grad_weight1, ref[1]) < 5e-6


# ---------------------------------------------------------------------------------------------
# GeluFFNBackward arguments
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("param,value,minimum", [
    ("tokens", -1, 0), ("tokens", True, 0), ("tokens", 2.0, 0), ("tokens", None, 0), ("tokens", "12", 0),
    ("dim", 0, 1), ("dim", -3, 1), ("dim", False, 1), ("dim", 64.0, 1),
    ("hidden_dim", 0, 1), ("hidden_dim", True, 1), ("hidden_dim", "256", 1), ("hidden_dim", numpy.float32(256), 1),
], ids=lambda v: repr(v))
def test_plan_size_arguments(param, value, minimum):
    sizes = {"tokens": T, "dim": D, "hidden_dim": H}
    sizes[param] = value
    with pytest.raises(ValueError, match=rf"^{param} must be an integer >= {minimum}; got {re.escape(repr(value))}$"):
        cupyffn.GeluFFNBackward(sizes["tokens"], sizes["dim"], sizes["hidden_dim"], device="cpu")


def test_plan_accepts_numpy_integers():
    plan = cupyffn.GeluFFNBackward(numpy.int64(T), numpy.int32(D), numpy.uint16(H), device="cpu")
    assert (plan.tokens, plan.dim, plan.hidden_dim) == (T, D, H)
    assert all(type(v) is int for v in (plan.tokens, plan.dim, plan.hidden_dim))


def test_plan_rejects_an_unknown_device():  # before CuPy is needed: also where it is not installed
    with pytest.raises(TypeError, match=r"^device must be None, 'cpu', an int or a cupy\.cuda\.Device; got 'gpu'$"):
        cupyffn.GeluFFNBackward(T, D, H, device="gpu")


def test_plan_validates_its_calls(inp, rng):
    plan = cupyffn.GeluFFNBackward(T, D, H, device="cpu")
    outs = random_outs(rng)
    before = [o.copy() for o in outs]
    with pytest.raises(TypeError, match=r"^weight2 must be float32; got float64$"):
        plan(*args_with(inp, weight2=inp["weight2"].astype(numpy.float64)), out=outs)
    with pytest.raises(ValueError, match=r"^stream= is for GPU arrays"):
        plan(*args_with(inp), stream=types.SimpleNamespace(ptr=0))
    for o, b in zip(outs, before):
        assert o.tobytes() == b.tobytes()


def test_a_bias_elsewhere_is_named(inp, monkeypatch):
    """A bias on another device than hidden_states: the error names the bias (forward and backward share the one
    validator)."""
    sentinel = _Sentinel()
    _patch_gpu(monkeypatch, [(sentinel, numpy.zeros(H, F32))])
    x, w1, w2 = inp["hidden_states"], inp["weight1"], inp["weight2"]
    with pytest.raises(ValueError, match=r"^cannot mix NumPy \(CPU\) and GPU arrays: hidden_states is on the CPU but "
                                         r"bias1 is on a GPU$"):
        cupyffn.gelu_ffn_forward(x, w1, w2, bias1=sentinel)


def test_float32_biases_beside_16bit_weights_on_the_numpy_route():
    """bf16 weights with fp32 biases: accepted, and the NumPy route rounds the biases as it rounds fp32 master ones;
    fp16 biases beside bf16 weights are refused, naming what is allowed."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = numpy.dtype(ml_dtypes.bfloat16)
    r = numpy.random.default_rng(5)
    x = r.standard_normal((16, 8)).astype(bf16)
    w1, w2 = (0.2 * r.standard_normal((32, 8))).astype(bf16), (0.2 * r.standard_normal((8, 32))).astype(bf16)
    b1, b2 = r.standard_normal(32).astype(numpy.float32), r.standard_normal(8).astype(numpy.float32)
    got = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2)
    cast = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1.astype(bf16), bias2=b2.astype(bf16))
    for a, b in zip(got, cast):
        if a is not None:
            assert numpy.array_equal(numpy.asarray(a, numpy.float32), numpy.asarray(b, numpy.float32))
    assert not numpy.array_equal(numpy.asarray(got[0], numpy.float32),
                                 numpy.asarray(cupyffn.gelu_ffn_forward(x, w1, w2)[0], numpy.float32))
    with pytest.raises(TypeError, match=r"^bias1 must be bfloat16 or float32 \(weight1's dtype or float32\); got "
                                        r"float16$"):
        cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1.astype(numpy.float16))
