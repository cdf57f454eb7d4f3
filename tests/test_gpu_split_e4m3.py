"""split_e4m3.cu (the "fp16+fp8" plan's conversion) against a NumPy reference of the encoding written
here from /work/brief/f16e4m3.md's formulas, compared bit for bit:

    s = x * 2^e, hi = fp16_rn(s), fin = isfinite(hi), lo = fin ? s - hi : 0,
    H8 = fin ? e4m3_rn_satfinite(s * 2^-7) : 0, L8 = fin ? e4m3_rn_satfinite(lo * 2^4) : 0

and bf16x3 planes as common.cuh's split_bf16 (cupyffn.cpu.numpy_route.bf16_split). Every output is
poisoned before the call (0xFF / NaN where the kernel must write, 0x00 in the e4m3 padding columns the
kernel must leave alone, 0xAB past the rows' ends), so an unwritten or stray byte fails the test.
Every test runs the kernel the engine runs per KIND (_kernels.SPLIT_VARIANT).
Run: PYTHONPATH=. python3 -m pytest -q -s tests/test_gpu_split_e4m3.py (-s shows the bandwidth lines).
"""

import ctypes
import math

import numpy
import pytest

from cupyffn.cuda import kernels as _kernels
from cupyffn.cpu import numpy_route as _backend
from cupyffn.core import precision as _precision

pytestmark = pytest.mark.gpu

ml_dtypes = pytest.importorskip("ml_dtypes")
cupy = pytest.importorskip("cupy")

S = _kernels.STATE_SLOTS
F32 = numpy.float32
MARK = 0xAB  # bytes past 2 * kpad in an e4m3 row (ld > 2 * kpad): never written
PARTNERS = {0: (), 1: (0,), 2: (0,), 3: (), 4: (), 5: (3, 4), 6: (), 7: ()}  # kPartners (common.cuh)
GEMM_SLOTS = ((0, 1), (0, 2), (5, 4), (5, 3))  # kGemmSlots (common.cuh)


# ------------------------------------------------------------------------------------------ reference
def e4m3_bits(v):
    """e4m3fn codes of float32 v: nearest even, |v| > 448 -> +-448 (satfinite)."""
    return numpy.clip(v, F32(-448), F32(448)).astype(ml_dtypes.float8_e4m3fn).view(numpy.uint8)


def encode(x, e):
    """(hi fp16 bits, L8, H8) of float32 x with slot exponent e, as the brief writes them."""
    with numpy.errstate(all="ignore"):
        s = (x * F32(2.0 ** e)).astype(F32)
        hi = s.astype(numpy.float16)
        hf = hi.astype(F32)
        fin = numpy.isfinite(hf)
        lo = numpy.where(fin, s - hf, F32(0)).astype(F32)
        h8 = e4m3_bits(numpy.where(fin, s * F32(2.0 ** -7), F32(0)).astype(F32))
        l8 = e4m3_bits(numpy.where(fin, lo * F32(16), F32(0)).astype(F32))
    return hi.view(numpy.uint16), l8, h8


def bf16_planes(x):
    hi, lo = _backend.bf16_split(x)
    return ((hi.view(numpy.uint32) >> 16).astype(numpy.uint16), (lo.view(numpy.uint32) >> 16).astype(numpy.uint16))


def decide(exps, slot, amax):
    """Python mirror of f16_decide_slot (common.cuh): updates exps[slot], returns the rescue flag."""
    cap = 127
    for p in PARTNERS[slot]:
        cap = min(cap, 126 - exps[p])
    e = exps[slot]
    if amax > 0:
        _, k = math.frexp(amax)
        wanted = max(min(14 - k, cap), -126)
        if (k + e < 9 or k + e > 15 or e > cap) and wanted != e:
            exps[slot] = wanted
            return 1
    elif e > cap:
        exps[slot] = cap
    return 0


def finite_amax(x):
    f = numpy.abs(x[numpy.isfinite(x)])
    return float(f.max()) if f.size else 0.0


