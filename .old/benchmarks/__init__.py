"""bench.py's parts, one concern per module (a top-level folder, not inside the package: none of it
ships in the wheel, and it may import torch, CUPTI and matplotlib, which cupyffn itself never needs).

- protocol: the benchmark's measurement protocol (L2 flush, input rotation, CUPTI/event timing, check rounds)
- impls:    the implementations compared (cupyffn's precisions, plain CuPy, PyTorch eager and compiled)
- gpu:      the full GPU run that ties them together and produces the results dict
- loop:     steady-state loop mode (host time per call, graphs)
- cpu:      the NumPy smoke path when there is no GPU
- report:   everything computed from results (summary, targets, console and Markdown tables, README, plot)
"""
