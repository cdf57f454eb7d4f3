"""Whether a change to kernels_cu/ changed the code of sm90 GEMM variants, without a GPU (an inspection aid):

    PYTHONPATH=. python3 dev/sm90_ptx_diff.py --against OLD_KERNELS_DIR [--match REGEX]

OLD_KERNELS_DIR holds another checkout's gemm_sm90.cu and common.cuh (e.g. from `git show REV:kernels_cu/...`).
Both sources are compiled by NVRTC with the launcher's options for the variants whose name expression matches
REGEX (default: the engine's fused tf32 kernels, fp16 dgelu with B as stored, staged and direct), and each
variant's PTX entry is compared line by line; printed per variant: its PTX lines and the differing ones (at
most 12 shown). Identical PTX means identical SASS (ptxas is deterministic), so a timing difference between
two runs of such variants is the GPU's, not the code's. Exits 1 if a variant differs (or fails to compile).
Used after adding the pair kernel: only the GemmArgs size differed (docs/decisions/024-sm90-pair-kernel-gemm1.md).
"""

import argparse
import difflib
import re
import sys

DEFAULT_MATCH = r"gemm_sm90_kernel<0, (128|256), 2, [01], [01], 1>"
# a kernel parameter's declared size is not code: reported apart (GemmArgs may grow for other variants)
_PARAM = re.compile(r"^\s*\.param \.align \d+ \.b8 \S+\[\d+\]")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, help="folder with the other gemm_sm90.cu and common.cuh")
    p.add_argument("--match", default=DEFAULT_MATCH, help=f"regex over the name expressions (default {DEFAULT_MATCH!r})")
    return p.parse_args(argv)


def entries(source, expressions):
    """{expression: its PTX .entry text} of `source` compiled with the launcher's options."""
    from cupy_backends.cuda.libs import nvrtc

    from cupyffn import _kernels, _sm90_gemm

    include = ["-I" + _kernels.cuda_include_dir()]  # the headers NVRTC needs outside CuPy's launcher
    prog = nvrtc.createProgram(source, _sm90_gemm.SOURCE, (), ())
    try:
        for e in expressions:
            nvrtc.addNameExpression(prog, e)
        try:
            nvrtc.compileProgram(prog, ["-ftz=true"] + include + list(_sm90_gemm.nvrtc_options()))
        except Exception as e:
            raise RuntimeError(f"NVRTC failed: {e}\n{nvrtc.getProgramLog(prog)}") from None
        ptx = nvrtc.getPTX(prog)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        lowered = {e: nvrtc.getLoweredName(prog, e) for e in expressions}
    finally:
        nvrtc.destroyProgram(prog)
    out = {}
    for e, name in lowered.items():
        start = ptx.index(".entry " + name)
        end = ptx.find(".entry ", start + 1)
        out[e] = ptx[start:end if end > 0 else len(ptx)]
    return out


def compare(old, new):
    """(code lines that differ, parameter declarations that differ) between two PTX entries."""
    diff = [line for line in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0)
            if not line.startswith(("---", "+++", "@@"))]
    params = [line for line in diff if _PARAM.match(line[1:])]
    return [line for line in diff if line not in params], params


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from cupyffn import _kernels, _sm90_gemm

    expressions = [e for e in _sm90_gemm.EXPRESSIONS if re.fullmatch(args.match, e)]
    if not expressions:
        print(f"no variant matches {args.match!r}")
        return 1
    new = entries(_sm90_gemm.module_source(), expressions)
    old = entries(_kernels.source_with_common(_sm90_gemm.SOURCE, args.against), expressions)
    changed = 0
    for e in expressions:
        code, params = compare(old[e], new[e])
        changed += bool(code)
        print(f"{e}: {len(new[e].splitlines())} PTX lines, {len(code)} differ"
              + (f" (and the parameter sizes: {' / '.join(p.split('[')[-1].rstrip(']') for p in params)})" if params
                 else ""))
        for line in code[:12]:
            print("   ", line)
    print(f"{changed} of {len(expressions)} variants changed")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