def fitting_exponent(x):
    """An exponent the gathering pass keeps (max |x| * 2^e in [2^13, 2^14))."""
    return _backend.f16_exponent(x)


# ------------------------------------------------------------------------------------------ checks
def assert_bits(name, got, want, x=None, nan_mask=None):
    got, want = numpy.asarray(got), numpy.asarray(want)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    bad = got != want
    if nan_mask is not None:  # NaN inputs: any NaN code is right (the GPU's canonical NaN differs)
        bad &= ~nan_mask
    if bad.any():
        idx = numpy.argwhere(bad)[:8]
        rows = [(tuple(int(v) for v in i), hex(int(got[tuple(i)])), hex(int(want[tuple(i)])),
                 None if x is None else float(x[tuple(i)])) for i in idx]
        raise AssertionError(f"{name}: {int(bad.sum())} of {bad.size} differ; first (index, got, want, x): {rows}")


def f16_is_nan(bits):
    return ((bits & 0x7C00) == 0x7C00) & ((bits & 0x03FF) != 0)


def bf16_is_nan(bits):
    return ((bits & 0x7F80) == 0x7F80) & ((bits & 0x007F) != 0)


class Outputs:
    """Poisoned output buffers of one job and the SplitSpec that points at them."""

    def __init__(self, rows, cols, slot, encodings, kind=0, e4n_order=0, e4t_order=1, x3_layout="interleaved",
                 x3_pattern=_precision.PATTERN_HLH, ld_pad=True, f16_pad=4):
        self.rows, self.cols = rows, cols
        self.bufs = {}
        kw = {}
        if "f16" in encodings:
            ld = cols + (f16_pad if ld_pad else 0)  # cols + 4 keeps 8-byte stores (vec_out) when cols % 4 == 0
            self.bufs["f16"] = cupy.full((rows, ld), 0xFFFF, dtype=cupy.uint16)
            kw["f16"] = (self.bufs["f16"].data.ptr, ld)
        if "x3" in encodings:
            self.x3_layout, self.x3_pattern = x3_layout, x3_pattern
            if x3_layout == "interleaved":  # [rows, 3 cols], planes side by side
                self.bufs["x3"] = cupy.full((rows, 3 * cols), 0xFFFF, dtype=cupy.uint16)
                kw["x3"] = (self.bufs["x3"].data.ptr, 3 * cols, cols, x3_pattern)
            else:  # [3 rows, cols], planes stacked
                self.bufs["x3"] = cupy.full((3 * rows, cols), 0xFFFF, dtype=cupy.uint16)
                kw["x3"] = (self.bufs["x3"].data.ptr, cols, rows * cols, x3_pattern)
        for name, order, (n, k) in (("e4n", e4n_order, (rows, cols)), ("e4t", e4t_order, (cols, rows))):
            if name not in encodings:
                continue
            kp = _kernels.e4m3_kpad(k)
            ld = 2 * kp + (16 if ld_pad else 0)
            host = numpy.full((n, ld), 0xFF, dtype=numpy.uint8)
            host[:, k:kp] = 0
            host[:, kp + k:2 * kp] = 0
            host[:, 2 * kp:] = MARK
            self.bufs[name] = cupy.asarray(host)
            kw[name] = (self.bufs[name].data.ptr, ld, kp, order)
            setattr(self, name + "_order", order)
        self.spec = _kernels.SplitSpec(rows, cols, slot, kind=kind, **kw)

    def poison(self):
        """Fill again as built (for checking that a pass left these outputs alone)."""
        for name, buf in self.bufs.items():
            if name in ("f16", "x3"):
                buf.fill(0xFFFF)
            else:
                k = self.cols if name == "e4n" else self.rows
                kp = _kernels.e4m3_kpad(k)
                host = numpy.full(buf.shape, 0xFF, dtype=numpy.uint8)
                host[:, k:kp] = 0
                host[:, kp + k:2 * kp] = 0
                host[:, 2 * kp:] = MARK
                buf.set(host)

    def assert_poisoned(self, label):
        for name, buf in self.bufs.items():
            host = buf.get()
            if name in ("f16", "x3"):
                assert (host == 0xFFFF).all(), f"{label}: {name} was written"
            else:
                k = self.cols if name == "e4n" else self.rows
                kp = _kernels.e4m3_kpad(k)
                assert (host[:, :k] == 0xFF).all() and (host[:, kp:kp + k] == 0xFF).all(), f"{label}: {name} was written"

    def check(self, x, e, label=""):
        """Every output equals the encoding of x (float32 [rows, cols]) with exponent e; padding untouched."""
        rows, cols = self.rows, self.cols
        hi, l8, h8 = encode(x, e)
        nan = numpy.isnan(x)
        tag = f"{label} [{rows}x{cols}, e={e}]"
        if "f16" in self.bufs:
            got = self.bufs["f16"].get()
            assert_bits(f"{tag} f16", got[:, :cols], hi, x, nan)
            assert f16_is_nan(got[:, :cols][nan]).all(), f"{tag} f16: NaN inputs must give NaN"
            assert (got[:, cols:] == 0xFFFF).all(), f"{tag} f16: written past cols in the row stride"
        if "x3" in self.bufs:
            bh, bl = bf16_planes(x)
            got = self.bufs["x3"].get()
            for j in range(3):
                plane = got[:, j * cols:(j + 1) * cols] if self.x3_layout == "interleaved" else got[j * rows:(j + 1) * rows]
                lo = (self.x3_pattern >> j) & 1
                assert_bits(f"{tag} x3 plane {j} ({'lo' if lo else 'hi'})", plane, bl if lo else bh, x, nan)
                if lo:
                    assert (plane[nan] == 0).all(), f"{tag} x3 lo of NaN must be 0"
                else:
                    assert bf16_is_nan(plane[nan]).all(), f"{tag} x3 hi of NaN must be NaN"
        for name, (k, a_l8, a_h8) in (("e4n", (cols, l8, h8)), ("e4t", (rows, l8.T, h8.T))):
            if name not in self.bufs:
                continue
            got = self.bufs[name].get()
            kp = _kernels.e4m3_kpad(k)
            order = getattr(self, name + "_order")
            first, second = (a_l8, a_h8) if order == 0 else (a_h8, a_l8)
            xx = x if name == "e4n" else x.T
            assert_bits(f"{tag} {name} order {order} columns [0, K)", got[:, :k], first, xx)
            assert_bits(f"{tag} {name} order {order} columns [kpad, kpad + K)", got[:, kp:kp + k], second, xx)
            assert (got[:, k:kp] == 0).all() and (got[:, kp + k:2 * kp] == 0).all(), f"{tag} {name}: padding written"
            assert (got[:, 2 * kp:] == MARK).all(), f"{tag} {name}: written past 2 * kpad"


