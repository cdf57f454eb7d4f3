"""The Hopper (sm_90a) GEMM: typed configs, the one function that chooses them, tensor maps and launches."""
