"""cupyffn/gemm/cublaslt.py without a GPU: the constants and struct layouts against the installed cublasLt.h,
the prototypes' parameter counts, the row-major -> column-major layout mapping (emulated in numpy), and the
argument checks and fp8 constraints (supports(), LtUnsupported), which all run before any GPU work."""

import ctypes
import os
import re

import numpy
import pytest

pytest.importorskip("cupy")
from cupyffn.gemm import cublas as _cublas, cublaslt as _cublaslt  # noqa: E402

E4M3, F32, F16, BF16 = _cublas.R_8F_E4M3, _cublas.R_32F, _cublas.R_16F, _cublas.R_16BF


def _header_dir(name):
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        return find_nvidia_header_directory(name)
    except Exception:  # older cuda-pathfinder, or none
        return None


def _read(folder, filename):
    if folder is None or not os.path.exists(os.path.join(folder, filename)):
        pytest.skip(f"{filename} not installed (the nvidia-cublas / cuda-runtime wheels bring it)")
    text = open(os.path.join(folder, filename)).read()
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def _enum_values(text):
    return dict(re.findall(r"\b([A-Z][A-Z0-9_]+)\s*=\s*([A-Za-z0-9_]+)\s*[,}]", text))


@pytest.fixture(scope="module")
def headers():
    lt = _read(_header_dir("cublas"), "cublasLt.h")
    api = _read(_header_dir("cublas"), "cublas_api.h")
    types = _read(_header_dir("cudart"), "library_types.h")
    values = {**_enum_values(types), **_enum_values(api), **_enum_values(lt)}

    def value(name):
        v = values[name]
        return int(v, 0) if re.fullmatch(r"-?(0x)?[0-9A-Fa-f]+", v) else value(v)  # e.g. = CUBLAS_POINTER_MODE_DEVICE

    return lt, api, value


def test_enum_values_match_the_header(headers):
    _, _, value = headers
    expected = {
        "CUBLASLT_MATMUL_DESC_POINTER_MODE": _cublaslt.MATMUL_DESC_POINTER_MODE,
        "CUBLASLT_MATMUL_DESC_TRANSA": _cublaslt.MATMUL_DESC_TRANSA,
        "CUBLASLT_MATMUL_DESC_TRANSB": _cublaslt.MATMUL_DESC_TRANSB,
        "CUBLASLT_MATMUL_DESC_A_SCALE_POINTER": _cublaslt.MATMUL_DESC_A_SCALE_POINTER,
        "CUBLASLT_MATMUL_DESC_B_SCALE_POINTER": _cublaslt.MATMUL_DESC_B_SCALE_POINTER,
        "CUBLASLT_MATMUL_DESC_FAST_ACCUM": _cublaslt.MATMUL_DESC_FAST_ACCUM,
        "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES": _cublaslt.MATMUL_PREF_MAX_WORKSPACE_BYTES,
        "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES": _cublaslt.MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
        "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES": _cublaslt.MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES": _cublaslt.MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
        "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES": _cublaslt.MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
        "CUBLASLT_POINTER_MODE_DEVICE": _cublaslt.POINTER_MODE_DEVICE,
        "CUBLAS_COMPUTE_32F": _cublaslt.COMPUTE_32F,
        "CUBLAS_OP_N": _cublas.OP_N,
        "CUBLAS_OP_T": _cublas.OP_T,
        "CUBLAS_STATUS_NOT_SUPPORTED": 15,  # the heuristic statuses _heuristic reads as "unsupported"
        "CUBLAS_STATUS_INVALID_VALUE": 7,
        "CUDA_R_32F": F32,
        "CUDA_R_16F": F16,
        "CUDA_R_16BF": BF16,
        "CUDA_R_8F_E4M3": E4M3,
        "CUDA_R_8F_E5M2": _cublaslt.R_8F_E5M2,
        "CUBLASLT_EPILOGUE_DEFAULT": _cublaslt.EPILOGUE_DEFAULT,
        "CUBLASLT_EPILOGUE_BIAS": _cublaslt.EPILOGUE_BIAS,
        "CUBLASLT_EPILOGUE_BGRADA": _cublaslt.EPILOGUE_BGRADA,
        "CUBLASLT_EPILOGUE_BGRADB": _cublaslt.EPILOGUE_BGRADB,
    }
    got = {name: value(name) for name in expected}
    assert got == expected


