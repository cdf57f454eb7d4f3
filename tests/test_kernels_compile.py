"""The CUDA C sources compile for sm_90 with NVRTC (no GPU needed), cleanly and without spills,
and the Python mirrors of their structs and constants agree with them."""

import ctypes
import math
import re
from pathlib import Path

import numpy
import pytest

from cupyffn.cuda import kernels as _kernels
from cupyffn.cpu import numpy_route as _backend
from cupyffn.core import precision as _precision
from cupyffn.gemm import sm90

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

REPO = Path(__file__).resolve().parent.parent
ARCH = "sm_90"


cuda_include_dir = _kernels.cuda_include_dir  # the headers NVRTC needs outside CuPy's launcher


def compile_options():
    return [f"-arch={ARCH}", "-ftz=true", "-Xptxas=-v", "-I" + cuda_include_dir()] + list(_kernels.NVRTC_OPTIONS)


class Compiled:
    def __init__(self, name):
        self.name = name
        self.filename, self.expressions = _kernels.MODULES[name]
        self.source = _kernels.source(_kernels.MODULES[name][0])
        prog = nvrtc.createProgram(self.source, self.filename, (), ())
        try:
            for e in self.expressions:
                nvrtc.addNameExpression(prog, e)
            self.error = None
            try:
                nvrtc.compileProgram(prog, compile_options())
            except Exception as e:  # NVRTCError; the log says why
                self.error = e
            self.log = nvrtc.getProgramLog(prog)
            self.lowered = {}
            self.cubin_size = 0
            if self.error is None:
                self.lowered = {e: nvrtc.getLoweredName(prog, e) for e in self.expressions}
                self.cubin_size = len(nvrtc.getCUBIN(prog))
        finally:
            nvrtc.destroyProgram(prog)


_compiled = {}


@pytest.fixture(params=sorted(_kernels.MODULES))
def module(request):
    name = request.param
    if name not in _compiled:
        _compiled[name] = Compiled(name)
    return _compiled[name]


def test_compiles_for_sm90(module):
    assert module.error is None, f"{module.filename} failed to compile:\n{module.log}"
    assert module.cubin_size > 1000  # a real cubin came back


def test_no_warnings(module):
    assert module.error is None, module.log
    assert "warning" not in module.log.lower(), module.log


def ptxas_functions(log):
    """{function name: its 'N bytes stack frame, ...' line} from the ptxas -v report."""
    report = {}
    lines = log.splitlines()
    for i, line in enumerate(lines):
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            assert i + 1 < len(lines), log
            report[m.group(1)] = lines[i + 1].strip()
    return report


def test_no_stack_and_no_spills(module):
    assert module.error is None, module.log
    entries = re.findall(r"Compiling entry function '([^']+)' for '(\w+)'", module.log)
    assert entries, f"no ptxas report in the log:\n{module.log}"
    assert {arch for _, arch in entries} == {ARCH}
    report = ptxas_functions(module.log)
    assert set(report) >= {name for name, _ in entries}
    for function, line in report.items():
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in line, (function, line)


def test_every_name_expression_is_compiled(module):
    assert module.error is None, module.log
    entries = set(re.findall(r"Compiling entry function '([^']+)'", module.log))
    for expression in module.expressions:
        lowered = module.lowered[expression]
        assert lowered, expression
        assert lowered in entries, (expression, lowered, entries)
    assert entries == set(module.lowered.values())  # and nothing else is a kernel


def test_template_arguments_match_lowered_names(module):
    for expression, lowered in module.lowered.items():
        m = re.fullmatch(r"(\w+)<(\d+)>", expression)
        if m:  # e.g. convert_kernel<2> -> _Z14convert_kernelILi2EE...
            assert f"{len(m.group(1))}{m.group(1)}ILi{m.group(2)}E" in lowered, (expression, lowered)
        else:  # extern "C": not mangled
            assert lowered == expression


def test_common_header_is_pasted_in(module):
    # no directive left (the header's comments may mention it)
    assert not re.search(r'^\s*#\s*include\s*"common\.cuh"', module.source, re.M)
    assert not re.search(r"^\s*#\s*pragma\s+once", module.source, re.M)
    assert len(re.findall(r'^\s*#\s*include\s*"common\.cuh"', (_kernels.kernel_dir() / module.filename).read_text(),
                          re.M)) == 1
    common = (_kernels.kernel_dir() / "common.cuh").read_text()
    assert "namespace cupyffn" in common
    assert "namespace cupyffn" in module.source
    before, after = (_kernels.kernel_dir() / module.filename).read_text().split('#include "common.cuh"', 1)
    assert module.source.startswith(before) and module.source.endswith(after)
    for line in common.splitlines():  # every line of the header except #pragma once and its includes is there
        if not re.match(r'\s*#\s*(pragma\s+once|include\s+")', line):
            assert line in module.source, line
    assert not re.search(r'^\s*#\s*include\s*"activation\.cuh"', module.source, re.M)  # pasted in turn
    assert "tanh_inner_of" in module.source


