"""The GEMM backends: a GEMM described once (desc), run by cuBLAS, cuBLASLt or the Hopper kernel (sm90)."""