# ------------------------------------------------------------------------------------------ launching
def device():
    return cupy.cuda.Device().id


def kernel(kind):
    return _kernels.get_function("split_e4m3", _kernels.split_expression(kind), device())


def new_state(exps):
    host = numpy.zeros(4 * S, dtype=numpy.int32)
    for slot, e in exps.items():
        host[slot] = e
    return cupy.asarray(host), cupy.asarray([0, 1, 1, 1, 1, 1, 0, 0], dtype=cupy.float32)


def launch(kind, outs, sources, state, consts, rescue=0, counter=0, alpha_mask=0, total_blocks=None):
    """One split_e4m3 launch over `outs` (Outputs) with `sources` (per job a tuple of cupy arrays / None)."""
    sms = _kernels.sm_count(device())
    if total_blocks is None:
        total_blocks = (2 if rescue else 4) * sms
    vp = ctypes.c_void_p
    run = _kernels.split_launch(kernel(kind), [o.spec for o in outs], total_blocks, rescue, counter, alpha_mask,
                                vp(state.data.ptr), vp(consts.data.ptr))
    for k, srcs in enumerate(sources):
        args = [None if a is None else (a.data.ptr, a.strides[0] // 4) for a in srcs]
        _kernels.split_set_sources(run.args[0].job[k], *args)
    run(cupy.cuda.get_current_stream().ptr)
    cupy.cuda.get_current_stream().synchronize()
    return run


def assert_state_settled(state, slots, exps, label=""):
    """After a gathering pass: exponents as decided, maxima and arrival counters reset."""
    host = state.get()
    for s in slots:
        assert host[s] == exps[s], (label, "exponent of slot", s, int(host[s]), exps[s])
        assert host[S + s] == 0, (label, "max |x| of slot", s, "not reset", int(host[S + s]))
    assert (host[3 * S:] == 0).all(), (label, "arrival counters not reset", host[3 * S:])


_REF = None


def reference_module():
    """The GELU of activation.cuh (through common.cuh, headers pasted as the product pastes them) in plain
    elementwise kernels: the matrix the kernel must encode (recomputed in NumPy it could differ in the last bit:
    tanhf and FMA contraction)."""
    global _REF
    if _REF is None:
        code = '#include "common.cuh"\n' + r"""
extern "C" __global__ void ref_gelu_out(const float* z, const float* t, float* out, long long n) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= n) return;
  float tt, g;
  if (t != nullptr) {
    g = 0.5f * z[i] * (1.0f + t[i]);
  } else {
    cupyffn::gelu(z[i], tt, g);
  }
  out[i] = g;
}
extern "C" __global__ void ref_grad_linear1(const float* gg, const float* x, const float* t, float* out, long long n) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float tt = t != nullptr ? t[i] : cupyffn::tanh_inner_of(x[i]);
  out[i] = gg[i] * cupyffn::gelu_grad(x[i], tt);
}
"""
        _REF = cupy.RawModule(code=_kernels.with_headers(code), options=_kernels.NVRTC_OPTIONS)
    return _REF


def ref_matrix(name, *arrays):
    """ref_gelu_out(z, t) or ref_grad_linear1(gg, x, t) of contiguous float32 cupy arrays (t may be None)."""
    n = arrays[0].size
    out = cupy.empty_like(arrays[0])
    f = reference_module().get_function(name)
    ptrs = [numpy.uint64(0 if a is None else a.data.ptr) for a in arrays]
    f(((n + 255) // 256,), (256,), (*ptrs, numpy.uint64(out.data.ptr), numpy.int64(n)))
    cupy.cuda.get_current_stream().synchronize()
    return out.get()


def randn(rng, rows, cols, scale=1.0):
    return (rng.standard_normal((rows, cols)) * scale).astype(F32)


# ------------------------------------------------------------------------------------------ tests
def test_several_jobs_in_one_launch(rng):
    """Five matrices, each with another subset of encodings, orders, layouts and odd shapes."""
    shapes = [(37, 53), (129, 67), (300, 1000), (1, 1), (1, 300)]
    encs = [("f16", "e4n", "e4t"), ("x3", "e4t"), ("f16", "x3", "e4n", "e4t"), ("f16", "e4n", "e4t"), ("f16", "e4t")]
    xs = [randn(rng, r, c, scale) for (r, c), scale in zip(shapes, (3.0, 1e-3, 50.0, 7.0, 0.2))]
    outs = [Outputs(r, c, slot, enc, e4n_order=slot % 2, e4t_order=(slot + 1) % 2,
                    x3_layout="interleaved" if slot == 1 else "blocked", x3_pattern=_precision.PATTERN_HHL if slot == 2 else 0b011)
            for slot, ((r, c), enc) in enumerate(zip(shapes, encs))]
    exps = {slot: fitting_exponent(x) for slot, x in enumerate(xs)}
    state, consts = new_state(exps)
    dev = [cupy.asarray(x) for x in xs]
    run = launch(0, outs, [(d,) for d in dev], state, consts, counter=1)
    assert run.grid >= 5
    assert_state_settled(state, range(5), exps)
    assert (state.get()[2 * S:2 * S + 5] == 0).all()  # nothing to rescue
    for slot, (o, x) in enumerate(zip(outs, xs)):
        o.check(x, exps[slot], f"job {slot}")


@pytest.mark.parametrize("rows,cols", [(1, 1), (1, 7), (37, 53), (129, 67), (64, 64), (65, 129), (300, 1000),
                                       (2048, 6144)])
@pytest.mark.parametrize("kind", [0, 1])
def test_shapes_all_encodings(rng, rows, cols, kind):
    """Every encoding at once, odd shapes (scalar path when cols % 4 != 0) and a large one (vector path)."""
    if kind == 0:
        x = randn(rng, rows, cols, 2.5)
        sources = [(cupy.asarray(x),)]
    else:
        gg, z = randn(rng, rows, cols, 0.7), randn(rng, rows, cols, 1.5)
        t = _backend.tanh_inner(z)
        d = [cupy.asarray(a) for a in (gg, z, t)]
        x = ref_matrix("ref_grad_linear1", *d)
        sources = [tuple(d)]
    e = fitting_exponent(x)
    state, consts = new_state({5: e})
    o = Outputs(rows, cols, 5, ("f16", "x3", "e4n", "e4t"), e4n_order=0, e4t_order=1)
    run = launch(kind, [o], sources, state, consts, counter=2)
    job = run.args[0].job[0]
    assert (job.vec, job.vec_out) == ((1, 1) if cols % 4 == 0 else (0, 0)), (job.vec, job.vec_out)
    assert_state_settled(state, [5], {5: e})
    o.check(x, e, f"KIND {kind}")


@pytest.mark.parametrize("rows,cols", [(37, 53), (65, 129), (130, 200), (256, 1536)])
@pytest.mark.parametrize("kind", [0, 1])
def test_fp16_rows_16_byte_aligned(rng, rows, cols, kind):
    """fp16 rows starting 16-byte aligned (row stride a multiple of 8), including the last columns of rows whose
    length is not a multiple of 8."""
    ld = -(-cols // 8) * 8 + 8
    if kind == 0:
        x = randn(rng, rows, cols, 1.7)
        sources = [(cupy.asarray(x),)]
    else:
        d = [cupy.asarray(a) for a in (randn(rng, rows, cols, 0.4), randn(rng, rows, cols, 1.3))]
        d.append(cupy.tanh(d[1]))
        x = ref_matrix("ref_grad_linear1", *d)
        sources = [tuple(d)]
    e = fitting_exponent(x)
    state, consts = new_state({5: e})
    o = Outputs(rows, cols, 5, ("f16", "x3", "e4n", "e4t"), f16_pad=ld - cols)
    assert o.spec.f16[1] % 8 == 0 and o.spec.f16[0] % 16 == 0
    launch(kind, [o], sources, state, consts, counter=2)
    o.check(x, e, f"KIND {kind} fp16 rows 16-byte aligned")


@pytest.mark.parametrize("rows,cols,ld,offset,vec", [(130, 68, 71, 0, 0), (130, 68, 68, 1, 0), (65, 200, 202, 0, 0),
                                                     (33, 20, 24, 2, 0), (50, 64, 68, 4, 1)])
def test_strided_sources(rng, rows, cols, ld, offset, vec):
    """Source views with a row stride > cols: 16-byte loads only where every row start is 16-byte aligned
    (vec = 1), else the scalar path; fp16 rows with a stride that is not a multiple of 4 (vec_out = 0)."""
    big = cupy.asarray(randn(rng, rows, ld + offset, 4.0))
    view = big[:, offset:offset + cols]
    x = view.get()
    o = Outputs(rows, cols, 0, ("f16", "x3", "e4n", "e4t"), e4n_order=1, e4t_order=0, f16_pad=3)
    e = fitting_exponent(x)
    state, consts = new_state({0: e})
    run = launch(0, [o], [(view,)], state, consts)
    assert (run.args[0].job[0].vec, run.args[0].job[0].vec_out) == (vec, 0)
    o.check(x, e, "strided")
    # KIND 1 with strided grad_gelu / linear1_out / tanh_inner views
    gg = cupy.asarray(randn(rng, rows, ld + offset, 0.3))[:, offset:offset + cols]
    zz = cupy.asarray(randn(rng, rows, ld + offset, 1.2))[:, offset:offset + cols]
    tt = cupy.tanh(zz)  # any values do: the kernel takes tanh_inner as given
    ref = ref_matrix("ref_grad_linear1", *(cupy.ascontiguousarray(a) for a in (gg, zz, tt)))
    o1 = Outputs(rows, cols, 5, ("f16", "e4n", "e4t"))
    e1 = fitting_exponent(ref)
    state, consts = new_state({5: e1})
    run = launch(1, [o1], [(gg, zz, tt)], state, consts)
    assert run.args[0].job[0].vec == vec
    o1.check(ref, e1, "strided KIND 1")


@pytest.mark.parametrize("with_tanh", [True, False])
@pytest.mark.parametrize("rows,cols", [(37, 53), (256, 1536)])
def test_gelu_out_recomputed(rng, with_tanh, rows, cols):
    """KIND 0, job kind 1: gelu_out = 0.5 z (1 + t) from linear1_out (and tanh_inner, or recomputed)."""
    z = cupy.asarray(randn(rng, rows, cols, 2.0))
    t = cupy.asarray(_backend.tanh_inner(z.get())) if with_tanh else None
    x = ref_matrix("ref_gelu_out", z, t)
    numpy.testing.assert_allclose(x, 0.5 * z.get().astype(numpy.float64) * (1 + numpy.tanh(
        math.sqrt(2 / math.pi) * (z.get().astype(numpy.float64) + 0.044715 * z.get().astype(numpy.float64) ** 3))),
        rtol=1e-5, atol=1e-5)
    e = fitting_exponent(x)
    state, consts = new_state({2: e})
    o = Outputs(rows, cols, 2, ("f16", "x3", "e4t"), kind=1)
    launch(0, [o], [(z, t)], state, consts, counter=1)
    o.check(x, e, f"gelu_out (tanh given: {with_tanh})")


@pytest.mark.parametrize("with_tanh", [True, False])
def test_dgelu_with_and_without_tanh_inner(rng, with_tanh):
    rows, cols = 200, 1000
    gg, z = cupy.asarray(randn(rng, rows, cols, 0.5)), cupy.asarray(randn(rng, rows, cols, 1.5))
    t = cupy.asarray(_backend.tanh_inner(z.get())) if with_tanh else None
    x = ref_matrix("ref_grad_linear1", gg, z, t)
    z64 = z.get().astype(numpy.float64)
    t64 = numpy.tanh(math.sqrt(2 / math.pi) * (z64 + 0.044715 * z64 ** 3))
    want64 = gg.get() * (0.5 * (1 + t64) + 0.5 * z64 * (1 - t64 ** 2) * math.sqrt(2 / math.pi) * (1 + 0.134145 * z64 ** 2))
    numpy.testing.assert_allclose(x, want64, rtol=1e-4, atol=2e-5)  # cancellation where gelu' crosses 0
    e = fitting_exponent(x)
    state, consts = new_state({5: e})
    o = Outputs(rows, cols, 5, ("f16", "e4n", "e4t"), e4n_order=0, e4t_order=0)
    launch(1, [o], [(gg, z, t)], state, consts, counter=2)
    o.check(x, e, f"grad_linear1 (tanh given: {with_tanh})")


def test_scale_passes_gathering_then_rescue(rng):
    """Slot 0: max ~1e4 at exponent 10 (fp16 overflows in the gathering pass; rescue to the decided
    exponent); slot 1: max ~1 at exponent 13 (fits: the rescue pass must leave it alone); slot 2: max
    ~1e-3 at exponent 0 (too small; rescue). Then the alphas of all four GEMMs."""
    xs = [randn(rng, 150, 70, 1.0), randn(rng, 90, 260, 1.0), randn(rng, 64, 128, 1.0)]
    xs[0] *= F32(1e4 / numpy.abs(xs[0]).max())
    xs[1] *= F32(1.0 / numpy.abs(xs[1]).max())
    xs[2] *= F32(1e-3 / numpy.abs(xs[2]).max())
    start = {0: 10, 1: 13, 2: 0, 3: 4, 4: 9, 5: 7}
    state, consts = new_state(start)
    outs = [Outputs(x.shape[0], x.shape[1], slot, ("f16", "x3", "e4n", "e4t")) for slot, x in enumerate(xs)]
    dev = [cupy.asarray(x) for x in xs]
    launch(0, outs, [(d,) for d in dev], state, consts, counter=3)
    exps = dict(start)
    flags = {s: decide(exps, s, finite_amax(x)) for s, x in enumerate(xs)}
    assert flags == {0: 1, 1: 0, 2: 1}, flags
    assert (exps[0], exps[1], exps[2]) == (0, 13, 23), exps
    assert_state_settled(state, range(3), exps, "gathering")
    host = state.get()
    assert [int(host[2 * S + s]) for s in range(3)] == [1, 0, 1], host
    for slot, (o, x) in enumerate(zip(outs, xs)):  # the gathering pass wrote the old exponent's encoding
        o.check(x, start[slot], f"gathering job {slot}")
    assert numpy.isinf(encode(xs[0], 10)[0].view(numpy.float16)).any()  # it did overflow
    outs[1].poison()
    launch(0, outs, [(d,) for d in dev], state, consts, rescue=1, counter=3, alpha_mask=0b1111, total_blocks=3)
    outs[0].check(xs[0], exps[0], "rescued job 0")
    outs[2].check(xs[2], exps[2], "rescued job 2")
    outs[1].assert_poisoned("rescue pass, unflagged job 1")
    assert (state.get()[:S] == numpy.array([exps.get(s, 0) for s in range(S)])).all()
    got = consts.get()
    for g, (a, b) in enumerate(GEMM_SLOTS):
        want = math.ldexp(1.0, -min(max(exps[a] + exps[b], -127), 126))
        assert got[2 + g] == numpy.float32(want), (g, float(got[2 + g]), want)
    assert got[0] == 0 and got[1] == 1


def test_inf_and_nan_inputs(rng):
    """hi carries Inf / NaN, H8 = L8 = 0 there; the maximum leaves them out."""
    rows, cols = 70, 132
    x = randn(rng, rows, cols, 3.0)
    x.flat[rng.choice(x.size, 40, replace=False)] = numpy.inf
    x.flat[rng.choice(x.size, 40, replace=False)] = -numpy.inf
    x.flat[rng.choice(x.size, 40, replace=False)] = numpy.nan
    finite = numpy.where(numpy.isfinite(x), x, 0)
    exps = {4: 2}
    flag = decide(exps, 4, finite_amax(x))
    assert flag == 1 and exps[4] == fitting_exponent(finite)
    state, consts = new_state({4: 2})
    o = Outputs(rows, cols, 4, ("f16", "x3", "e4n", "e4t"))
    dev = cupy.asarray(x)
    launch(0, [o], [(dev,)], state, consts)
    assert_state_settled(state, [4], exps)
    o.check(x, 2, "non-finite, gathering")
    launch(0, [o], [(dev,)], state, consts, rescue=1)
    o.check(x, exps[4], "non-finite, rescued")
    hi, l8, h8 = encode(x, exps[4])
    bad = ~numpy.isfinite(x)
    assert (l8[bad] == 0).all() and (h8[bad] == 0).all()
    assert (hi[numpy.isinf(x)] & 0x7FFF == 0x7C00).all()


def test_bad_specs_are_refused():
    vp = ctypes.c_void_p
    k = kernel(0)
    with pytest.raises(ValueError, match="e4t"):
        _kernels.split_launch(k, [_kernels.SplitSpec(10, 10, 0, e4t=(256, 32, 8, 0))], 4, 0, 0, 0, vp(0), vp(0))
    with pytest.raises(ValueError, match="no encoding"):
        _kernels.split_launch(k, [_kernels.SplitSpec(10, 10, 0)], 4, 0, 0, 0, vp(0), vp(0))
    with pytest.raises(ValueError, match="slot"):
        _kernels.split_launch(k, [_kernels.SplitSpec(10, 10, 9, f16=(256, 10))], 4, 0, 0, 0, vp(0), vp(0))


def _time(run, reps=20):
    stream = cupy.cuda.get_current_stream()
    for _ in range(3):
        run(stream.ptr)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(reps):
        run(stream.ptr)
    stop.record(stream)
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / reps * 1e-3


def test_bandwidth_print(rng, capsys):
    """Effective bandwidth (bytes read + written) at [8192, 6144]; printed, not asserted."""
    rows, cols = 8192, 6144
    n = rows * cols
    sms = _kernels.sm_count(device())
    lines = []
    x = cupy.asarray(randn(rng, rows, cols, 1.0))
    e = fitting_exponent(x[:64].get())  # any fitting exponent: no rescue wanted for timing
    state, consts = new_state({0: e, 5: e})
    o = Outputs(rows, cols, 0, ("f16", "e4t"), ld_pad=False)
    vp = ctypes.c_void_p
    for blocks_per_sm in (2, 4, 8):
        run = _kernels.split_launch(kernel(0), [o.spec], blocks_per_sm * sms, 0, 0, 0, vp(state.data.ptr),
                                    vp(consts.data.ptr))
        _kernels.split_set_sources(run.args[0].job[0], (x.data.ptr, cols))
        sec = _time(run)
        lines.append(f"split_e4m3 KIND 0 variant {_kernels.SPLIT_VARIANT[0][0]} f16+e4t [{rows}, {cols}] grid {run.grid}: {sec * 1e6:.1f} us, "
                     f"{(4 + 2 + 2) * n / sec / 1e9:.0f} GB/s")
    gg, z = x, cupy.asarray(randn(rng, rows, cols, 1.5))
    t = cupy.tanh(z)
    o1 = Outputs(rows, cols, 5, ("f16", "e4n", "e4t"), ld_pad=False)
    for tanh in (t, None):
        for blocks_per_sm in (2, 4):
            run = _kernels.split_launch(kernel(1), [o1.spec], blocks_per_sm * sms, 0, 2, 0, vp(state.data.ptr),
                                        vp(consts.data.ptr))
            _kernels.split_set_sources(run.args[0].job[0], (gg.data.ptr, cols), (z.data.ptr, cols),
                                       None if tanh is None else (tanh.data.ptr, cols))
            sec = _time(run)
            read = 12 if tanh is not None else 8
            lines.append(f"split_e4m3 KIND 1 variant {_kernels.SPLIT_VARIANT[1][0]} f16+e4n+e4t tanh_inner {'given' if tanh is not None else 'recomputed'} "
                         f"[{rows}, {cols}] grid {run.grid}: {sec * 1e6:.1f} us, {(read + 6) * n / sec / 1e9:.0f} GB/s")
    # the timed outputs are right too (last run: KIND 1 without tanh_inner, exponent e unless rescued)
    assert numpy.isfinite(o1.bufs["f16"][:4].get().view(numpy.float16)).all()
    with capsys.disabled():
        print()
        for line in lines:
            print(line)