def test_struct_layouts_match_the_header(headers):
    lt, _, _ = headers
    sizes = {"uint64_t": 8}
    for name in ("cublasLtMatmulAlgo_t", "cublasLtMatrixLayoutOpaque_t", "cublasLtMatmulDescOpaque_t"):
        m = re.search(r"typedef struct\s*{\s*(\w+)\s+data\[(\d+)\];\s*}\s*" + name + ";", lt)
        assert m, name
        sizes[name] = sizes[m.group(1)] * int(m.group(2))
    assert sizes["cublasLtMatmulAlgo_t"] == ctypes.sizeof(_cublaslt.MatmulAlgo) == 64

    body = re.search(r"typedef struct\s*{([^}]*)}\s*cublasLtMatmulHeuristicResult_t;", lt)
    assert body
    ctype = {"cublasLtMatmulAlgo_t": _cublaslt.MatmulAlgo, "size_t": ctypes.c_size_t, "cublasStatus_t": ctypes.c_int,
             "float": ctypes.c_float, "int": ctypes.c_int}
    fields = []
    for kind, name, count in re.findall(r"(\w+)\s+(\w+)\s*(?:\[(\d+)\])?\s*;", body.group(1)):
        fields.append((name, ctype[kind] * int(count) if count else ctype[kind]))
    parsed = type("Parsed", (ctypes.Structure,), {"_fields_": fields})
    ours = _cublaslt.HeuristicResult
    assert [n for n, _ in fields] == [n for n, _ in ours._fields_]
    assert ctypes.sizeof(parsed) == ctypes.sizeof(ours) == 96
    assert [getattr(parsed, n).offset for n, _ in fields] == [getattr(ours, n).offset for n, _ in fields]


def test_prototypes_match_the_header(headers):
    lt, _, _ = headers
    lib = _cublaslt.library()
    names = ["cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatmulDescDestroy",
             "cublasLtMatmulDescSetAttribute", "cublasLtMatrixLayoutCreate", "cublasLtMatrixLayoutDestroy",
             "cublasLtMatmulPreferenceCreate", "cublasLtMatmulPreferenceDestroy",
             "cublasLtMatmulPreferenceSetAttribute", "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmul"]
    for name in names:
        m = re.search(r"cublasStatus_t\s+CUBLASWINAPI\s+" + name + r"\s*\(([^)]*)\)\s*;", lt)
        assert m, name
        params = [p for p in m.group(1).split(",") if p.strip()]
        assert len(getattr(lib, name).argtypes) == len(params), name
        assert getattr(lib, name).restype is ctypes.c_int


def test_library_is_the_one_beside_cupys_cublas(headers):
    _, api, _ = headers
    major = int(re.search(r"#define\s+CUBLAS_VER_MAJOR\s+(\d+)", api).group(1))
    assert _cublaslt.version() // 10000 == major
    lt_path = _cublaslt._library_path()
    assert os.path.basename(lt_path).startswith("libcublasLt.so")
    assert os.path.dirname(lt_path) == os.path.dirname(_cublas.loaded_cublas_path())


def _store(x, trans, ld):
    """Row-major storage of operand x (its logical [rows, cols]), stored transposed when `trans`, row stride ld;
    the padding is NaN. Returns the flat buffer."""
    s = x.T if trans else x
    buf = numpy.full((s.shape[0], ld), numpy.nan)
    buf[:, :s.shape[1]] = s
    return buf.ravel()


def _col_major(flat, rows, cols, ld):
    return numpy.lib.stride_tricks.as_strided(flat, (rows, cols), (8, 8 * ld), writeable=False)


@pytest.mark.parametrize("a_trans", [False, True])
@pytest.mark.parametrize("b_trans", [False, True])
def test_layouts_compute_the_row_major_product(rng, a_trans, b_trans):
    """cuBLASLt's column-major D = op(A_lt) @ op(B_lt) on lt_layouts' views of our buffers, read back row-major,
    is op(A) @ op(B)."""
    m, n, k = 5, 7, 3
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    lda, ldb, ldc = (m if a_trans else k) + 2, (k if b_trans else n) + 3, n + 1
    fa, fb = _store(a, a_trans, lda), _store(b, b_trans, ldb)
    transa, transb, lt_a, lt_b, lt_c = _cublaslt.lt_layouts(m, n, k, a_trans, b_trans, lda, ldb, ldc)
    va, vb = _col_major(fb, *lt_a), _col_major(fa, *lt_b)  # cuBLASLt's A is our B
    op_a = va.T if transa == _cublas.OP_T else va
    op_b = vb.T if transb == _cublas.OP_T else vb
    d = op_a @ op_b  # [n, m]
    flat_c = numpy.full(m * ldc, numpy.nan)
    rows, cols, ld = lt_c
    assert (rows, cols) == d.shape
    numpy.lib.stride_tricks.as_strided(flat_c, (rows, cols), (8, 8 * ld))[...] = d
    c = flat_c.reshape(m, ldc)[:, :n]
    numpy.testing.assert_allclose(c, a @ b, rtol=1e-12, atol=1e-12)
    assert (transa == _cublas.OP_T) == b_trans and (transb == _cublas.OP_T) == a_trans


