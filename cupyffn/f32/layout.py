"""The scratch layout of a backward plan: where each converted GEMM operand lives and how it is written.

Pure host code (no CuPy): offsets from the start of the plan's one device scratch allocation, which
cupyffn/f32/engine.py allocates (`scratch_bytes`) and whose base address the launches add
(cupyffn/f32/launches.py). grad_gelu (GEMM1's fp32 output, T x H; absent where the fused GEMM1 runs) comes
first, at offset 0, then each operand, every one aligned to ALIGN bytes.

"Lean" layout (bf16x3 at large T, where three 16-bit planes of gelu_out and of grad_linear1 side by side would
break the memory budget; docs/decisions/012-lean-layout.md): grad_linear1 reuses gelu_out's planes, so S waits
for GEMM2 before dgelu, and weight1/hidden_states are converted after dgelu ("convert late") into grad_gelu's
buffer, which is dead by then. At that size each GEMM fills the GPU, so nothing is lost by serializing.

fp16+fp8 (`_layout_f16e4m3`): each operand in every encoding its GEMMs' forms read: fp16, bf16x3 planes,
e4m3 pairs natural and transposed (kernels_cu/split_e4m3.cu's header); the e4m3 padding columns must read as
zeros, so the engine zero-fills that scratch once.
"""

from ..core import precision as P

ALIGN = 256

#: Each operand's [rows, cols] as letters of T, D, H.
ROWS_COLS = {"grad_output": "TD", "weight2": "DH", "gelu_out": "TH", "hidden_states": "TD", "weight1": "HD",
             "grad_linear1": "TH"}
#: The activations ([T, cols]: planes side by side in a row); the rest are weights (planes stacked as blocks).
ACTIVATIONS = ("grad_output", "gelu_out", "hidden_states", "grad_linear1")

# gemm -> its A and B operands with the orientation of their e4m3 pair ("n": K is the operand's column
# dimension, "t": its row dimension; the layout is in kernels_cu/split_e4m3.cu's header)
E4M3_USES = {"gemm1": (("grad_output", "n"), ("weight2", "t")),
             "gemm2": (("grad_output", "t"), ("gelu_out", "t")),
             "gemm3": (("grad_linear1", "n"), ("weight1", "t")),
             "gemm4": (("grad_linear1", "t"), ("hidden_states", "t"))}