def test_every_source_is_a_module():
    sources = {p.name for p in (REPO / "kernels_cu").glob("*.cu")}
    listed = {filename for filename, _ in _kernels.MODULES.values()}
    listed.add(sm90.SOURCE)  # sm_90a only: built by cupyffn/gemm/sm90/, tested at the end of this file
    assert sources, "no .cu files found in kernels_cu/"
    assert sources == listed, {"not in MODULES": sources - listed, "missing files": listed - sources}
    assert (REPO / "kernels_cu" / "common.cuh").is_file()


def test_kernel_dir_is_the_repository_folder_here():
    """Run from a checkout, cupyffn finds the top-level kernels_cu/ (and these tests test the
    checkout, not some installed copy: run `python -m pytest` from the repository root)."""
    assert Path(_kernels.__file__).resolve().parent == REPO / "cupyffn" / "cuda", _kernels.__file__
    assert _kernels.kernel_dir().resolve() == REPO / "kernels_cu"


# ---------------------------------------------------------------------------------------------
# ctypes mirrors and shared constants
# ---------------------------------------------------------------------------------------------
def all_sources():
    """{file name: text} of every CUDA source and header in kernels_cu/."""
    folder = REPO / "kernels_cu"
    return {p.name: p.read_text() for p in sorted(folder.glob("*.cu")) + sorted(folder.glob("*.cuh"))}


def define(source, name):
    m = re.search(r"^\s*#define\s+" + name + r"\s+(\S+)", source, re.M)
    return int(m.group(1)) if m else None


def defines():
    """Every integer #define of the sources (kMaxJobs, kSlots, FMT_*)."""
    out = {}
    for text in all_sources().values():
        for name, value in re.findall(r"^\s*#define\s+(\w+)\s+(-?\d+)\s*$", text, re.M):
            out[name] = int(value)
    return out


def mirrors():
    """The ctypes structures of cupyffn.cuda.kernels that mirror a CUDA struct (by name)."""
    found = {}
    for name in dir(_kernels):
        obj = getattr(_kernels, name)
        if isinstance(obj, type) and issubclass(obj, ctypes.Structure) and obj is not ctypes.Structure:
            found[name] = obj
    return found


def struct_source(struct):
    hits = [f for f, text in all_sources().items() if re.search(r"\bstruct\s+" + struct + r"\s*\{", text)]
    assert len(hits) == 1, f"struct {struct} is defined in {hits or 'no file'} of kernels_cu/"
    return hits[0]


def test_every_ctypes_structure_mirrors_a_cuda_struct():
    names = set(mirrors())
    assert {"ConvertJob", "ConvertJobs", "DgeluJob"} <= names, names
    for name in names:
        struct_source(name)


def static_asserted_sizes():
    """{struct: size} from `static_assert(sizeof(S) == EXPR, ...)`, EXPR evaluated with the #defines."""
    consts = defines()
    sizes = {}
    for text in all_sources().values():
        for struct, expr in re.findall(r"static_assert\(\s*sizeof\((\w+)\)\s*==\s*([^,]+),", text):
            expr = re.sub(r"\b[A-Za-z_]\w*\b", lambda m: str(consts[m.group(0)]), expr)
            assert re.fullmatch(r"[\d\s+*()-]+", expr), expr
            sizes[struct] = eval(expr)  # only digits and arithmetic, checked above
    return sizes


def test_struct_sizes_match_static_asserts():
    sizes = static_asserted_sizes()
    for name, cls in mirrors().items():
        assert name in sizes, f"struct {name} has no static_assert on its size in kernels_cu/"
        assert ctypes.sizeof(cls) == sizes[name], (name, ctypes.sizeof(cls), sizes[name])


def cuda_struct_members(source, struct):
    """[(name, kind)] of `struct NAME { ... };` in CUDA source, kind in {'ptr', 'i64', 'i32', ('array', T, N)}."""
    m = re.search(r"\bstruct\s+" + struct + r"\s*\{(.*?)\};", source, re.S)
    assert m, f"struct {struct} not found"
    body = re.sub(r"//[^\n]*", "", m.group(1))
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    members = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        d = re.fullmatch(r"(.*?)\b(\w+)\s*(?:\[(\w+)\])?", " ".join(decl.split()))
        assert d, decl
        ctype, name, count = d.group(1).strip(), d.group(2), d.group(3)
        if "*" in ctype:
            kind = "ptr"
        elif re.fullmatch(r"(const )?long long", ctype):
            kind = "i64"
        elif re.fullmatch(r"(const )?int", ctype):
            kind = "i32"
        else:
            kind = ctype
        if count is not None:
            kind = ("array", kind, count)
        members.append((name, kind))
    return members