def test_supports_fp8_constraints():
    assert _cublaslt.supports(48, 80, 96, E4M3, E4M3, F32, b_trans=True) == (True, "")
    assert _cublaslt.LtMatmul.supports(48, 40, 96, E4M3, E4M3, F32, False, True, 96, 96, 48) == \
        _cublaslt.supports(48, 40, 96, E4M3, E4M3, F32, False, True, 96, 96, 48)
    assert _cublaslt.supports(40, 80, 96, E4M3, E4M3, F32, b_trans=True) == (True, "")  # any M (measured)
    ok, reason = _cublaslt.supports(48, 40, 96, E4M3, E4M3, F32, b_trans=True, ldc=48)
    assert not ok and "multiples of 16" in reason and "N=40" in reason and "M=" not in reason
    ok, reason = _cublaslt.supports(48, 80, 96, E4M3, E4M3, F32, b_trans=True, lda=104)
    assert not ok and "lda=104" in reason
    ok, reason = _cublaslt.supports(48, 80, 96, E4M3, E4M3, F32, b_trans=True, ldc=88)
    assert not ok and "ldc=88" in reason
    for a_trans, b_trans in ((False, False), (True, True), (True, False)):
        ok, reason = _cublaslt.supports(48, 80, 96, E4M3, E4M3, F32, a_trans=a_trans, b_trans=b_trans)
        assert not ok and "'TN'" in reason and f"a_trans={a_trans}, b_trans={b_trans}" in reason
    ok, reason = _cublaslt.supports(48, 80, 96, E4M3, F16, F32, b_trans=True)
    assert not ok and "both operands fp8" in reason and "B fp16" in reason
    # 16-bit operands: no fp8 constraint (odd M, either layout)
    for a_trans in (False, True):
        for b_trans in (False, True):
            assert _cublaslt.supports(50, 88, 104, F16, F16, F32, a_trans, b_trans) == (True, "")
            assert _cublaslt.supports(3142, 6144, 4608, BF16, BF16, F32, a_trans, b_trans) == (True, "")


def test_unsupported_and_invalid_raise_before_any_gpu_work():
    with pytest.raises(_cublaslt.LtUnsupported, match=r"cuBLASLt cannot run grad_gelu: M=48 N=40 K=96.*N=40"):
        _cublaslt.LtMatmul(48, 40, 96, E4M3, E4M3, F32, b_trans=True, name="grad_gelu")
    with pytest.raises(_cublaslt.LtUnsupported, match="A e4m3 stored \\[K,M\\].*'TN'"):
        _cublaslt.LtMatmul(48, 80, 96, E4M3, E4M3, F32, a_trans=True, b_trans=True)
    assert issubclass(_cublaslt.LtUnsupported, ValueError)
    bad = [(dict(m=0), "m must be a positive int"), (dict(k=2.0), "k must be a positive int"),
           (dict(a_type=99), "a_type must be one of"), (dict(c_type=E4M3), "c_type must be one of"),
           (dict(lda=50), "lda must be an int >= A's row length"), (dict(ldb=70), "ldb must be an int >= B's"),
           (dict(ldc=79), "ldc must be an int >= N = 80")]
    for change, message in bad:
        args = dict(m=48, n=80, k=96, a_type=F16, b_type=F16, c_type=F32, **{})
        args.update(change)
        with pytest.raises(ValueError, match=message) as info:
            _cublaslt.LtMatmul(**args)
        assert not isinstance(info.value, _cublaslt.LtUnsupported)
        with pytest.raises(ValueError, match=message):
            _cublaslt.supports(**args)


def test_describe_names_shape_types_and_storage():
    text = _cublaslt.describe(272, 1536, 512, E4M3, E4M3, F32, b_trans=True, name="gw2")
    assert text == ("gw2: M=272 N=1536 K=512, A e4m3 stored [M,K] lda=512, B e4m3 stored [N,K] ldb=512, "
                    "C fp32 [M,N] ldc=1536")
    text = _cublaslt.describe(64, 96, 80, BF16, F16, F32, a_trans=True, lda=72)
    assert "A bf16 stored [K,M] lda=72" in text and "B fp16 stored [K,N] ldb=96" in text


def test_a_misaligned_scale_pointer_is_refused_before_any_call():
    # measured on the H200: cuBLASLt builds such a GEMM and then fails every call with NOT_SUPPORTED
    with pytest.raises(ValueError, match="a_scale must be a 16-byte-aligned"):
        _cublaslt.LtMatmul(64, 64, 64, _cublas.R_8F_E4M3, _cublas.R_8F_E4M3, _cublas.R_32F, b_trans=True,
                           a_scale=0x10008)
