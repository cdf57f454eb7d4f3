"""The 16-bit plans' GEMMs one by one, each in the forms it could take (GPU; docs/decisions/061): cuBLASLt with the
epilogue the plan uses, the same GEMM without it, written transposed (the weight gradient in an [in, out] parameter's
layout, its bias gradient by the BGRADA epilogue), torch's own GEMM, and the memory floor of the elementwise pass that
would replace an epilogue. Per form: the median time (CUDA events, L2 flushed), the kernels it launched (names, from
torch.profiler) and, for the bias-gradient forms, the error of the bias gradient against torch's fp32 column sums.

    PYTHONPATH=. python dev/lt_gemm_choices.py --shapes 2048x1536x6144 8192x1024x4096 --out $OUT/lt-gemm-choices.json

Shapes are TxDxH; activations bf16 (--dtype float16 for fp16), weight gradients fp32 (fp32 master weights).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _event_timing import flushed_median_ms  # noqa: E402
from _json_out import save_json  # noqa: E402

DEFAULT_SHAPES = ("256x1536x6144", "2048x1536x6144", "8192x1536x6144", "8192x1024x4096")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="TxDxH (default: %(default)s)")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "results"), "lt-gemm-choices.json"))
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    import cupy
    import torch

    from cupyffn.gemm import cublas, cublaslt
    from cupyffn.lt.engine import CUDA_TYPE

    dev = torch.device("cuda")
    act = getattr(torch, args.dtype)
    A, F = CUDA_TYPE[args.dtype], CUDA_TYPE["float32"]
    consts = torch.tensor([0.0, 1.0], device=dev)
    handle = cublas.acquire(torch.cuda.current_device())
    flush_buf = torch.empty(64 << 20, dtype=torch.int32, device=dev)

    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)  # torch's and the GEMMs' stream

    def timed(fn):
        """The median of fn() (L2 flushed before each sample) and the kernels one call launches."""
        ms = flushed_median_ms(cupy, stream, fn, flush_buf.zero_, args.reps, 3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return {"ms": ms, "kernels": [e.key for e in prof.key_averages() if e.device_time_total > 0]}

    def lt(m, n, k, a, b, c, a_trans=False, b_trans=False, epilogue=cublaslt.EPILOGUE_DEFAULT, out_type=None,
           bias=None, aux=None, bias_type=None):
        try:
            c_type = A if out_type is None else out_type  # not `or`: float32's cudaDataType is 0
            g = cublaslt.LtMatmul(m, n, k, A, A, c_type, a_trans, b_trans, device_id=dev.index or 0,
                                  epilogue=epilogue, bias_type=bias_type)
        except cublaslt.LtUnsupported as e:
            return None, str(e)
        g.alpha.value, g.beta.value = consts.data_ptr() + 4, consts.data_ptr()
        g.a.value, g.b.value, g.c.value = a.data_ptr(), b.data_ptr(), c.data_ptr()
        if bias is not None or aux is not None:
            g.set_epilogue(bias=None if bias is None else bias.data_ptr(), aux=None if aux is None else aux.data_ptr())

        def run():
            handle.bind(torch.cuda.current_stream().cuda_stream)
            g(handle)
        return run, None

    def record(rows, name, fn_or_none, why=None, **extra):
        if fn_or_none is None:
            rows[name] = {"unsupported": why}
        else:
            rows[name] = dict(timed(fn_or_none), **extra)
        r = rows[name]
        print(f"    {name:44s} " + (f"{r['ms'] * 1e3:8.1f} us  {' | '.join(k[:60] for k in r['kernels'])}"
                                    if "ms" in r else f"unsupported: {why[:120]}")
              + "".join(f"  {k} {v:.1e}" for k, v in extra.items()), flush=True)

    def rel(got, want):
        return float((got.double() - want.double()).norm() / want.double().norm())

    def first_call_errors(run, outputs, errors):
        """errors() ({name: relative error}) after one call of `run` on `outputs` NaN-poisoned first ({} when the form
        is unsupported): a form that leaves any output element unwritten reads NaN."""
        if run is None:
            return {}
        for o in outputs:
            o.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        return errors()

    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype,
               "cublaslt": cublaslt.version(), "shapes": {}}
    copy_src = torch.randn(64 << 20, device=dev).to(act)
    copy_dst = torch.empty_like(copy_src)
    bw = 2 * copy_src.numel() * copy_src.element_size() / timed(lambda: copy_dst.copy_(copy_src))["ms"] / 1e9  # TB/s
    results["copy_bandwidth_tb_s"] = bw
    print(f"device copy bandwidth {bw:.2f} TB/s", flush=True)
    for shape in args.shapes:
        T, D, H = (int(v) for v in shape.split("x"))
        print(f"T={T} D={D} H={H}", flush=True)
        rows = {}
        x, dy = torch.randn(T, D, device=dev).to(act), torch.randn(T, D, device=dev).to(act)
        w1, w2 = (torch.randn(H, D, device=dev) / D ** 0.5).to(act), (torch.randn(D, H, device=dev) / H ** 0.5).to(act)
        b1, b2 = torch.randn(H, device=dev).to(act), torch.randn(D, device=dev).to(act)
        z, g, gl = (torch.randn(T, H, device=dev).to(act) for _ in range(3))
        out_th, out_td = torch.empty(T, H, device=dev, dtype=act), torch.empty(T, D, device=dev, dtype=act)
        gw_hd, gw_dh = torch.empty(H, D, device=dev), torch.empty(D, H, device=dev)
        gb_h, gb_d = torch.empty(H, device=dev), torch.empty(D, device=dev)
        E = cublaslt
        # forward GEMM1: z = x w1^T + b1, g = GELU(z)
        record(rows, "fwd1 gelu_aux_bias", *lt(T, H, D, x, w1, out_th, b_trans=True, epilogue=E.EPILOGUE_GELU_AUX_BIAS,
                                                bias=b1, aux=z))
        record(rows, "fwd1 bias", *lt(T, H, D, x, w1, out_th, b_trans=True, epilogue=E.EPILOGUE_BIAS, bias=b1))
        record(rows, "fwd1 torch addmm", lambda: torch.addmm(b1, x, w1.t(), out=out_th))
        record(rows, "fwd2 bias", *lt(T, D, H, g, w2, out_td, b_trans=True, epilogue=E.EPILOGUE_BIAS, bias=b2))
        record(rows, "fwd2 torch addmm", lambda: torch.addmm(b2, g, w2.t(), out=out_td))
        # backward GEMM1: grad_linear1 = (dy w2) * GELU'(z)
        record(rows, "bwd1 dgelu", *lt(T, H, D, dy, w2, out_th, epilogue=E.EPILOGUE_DGELU, aux=z))
        run, why = lt(T, H, D, dy, w2, out_th, epilogue=E.EPILOGUE_DGELU_BGRAD, aux=z, bias=gb_h, bias_type=F)
        errors = first_call_errors(run, (gb_h, out_th), lambda: {"bias_rel_err": rel(gb_h, out_th.float().sum(0))})
        record(rows, "bwd1 dgelu_bgrad (fp32 bias grad)", run, why, **errors)
        record(rows, "bwd1 plain", *lt(T, H, D, dy, w2, out_th))
        record(rows, "bwd1 torch mm", lambda: torch.mm(dy, w2, out=out_th))
        rows["bwd1 elementwise floor"] = {"ms": 3 * T * H * 2 / bw / 1e9,
                                          "what": "read the product and z, write grad_linear1 (bf16)"}
        def weight_gemm(label, summed, other, grad, grad_t, bias):
            """grad [K-side of `summed`, other] = summed^T other with the bias gradient (column sums of `summed`) by
            BGRADB, plain, and written transposed (grad_t = other^T summed) with BGRADA, plain."""
            m, n = summed.shape[1], other.shape[1]
            want = summed.float().sum(0)
            for name, (mm, nn, a, b, c, bgrad) in (("", (m, n, summed, other, grad, E.EPILOGUE_BGRADB)),
                                                   (" transposed", (n, m, other, summed, grad_t, E.EPILOGUE_BGRADA))):
                run, why = lt(mm, nn, T, a, b, c, a_trans=True, epilogue=bgrad, out_type=F, bias=bias)
                errors = first_call_errors(run, (c, bias), lambda: {
                    "bias_rel_err": rel(bias, want), "grad_rel_err": rel(c, a.float().t() @ b.float())})
                record(rows, f"{label}{name} {'bgrada' if name else 'bgradb'}", run, why, **errors)
                record(rows, f"{label}{name} plain", *lt(mm, nn, T, a, b, c, a_trans=True, out_type=F))

        # backward GEMM4: grad_weight1 [H, D] = gl^T x (+ grad_bias1 = column sums of gl); transposed: [D, H]
        weight_gemm("bwd4", gl, x, gw_hd, gw_dh, gb_h)
        record(rows, "bwd4 torch mm (bf16 out)", lambda: torch.mm(gl.t(), x))
        record(rows, "colsum of gl (torch sum fp32)", lambda: torch.sum(gl, 0, dtype=torch.float32, out=gb_h))
        rows["colsum floor"] = {"ms": T * H * 2 / bw / 1e9, "what": "read grad_linear1 once"}
        # backward GEMM2: grad_weight2 [D, H] = dy^T g (+ grad_bias2 = column sums of dy); transposed: [H, D]
        weight_gemm("bwd2", dy, g, gw_dh, gw_hd, gb_d)
        # backward GEMM3: dx = gl w1
        record(rows, "bwd3 plain", *lt(T, D, H, gl, w1, out_td))
        w32 = torch.randn(H, D, device=dev)
        w16 = torch.empty(H, D, device=dev, dtype=act)
        record(rows, "weight1 fp32 -> 16-bit (torch copy_)", lambda: w16.copy_(w32))
        results["shapes"][shape] = rows
    save_json(results, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
