"""The PTX of every kernel, hashed, to show that a change to the sources changed no code (no GPU needed; NVRTC):

    PYTHONPATH=. python3 dev/ptx_hashes.py --out before.json           # on the old checkout
    PYTHONPATH=. python3 dev/ptx_hashes.py --against before.json       # on the new one: exits 1 if a kernel differs

Every module of cupyffn/cuda/kernels.py MODULES (sm_90, its name expressions) and every sm90 GEMM variant of
cupyffn.gemm.sm90.VARIANTS (sm_90a, the launcher's options) is compiled from the sources as the package pastes them,
and its PTX hashed (sha256) after one normalization: NVRTC names each program's internal symbols with a hash that
changes from compile to compile (``_ZN<n>_INTERNAL_<...>_<8 hex>_<n>``), so those are named alike first. Identical
PTX means identical SASS (ptxas is deterministic). Decision 055 used it to show the front door changed no kernel.
"""

import argparse
import hashlib
import json
import re
import sys
from concurrent.futures import ProcessPoolExecutor

_INTERNAL = re.compile(r"_ZN\d+_INTERNAL_\w+?_[0-9a-f]{8}_\d+")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write {kernel: [sha256, PTX characters]} here (JSON)")
    p.add_argument("--against", help="an earlier --out file: print the kernels whose PTX differs, exit 1 if any")
    p.add_argument("--match", default="", help="regex over the kernels' names (re.search; default: every kernel)")
    p.add_argument("--jobs", type=int, default=2, help="parallel NVRTC compilations")
    return p.parse_args(argv)


def compile_ptx(job):
    """(name, sha256 of the normalized PTX, its length) of one program."""
    from cupy_backends.cuda.libs import nvrtc

    name, source, expressions, options = job
    prog = nvrtc.createProgram(source, name, (), ())
    try:
        for e in expressions:
            nvrtc.addNameExpression(prog, e)
        try:
            nvrtc.compileProgram(prog, list(options))
        except Exception as e:
            raise RuntimeError(f"{name}: NVRTC failed: {e}\n{nvrtc.getProgramLog(prog)}") from None
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    ptx = _INTERNAL.sub("_ZN_INTERNAL_", ptx.decode() if isinstance(ptx, bytes) else ptx)
    return name, hashlib.sha256(ptx.encode()).hexdigest(), len(ptx)


def jobs(match=""):
    from cupyffn.cuda import kernels
    from cupyffn.gemm import sm90

    include = "-I" + kernels.cuda_include_dir()
    out = [(name, kernels.source(filename), expressions, ("-arch=sm_90", "-ftz=true", include) + kernels.NVRTC_OPTIONS)
           for name, (filename, expressions) in sorted(kernels.MODULES.items())]
    out += [("sm90:" + c.expression, kernels.source(sm90.SOURCE), (c.expression,), ("-ftz=true", include) +
             tuple(c.nvrtc_options)) for c in sm90.VARIANTS]
    return [j for j in out if re.search(match, j[0])]


def main(argv=None):
    args = parse_args(argv)
    todo = jobs(args.match)
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(compile_ptx, todo))
    else:
        results = [compile_ptx(job) for job in todo]
    hashes = {name: [digest, size] for name, digest, size in results}
    print(f"{len(hashes)} kernels compiled")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(hashes, f, indent=1, sort_keys=True)
    if args.against:
        with open(args.against) as f:
            before = json.load(f)
        differ = sorted(n for n in hashes if n in before and before[n][0] != hashes[n][0])
        new, gone = sorted(set(hashes) - set(before)), sorted(set(before) - set(hashes))
        print(f"{len(differ)} differ, {len(new)} new, {len(gone)} gone of {len(before)} compared")
        for name in differ:
            print(f"  differs: {name}")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