def ctypes_members(cls):
    kinds = {ctypes.c_void_p: "ptr", ctypes.c_longlong: "i64", ctypes.c_int: "i32"}
    members = []
    for name, ftype in cls._fields_:
        if issubclass(ftype, ctypes.Array):
            kind = ("array", ftype._type_.__name__, ftype._length_)
        else:
            kind = kinds.get(ftype, ftype.__name__)
        members.append((name, kind))
    return members


@pytest.mark.parametrize("struct", sorted(mirrors()))
def test_struct_field_order_matches_cuda(struct):
    source = all_sources()[struct_source(struct)]
    cuda = cuda_struct_members(source, struct)
    mirror = ctypes_members(getattr(_kernels, struct))
    assert [n for n, _ in mirror] == [n for n, _ in cuda]
    consts = defines()
    for (name, ck), (_, pk) in zip(cuda, mirror):
        if isinstance(ck, tuple):
            count = ck[2]
            ck = ("array", ck[1], int(count) if count.isdigit() else consts[count])
        assert ck == pk, (struct, name, ck, pk)


def test_shared_constants_match():
    consts = defines()
    for fmt in ("FMT_F32", "FMT_BF16", "FMT_BF16X3", "FMT_F16S"):
        assert consts.get(fmt) == getattr(_precision, fmt), fmt
    assert consts.get("kSlots") == _kernels.STATE_SLOTS
    assert consts.get("kMaxJobs") == _kernels.MAX_JOBS
    assert consts.get("kCallGemms") == _kernels.CALL_GEMMS
    assert max(_precision.SLOT.values()) < _kernels.STATE_SLOTS
    kernels = 0
    for name, text in all_sources().items():
        for bound in re.findall(r"__launch_bounds__\((\d+)(?:,\s*\d+)?\)", text):
            assert int(bound) == _kernels.BLOCK, name
            kernels += 1
    assert kernels >= 2


def test_every_precision_has_its_kernels():
    """The engine launches dgelu_kernel<fmt> for every uniform plan and convert_kernel<fmt> for the plans
    that convert operands (planes > 0), and split_e4m3_kernel<0/1> for fp16+fp8 (FMT_F16E4M3): those
    instantiations must be compiled; the forward's form needs its convert and gelu_forward kernels."""
    expressions = {e for _, exprs in _kernels.MODULES.values() for e in exprs}
    for p in _precision.PRECISIONS.values():
        f = p.forward
        assert f"gelu_forward_kernel<{f.fmt}>" in expressions, p.name
        if f.planes:
            assert f"convert_kernel<{f.fmt}>" in expressions, p.name
        if p.fmt == _precision.FMT_F16E4M3:
            assert {_kernels.split_expression(0), _kernels.split_expression(1)} <= expressions, p.name
            continue
        assert f"dgelu_kernel<{p.fmt}>" in expressions, p.name
        if p.planes:
            assert f"convert_kernel<{p.fmt}>" in expressions, p.name


