"""How long a sum one GEMM accumulator may carry: the K-chunk plan of every GEMM.

A Hopper tensor-core GEMM (fp16, bf16 or e4m3 operands, fp32 accumulator) does not round its running sum like a
sequence of IEEE fp32 additions, and its error grows about linearly with the contraction length K (measured on
the H200: docs/decisions/001-k-chunks.md). The fp32-class plans would leave their contract once K reaches tens of
thousands, which the weight-gradient GEMMs (K = tokens) do in large-batch training. Plain fp32 SGEMM's error
grows too, more slowly (3x from T = 8192 to 352,000, to 4.8e-6 against its 5e-6 contract). So every GEMM whose K
exceeds MAX_K is run as consecutive K-chunks of at most MAX_K each, the first writing the output with the
caller's beta and every later one adding onto it with beta = 1: the partial products meet in IEEE fp32 (cuBLAS's
epilogue), in a fixed order, so the result is the same bits on every call, nothing is allocated and the launches
capture. The sm90 kernels sum their whole K in one accumulator: plans use them only where K <= MAX_K.

MAX_K counts the K that one accumulator sums, planes included (bf16x3 stacks three planes along K: 3 T for the
weight gradients). 24576 is the longest K of the official workloads (bf16x3 at T = 8192), so none of them is
chunked; there the measured error of the worst plan (bf16x3) is 3.9e-5, 2.6x inside its 1e-4 contract.
"""

#: The longest K one GEMM accumulator sums, fp32 SGEMM included (module docstring).
MAX_K = 24576
#: Chunk lengths (all but the last) are multiples of this: e4m3 GEMMs need K and 16-byte aligned operands in
#: multiples of 16, and 16-bit operands stay 128-byte aligned for any leading dimension.
ALIGN = 64


def chunks(k, max_k=MAX_K, align=ALIGN):
    """The K-chunks ``((k0, length), ...)`` that cover ``range(k)`` in order, each at most `max_k` long.

    k <= max_k (or max_k None / 0: chunking off) gives one chunk, k == 0 none. Otherwise the fewest chunks that
    fit, of equal length rounded up to a multiple of `align` (`max_k` must be one), the last one shorter.
    """
    for name, value, least in (("k", k, 0), ("align", align, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}; got {value!r}")
    if max_k is not None and (isinstance(max_k, bool) or not isinstance(max_k, int) or max_k < 0
                              or max_k % align):
        raise ValueError(f"max_k must be None or a non-negative multiple of align = {align}; got {max_k!r}")
    if k == 0:
        return ()
    if not max_k or k <= max_k:
        return ((0, k),)
    count = -(-k // max_k)
    length = -(-(-(-k // count)) // align) * align  # ceil(k / count), rounded up to align: still <= max_k
    return tuple((k0, min(length, k - k0)) for k0 in range(0, k, length))


def chunked(k, max_k=MAX_K):
    """Whether a GEMM of contraction length `k` runs in more than one chunk."""
    return bool(max_k) and k > max_k
