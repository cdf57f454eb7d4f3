"""The SASS of sm90 GEMM variants, without a GPU (an inspection aid, not a test):

    PYTHONPATH=. python3 dev/sm90_sass.py [--match REGEX] [--dump DIR]

For each variant of cupyffn.gemm.sm90.VARIANTS whose name expression matches REGEX (default: the tf32 plan's fused
kernels, fp16 dgelu staged), NVRTC makes the PTX with the launcher's options, ptxas assembles
it for sm_90a and nvdisasm lists the instructions; printed per variant: instructions, branch regions (BSSY,
each a divergent if/else the compiler could not turn into predication), branches (BRA), shared loads (LDS),
global stores (STG), cp.async copies (LDGSTS), wgmma (HGMMA), and the registers and spills ptxas reports.
--dump writes each listing to DIR/<variant>.sass. It found a branch per element in the staged epilogue
(docs/decisions/035-no-branch-per-element.md).

Needs ptxas (the nvidia-cuda-nvcc-cu12 wheel's, or one on PATH) and nvdisasm (the nvidia-cuda-nvdisasm
wheel's, or on PATH): neither is a dependency of cupyffn; the script says which one it did not find. (The
cubin NVRTC itself returns is not one nvdisasm 13 reads, hence the detour through ptxas.)
"""

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

DEFAULT_MATCH = r"gemm_sm90_kernel<0, (128|256), 2, [01], 1>"
COUNTED = ("BSSY", "BRA", "LDS", "STG", "LDGSTS", "HGMMA")


def find_tool(name, wheel_dirs):
    """The path of `name`: in one of the pip wheels' nvidia/<dir>/bin folders on sys.path, else on PATH."""
    for entry in sys.path:
        for sub in wheel_dirs:
            path = os.path.join(entry, "nvidia", sub, "bin", name)
            if os.path.isfile(path):
                return path
    return shutil.which(name)


def count_sass(listing):
    """Instruction counts of an nvdisasm listing: total instructions and each of COUNTED (by opcode, any
    modifiers, predicated or not)."""
    counts = collections.Counter()
    for line in listing.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", line)
        if not m:
            continue
        counts["instructions"] += 1
        if m.group(1) in COUNTED:
            counts[m.group(1)] += 1
    return {key: counts[key] for key in ("instructions",) + COUNTED}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--match", default=DEFAULT_MATCH, help="regular expression on the name expressions (re.search)")
    parser.add_argument("--dump", default=None, help="folder for the listings")
    args = parser.parse_args(argv)
    ptxas = find_tool("ptxas", ("cuda_nvcc",))
    nvdisasm = find_tool("nvdisasm", ("cu13", "cuda_nvdisasm"))
    missing = [name for name, path in (("ptxas", ptxas), ("nvdisasm", nvdisasm)) if path is None]
    if missing:
        print(f"sm90_sass: not found: {', '.join(missing)} (pip install nvidia-cuda-nvcc-cu12 nvidia-cuda-nvdisasm, "
              "or put them on PATH)")
        return 2
    from cupy_backends.cuda.libs import nvrtc

    from cupyffn.cuda import kernels as _kernels
    from cupyffn.gemm import sm90

    options = list(sm90.VARIANTS[0].nvrtc_options) + ["-ftz=true", "-I" + _kernels.cuda_include_dir()]
    names = [c.expression for c in sm90.VARIANTS if re.search(args.match, c.expression)]
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    for name in names:
        prog = nvrtc.createProgram(_kernels.source(sm90.SOURCE), sm90.SOURCE, (), ())
        try:
            nvrtc.addNameExpression(prog, name)
            nvrtc.compileProgram(prog, options)
            lowered = nvrtc.getLoweredName(prog, name)
            ptx = nvrtc.getPTX(prog)
        finally:
            nvrtc.destroyProgram(prog)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        with tempfile.TemporaryDirectory() as tmp:
            ptx_path, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
            with open(ptx_path, "w") as f:
                f.write(ptx)
            asm = subprocess.run([ptxas, "-arch=sm_90a", "-O3", "-v", ptx_path, "-o", cubin], capture_output=True,
                                 text=True, check=True)
            listing = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
        regs = re.search(r"Used (\d+) registers", asm.stderr)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", asm.stderr)
        counts = count_sass(listing)
        print(f"{name}: " + " ".join(f"{k} {v}" for k, v in counts.items())
              + f" registers {regs.group(1) if regs else '?'} spills {spills.group(1) + '/' + spills.group(2) if spills else '?'}")
        if args.dump:
            safe = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")
            with open(os.path.join(args.dump, safe + ".sass"), "w") as f:
                f.write(f"// {name} ({lowered})\n" + listing)
    return 0


if __name__ == "__main__":
    sys.exit(main())