def test_gemm_slot_pairs_match_the_gemms():
    """kGemmSlots[g] (fp16 scale slots of the two operands of GEMM g): dY@W2, dY^T@G, dZ@W1, dZ^T@X."""
    hits = [t for t in all_sources().values() if "kGemmSlots[4][2]" in t]
    assert len(hits) == 1
    m = re.search(r"kGemmSlots\[4\]\[2\]\s*=\s*\{(.*?)\};", hits[0], re.S)
    assert m
    pairs = [tuple(int(v) for v in p) for p in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", m.group(1))]
    S = _precision.SLOT
    assert pairs == [(S["grad_output"], S["weight2"]), (S["grad_output"], S["gelu_out"]),
                     (S["grad_linear1"], S["weight1"]), (S["grad_linear1"], S["hidden_states"])]


def test_bf16x3_patterns_pair_hi_and_lo():
    """Plane j of an A operand meets plane j of its B operand: the three products must be
    hi*hi, hi*lo and lo*hi (lo*lo never formed), for every A/B pairing of the four GEMMs."""
    P = _precision.PATTERN

    def planes(pattern):
        return ["lo" if (pattern >> j) & 1 else "hi" for j in range(3)]

    for a, b in (("grad_output", "weight2"), ("grad_output", "gelu_out"), ("grad_linear1", "weight1"),
                 ("grad_linear1", "hidden_states")):
        products = sorted(x + "*" + y for x, y in zip(planes(P[a]), planes(P[b])))
        assert products == ["hi*hi", "hi*lo", "lo*hi"], (a, b, products)


def test_gelu_constants_match_python():
    """tanh_inner's sqrt(2/pi) and gelu_grad's c0 = sqrt(2/pi) / 2, c1 = c0 * 3 * 0.044715, in the kernels' activation
    header and in its Python description (which the NumPy backend uses)."""
    common = all_sources()["activation.cuh"]

    def constant(name):
        return float(re.search(name + r"\s*=\s*([0-9.eE+-]+)f", common).group(1))

    sqrt2pi, c0, c1 = constant("kSqrt2OverPi"), constant("kC0"), constant("kC1")
    assert abs(sqrt2pi - math.sqrt(2 / math.pi)) < 1e-15
    assert abs(c0 - math.sqrt(2 / math.pi) / 2) < 1e-15
    assert abs(c1 - math.sqrt(2 / math.pi) / 2 * 3 * 0.044715) < 1e-15
    from cupyffn.core import activation

    assert activation._C == numpy.float32(sqrt2pi)
    assert (activation._C0, activation._C1) == (numpy.float32(c0), numpy.float32(c1))
    assert _backend.gelu_grad is activation.grad and _backend.tanh_inner is activation.tanh_inner


# ---------------------------------------------------------------------------------------------
# The Hopper GEMM (kernels_cu/gemm_sm90.cu + kernels_cu/sm90/*.cuh): sm_90a only, built by cupyffn/gemm/sm90/
# ---------------------------------------------------------------------------------------------
class CompiledSm90:
    """gemm_sm90.cu compiled as the launcher builds it (its options, -arch=sm_90a, and the static_asserts that the
    launcher's shared-memory and stage numbers are the kernel's: config.py budget_checks), every variant of
    sm90.VARIANTS."""

    def __init__(self, trace=False):
        configs = [sm90.Sm90Config(**{**c.__dict__, "trace": trace}) for c in sm90.VARIANTS]
        self.expressions = [c.expression for c in configs]
        self.source = _kernels.source(sm90.SOURCE) + sm90.config.budget_checks()  # as the launcher compiles it
        prog = nvrtc.createProgram(self.source, sm90.SOURCE, (), ())
        try:
            for e in self.expressions:
                nvrtc.addNameExpression(prog, e)
            self.error = None
            try:
                nvrtc.compileProgram(prog, ["-ftz=true", "-Xptxas=-v", "-I" + cuda_include_dir()]
                                     + list(configs[0].nvrtc_options))
            except Exception as e:
                self.error = e
            self.log = nvrtc.getProgramLog(prog)
            self.lowered, self.ptx = {}, ""
            if self.error is None:
                self.lowered = {e: nvrtc.getLoweredName(prog, e) for e in self.expressions}
                ptx = nvrtc.getPTX(prog)
                self.ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
                self.cubin_size = len(nvrtc.getCUBIN(prog))
        finally:
            nvrtc.destroyProgram(prog)


@pytest.fixture(scope="module")
def sm90_gemm():
    return CompiledSm90()


@pytest.mark.parametrize("name,value", [("BLOCK_K", 32), ("EW_RING", 3), ("XT_COLS", 64)])
def test_a_budget_that_disagrees_with_the_kernel_fails_the_build(monkeypatch, name, value):
    """The launcher's shared-memory arithmetic (cupyffn/gemm/sm90/config.py) is checked against types.cuh's at every
    build: one of its numbers changed, and the source the launcher compiles no longer compiles (no variant
    instantiated: the static_asserts alone)."""
    monkeypatch.setattr(sm90.config, name, value)
    source = _kernels.source(sm90.SOURCE) + sm90.config.budget_checks()
    prog = nvrtc.createProgram(source, sm90.SOURCE, (), ())
    try:
        with pytest.raises(Exception):
            nvrtc.compileProgram(prog, ["-I" + cuda_include_dir()] + list(sm90.VARIANTS[0].nvrtc_options))
        assert "config.py disagrees with types.cuh" in nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def test_sm90_gemm_compiles_for_sm90a_without_spills(sm90_gemm):
    c = sm90_gemm
    assert c.error is None, f"{sm90.SOURCE} failed to compile for sm_90a:\n{c.log}"
    assert "warning" not in c.log.lower(), c.log  # C7508 would say setmaxnreg was ignored
    entries = re.findall(r"Compiling entry function '([^']+)' for '(\w+)'", c.log)
    assert {arch for _, arch in entries} == {"sm_90a"}, entries
    assert {name for name, _ in entries} == set(c.lowered.values()), (entries, c.lowered)
    report = ptxas_functions(c.log)
    registers = {}
    for name in c.lowered.values():
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report[name], (name, report[name])
        m = re.search(r"Function properties for " + re.escape(name) + r"\n.*\n.*Used (\d+) registers", c.log)
        assert m, (name, c.log)
        registers[name] = int(m.group(1))
    # 384 threads at one CTA per SM: the entry cap is 168; setmaxnreg moves 40 -> 232 at run time.
    assert max(registers.values()) <= 168, registers
    print("sm90 GEMM registers:", {e: registers[c.lowered[e]] for e in c.expressions}, c.cubin_size)


def test_sm90_gemm_traced_compiles():
    """Sm90Config(trace=True) (dev/sm90_trace.py): every variant with the per-tile timestamps compiles, and the
    trace's global is there; the product's build has none (test_sm90_gemm_ptx_uses_the_hopper_paths)."""
    c = CompiledSm90(trace=True)
    assert c.error is None, c.log
    assert "cupyffn_sm90_trace" in c.ptx and "%globaltimer" in c.ptx


def test_sm90_gemm_ptx_uses_the_hopper_paths(sm90_gemm):
    """wgmma from shared memory, TMA loads completing on mbarriers, register reallocation: if any of
    these were missing, the kernel would be on a slower path or not the kernel described."""
    c = sm90_gemm
    assert c.error is None, c.log
    for needle in ("wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16", "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
                   "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3",  # the pair kernel's cross terms
                   "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes",
                   "setmaxnreg.inc.sync.aligned.u32 232", "setmaxnreg.dec.sync.aligned.u32 40", "mbarrier.try_wait.parity",
                   "cp.async.cg.shared.global.L2::cache_hint", "cp.async.wait_group"):  # the staged dgelu epilogue
        assert needle in c.ptx, needle
    assert ".local" not in c.ptx  # no local-memory arrays (the accumulators stay in registers)
    assert "cupyffn_sm90_trace" not in c.ptx  # no trace in the product


def test_sm90_headers_are_pasted_in():
    """gemm_sm90.cu includes its kernels_cu/sm90/ headers, each pasted once into the text NVRTC compiles (CuPy's
    cache key then changes with every header), and every header in kernels_cu/sm90/ is one of them."""
    text = (_kernels.kernel_dir() / sm90.SOURCE).read_text()
    included = set(re.findall(r'^#include "(sm90/[^"]+)"', text, re.M))
    assert included == {f"sm90/{p.name}" for p in (_kernels.kernel_dir() / "sm90").glob("*.cuh")}
    source = _kernels.source(sm90.SOURCE)
    assert not re.search(r'^\s*#\s*include\s*"', source, re.M) and "#pragma once" not in source
    for name in included:
        body = (_kernels.kernel_dir() / name).read_text().replace("#pragma once\n", "")
        assert source.count(body) == 1, name


def test_cuda_files_stay_short():
    """No CUDA file in kernels_cu/ over 600 lines."""
    for path in sorted((_kernels.kernel_dir()).rglob("*.cu*")):
        assert len(path.read_text().splitlines()) <= 600, path


def test_sm90_gemm_args_mirror():
    source = (_kernels.kernel_dir() / "sm90" / "types.cuh").read_text()
    cuda = cuda_struct_members(source, "GemmArgs")
    kinds = {ctypes.c_void_p: "ptr", ctypes.c_longlong: "i64", ctypes.c_int: "i32", ctypes.c_float: "float"}
    mirror = [(name, kinds[t]) for name, t in sm90.GemmArgs._fields_]
    assert mirror == cuda
    m = re.search(r"static_assert\(sizeof\(GemmArgs\) == (\d+),", source)
    assert m and int(m.group(1)) == ctypes.sizeof(sm90.GemmArgs) == 160
    assert ctypes.sizeof(sm90.TmaDesc) == 128
    assert define(source, "kEpiF32") == sm90.EPI_F32
    assert define(source, "kEpiDgeluF16") == sm90.EPI_DGELU_F16
    assert define(source, "kEpiDgeluBf16x3") == sm90.EPI_DGELU_BF16X3
    assert define(source, "kEpiDgeluF16G") == sm90.EPI_DGELU_F16G
    assert define(source, "kOpF16") == sm90.OP_F16
    assert define(source, "kOpBf16") == sm90.OP_BF16
    assert define(source, "kOpF16E4M3") == sm90.OP_F16E4M3
