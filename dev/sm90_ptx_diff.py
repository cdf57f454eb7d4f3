"""Whether a change to kernels_cu/ changed the code of sm90 GEMM variants, without a GPU (an inspection aid):

    PYTHONPATH=. python3 dev/sm90_ptx_diff.py --against OLD_KERNELS_DIR [--match REGEX] [--legacy]

OLD_KERNELS_DIR holds another checkout's kernels_cu/ (gemm_sm90.cu, common.cuh and, since the split into headers,
sm90/*.cuh; e.g. `git worktree add /tmp/old REV` and /tmp/old/kernels_cu). Both sources are compiled by NVRTC with
the launcher's options for the variants of cupyffn.gemm.sm90.VARIANTS whose name expression matches REGEX (default:
all), and each variant's PTX entry is compared line by line after naming the entry KERNEL (the mangled name encodes
the template arguments) and numbering basic-block labels from 0 (their prefix counts the entries before in the
module); printed per variant: its PTX lines and the differing ones (at most 12 shown); a kernel parameter's
declared size is reported apart (not code). Identical PTX means identical SASS (ptxas is deterministic), so a timing
difference between two runs of such variants is the GPU's, not the code's. Exits 1 if a variant differs.

--legacy: OLD_KERNELS_DIR is from before the variants became Sm90Config (28117da and older): its templates had the
B layout (and clusters, and the pair's schedule) as parameters, so the old name of each variant is
gemm_sm90_kernel<OP, BN, EPI, PP, XS, 1> and gemm_sm90_pair_kernel<BN, 0, TA, 1>, compiled with the -D macros its
launcher passed (CUPYFFN_XT_COLS=32, CUPYFFN_XS_STAGE_DROP=1, CUPYFFN_EW_STAGES=4, CUPYFFN_EW_RING=2).
"""

import argparse
import difflib
import re
import sys

# a kernel parameter's declared size is not code: reported apart
_PARAM = re.compile(r"^\s*\.param \.align \d+ \.b8 \S+\[\d+\]")
_LEGACY_OPTIONS = ("-DCUPYFFN_XT_COLS=32", "-DCUPYFFN_XS_STAGE_DROP=1", "-DCUPYFFN_EW_STAGES=4", "-DCUPYFFN_EW_RING=2")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, help="another checkout's kernels_cu folder")
    p.add_argument("--match", default="", help="regex over the name expressions (re.search; default: every variant)")
    p.add_argument("--legacy", action="store_true", help="the old checkout predates Sm90Config (28117da and older)")
    return p.parse_args(argv)


def legacy_expression(config):
    """The name expression of `config`'s variant in the sources before Sm90Config (B layout 1: [K, N])."""
    if config.op == 2:  # the pair: <BN, PP, TA, BT>
        return f"gemm_sm90_pair_kernel<{config.block_n}, 0, {'mk km'.split().index(config.a_layout)}, 1>"
    return config.expression[:-1] + ", 1>"


def entries(source, expressions, options):
    """{expression: its PTX .entry text, the entry named KERNEL and its labels numbered from 0}."""
    from cupy_backends.cuda.libs import nvrtc

    from cupyffn.cuda import kernels as _kernels
    from cupyffn.gemm import sm90

    include = ["-I" + _kernels.cuda_include_dir()]  # the headers NVRTC needs outside CuPy's launcher
    prog = nvrtc.createProgram(source, sm90.SOURCE, (), ())
    try:
        for e in expressions:
            nvrtc.addNameExpression(prog, e)
        try:
            nvrtc.compileProgram(prog, ["-ftz=true"] + include + list(options))
        except Exception as e:
            raise RuntimeError(f"NVRTC failed: {e}\n{nvrtc.getProgramLog(prog)}") from None
        ptx = nvrtc.getPTX(prog)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        lowered = {e: nvrtc.getLoweredName(prog, e) for e in expressions}
    finally:
        nvrtc.destroyProgram(prog)
    out = {}
    for e, name in lowered.items():
        start = ptx.index(".entry " + name + "(")
        end = ptx.find(".entry ", start + 1)
        end = ptx.rfind("\n}", start, end if end > 0 else len(ptx)) + 2  # the entry's body, not the next's header
        out[e] = re.sub(r"\$L__BB\d+_", "$L__BB_", ptx[start:end].replace(name, "KERNEL"))
    return out


def compare(old, new):
    """(code lines that differ, parameter declarations that differ) between two PTX entries."""
    diff = [line for line in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0)
            if not line.startswith(("---", "+++", "@@"))]
    params = [line for line in diff if _PARAM.match(line[1:])]
    return [line for line in diff if line not in params], params


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from cupyffn.cuda import kernels as _kernels
    from cupyffn.gemm import sm90

    configs = [c for c in sm90.VARIANTS if re.search(args.match, c.expression)]
    if not configs:
        print(f"no variant matches {args.match!r}")
        return 1
    options = configs[0].nvrtc_options
    new = entries(_kernels.source(sm90.SOURCE), [c.expression for c in configs], options)
    old_names = {c.expression: legacy_expression(c) if args.legacy else c.expression for c in configs}
    old = entries(_kernels.source_with_common(sm90.SOURCE, args.against), list(old_names.values()),
                  options + (_LEGACY_OPTIONS if args.legacy else ()))
    changed = 0
    for c in configs:
        e = c.expression
        code, params = compare(old[old_names[e]], new[e])
        changed += bool(code)
        print(f"{e}{' (was ' + old_names[e] + ')' if old_names[e] != e else ''}: {len(new[e].splitlines())} PTX lines, "
              f"{len(code)} differ" + (f" (and the parameter sizes: {' / '.join(p.split('[')[-1].rstrip(']') for p in params)})"
                                       if params else ""))
        for line in code[:12]:
            print("   ", line)
    print(f"{changed} of {len(configs)} variants changed")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