def align(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pad16(k):
    """K rounded up to a multiple of 16 (the e4m3 pairs' halves; cuBLASLt FP8 wants K and ld multiples of 16)."""
    return (k + 15) // 16 * 16


class Operand:
    """Where a converted GEMM operand lives and how the conversion kernel writes it."""

    def __init__(self, name, rows, cols, interleaved, planes):
        self.name = name
        self.rows, self.cols = rows, cols
        self.planes = planes
        # Activations [T, cols] keep their planes side by side in a row ([T, planes * cols]); weights
        # stack them as blocks ([planes * rows, cols]). Both put K-stacking in reach of one GEMM.
        self.dst_ld = planes * cols if interleaved else cols
        self.part_stride = cols if interleaved else rows * cols
        self.nbytes = 2 * planes * rows * cols
        self.offset = None  # set by the layout


class Layout:
    """The scratch layout of `plan` (cupyffn/f32/plan.py: its format, planes, forms, fused GEMM1 and flags).

    ops: {name: Operand} with offsets (fp16+fp8: name, name + ".x3", name + ".e4n" / ".e4t"); scratch_bytes;
    gg_bytes (grad_gelu's); lean; cvt_a / cvt_b (what convert A and convert B write, gelu_out converted);
    cvt_late (the lean layout's "convert late"); e4m3_order (fp16+fp8: each pair's place in its GEMM).
    """

    def __init__(self, plan):
        T, D, H = plan.T, plan.D, plan.H
        self.e4m3_order = {}
        wg, gh = plan.need_weight_grads, plan.need_grad_hidden
        self.gg_bytes = 0 if plan.fused_gemm1 else 4 * T * H  # the fused GEMM1 never writes grad_gelu
        ops = {}
        if plan.fmt == P.FMT_F16E4M3:
            self._layout_f16e4m3(plan)
            return
        if plan.planes:
            p = plan.planes
            ops["grad_output"] = Operand("grad_output", T, D, True, p)
            ops["weight2"] = Operand("weight2", D, H, False, p)
            if wg:
                ops["gelu_out"] = Operand("gelu_out", T, H, True, p)
                ops["hidden_states"] = Operand("hidden_states", T, D, True, p)
            if gh:
                ops["weight1"] = Operand("weight1", H, D, False, p)
            ops["grad_linear1"] = Operand("grad_linear1", T, H, True, p)
        self.ops = ops
        late = [n for n in ("weight1", "hidden_states") if n in ops]
        self.lean = (plan.fmt == P.FMT_BF16X3 and wg
                     and self.gg_bytes >= sum(align(ops[n].nbytes) for n in late))
        offset = align(self.gg_bytes)  # grad_gelu first, at offset 0
        for name, op in ops.items():
            if self.lean and name in late:
                continue
            if self.lean and name == "grad_linear1":
                continue
            op.offset = offset
            offset += align(op.nbytes)
        if self.lean:
            ops["grad_linear1"].offset = ops["gelu_out"].offset
            inner = 0
            for name in late:
                ops[name].offset = inner
                inner += align(ops[name].nbytes)
        self.scratch_bytes = offset
        present = lambda names: [n for n in names if n in ops]  # noqa: E731
        self.cvt_a = present(("grad_output", "weight2"))
        self.cvt_b = present(("gelu_out",) if self.lean else ("gelu_out", "hidden_states", "weight1"))
        self.cvt_late = late if self.lean else []

    def _layout_f16e4m3(self, plan):
        """fp16+fp8: each operand in the encodings its GEMMs' forms read (ops[name] = fp16, ops[name + ".x3"]
        = bf16x3 planes, ops[name + ".e4n" / ".e4t"] = e4m3 pairs, natural / transposed), all in one scratch
        after grad_gelu. The e4m3 padding columns must be zero: the engine zero-fills the scratch once."""
        need = {}
        for g, form in plan.forms.items():
            (a, a_or), (b, b_or) = E4M3_USES[g]
            for name, orient, order in ((a, a_or, 0), (b, b_or, 1)):
                enc = need.setdefault(name, {})
                if form.name == "bf16x3":
                    enc["x3"] = None
                else:
                    enc["f16"] = None
                    enc["e4" + orient] = order
        if plan.need_bias_grads and "grad_linear1" not in need:
            # bias gradients alone: no GEMM reads grad_linear1, but the dgelu pass that sums its columns writes one
            # encoding (the cheapest, fp16)
            need["grad_linear1"] = {"f16": None}
        ops = {}
        for name in ("grad_output", "weight2", "gelu_out", "hidden_states", "weight1", "grad_linear1"):
            if name not in need:
                continue
            rows, cols = plan.dims(ROWS_COLS[name])
            inter = name in ACTIVATIONS
            enc = need[name]
            if "f16" in enc:
                ops[name] = Operand(name, rows, cols, inter, 1)
            if "x3" in enc:
                ops[name + ".x3"] = Operand(name, rows, cols, inter, 3)
            for orient in ("n", "t"):
                if "e4" + orient in enc:
                    op = Operand(name, rows, cols, False, 1)
                    k = cols if orient == "n" else rows
                    op.kpad = pad16(k)
                    op.dst_ld = 2 * op.kpad
                    op.nbytes = (rows if orient == "n" else cols) * op.dst_ld
                    ops[f"{name}.e4{orient}"] = op
                    self.e4m3_order[f"{name}.e4{orient}"] = enc["e4" + orient]
        self.ops = ops
        self.lean = False
        offset = align(self.gg_bytes)
        for op in ops.values():
            op.offset = offset
            offset += align(op.nbytes)
        self.scratch_bytes = offset
        present = [n for n in ("grad_output", "weight2", "gelu_out", "hidden_states", "weight1") if n in need]
        self.cvt_a = [n for n in present if n in ("grad_output", "weight2")]
        self.cvt_b = [n for n in present if n not in ("grad_output", "weight2")]
        self.cvt_late = []

    def written(self, name):
        """Bytes of every encoding of operand `name` in the scratch (fp16+fp8: several buffers)."""
        return sum(op.nbytes for key, op in self.ops.items() if key.split(".")[0] == name)
