"""The bias gradients of a backward plan built with need_bias_grads
(docs/decisions/050-biases-in-the-split-precisions.md): grad_bias2 = the column sums of grad_output, grad_bias1 =
those of grad_linear1, both added in fp32 in a fixed order (kernels_cu/bias.cu's colsum_kernel), so every call gives
the same bits.

grad_linear1 exists in fp32 only inside the GELU-derivative pass (before its rounding into GEMM operands), so that
pass writes rows of column sums into this object's scratch and one colsum launch adds the rows: dgelu.cu's summing
variant writes one row per group of blocks that keep their columns (DGELU_SUM_ROWS at most), split_e4m3.cu (fp16+fp8)
one row per step's rows. grad_output takes two launches: bands of its rows into rows of sums, then those rows.
The launches run on the side stream (cupyffn/f32/schedule.py).
"""

from ..cuda import kernels as _kernels
from ..core import precision as P

#: Columns one colsum_kernel block sums (kernels_cu/bias.cu).
COLSUM_COLS = 128
#: The most rows of column sums the summing dgelu pass writes (groups of blocks that keep their columns; dgelu.cu):
#: enough groups to fill the GPU at every T (at T = 8192, 32 rows each). Each row is 4 H bytes, read once more.
DGELU_SUM_ROWS = 256
#: Rows of one step of split_e4m3's KIND 1 (dgelu) variant (split::Variant<1>: NB = 1 sub-tile of 64 rows).
SPLIT_DGELU_STEP_ROWS = 64


def _vec(ptr, ld, cols):
    return int(cols % 4 == 0 and ptr % 16 == 0 and (ld * 4) % 16 == 0)


class BiasSums:
    """The launches and scratch of one plan's bias gradients: `bias2` (grad_output's bands, then their rows),
    `bias1` (the dgelu pass's rows added), `dgelu_rows` (the address that pass writes its rows to), `nbytes`."""

    def __init__(self, plan, device_id):
        import cupy

        self.T, self.D, self.H = plan.T, plan.D, plan.H
        self.split = plan.fmt == P.FMT_F16E4M3
        self.device_id = device_id
        sms = _kernels.sm_count(device_id)
        # about four blocks per SM over grad_output's column blocks, each band at least 8 rows
        bands = max(1, min(-(-self.T // 8), -(-4 * sms // -(-self.D // COLSUM_COLS))))
        band = -(-self.T // bands)
        bands = -(-self.T // band)
        rows1 = -(-self.T // SPLIT_DGELU_STEP_ROWS) if self.split else min(DGELU_SUM_ROWS, self.T)
        self.nbytes = 4 * (rows1 * self.H + bands * self.D)
        try:
            self._scratch = cupy.cuda.alloc(self.nbytes)
        except cupy.cuda.memory.OutOfMemoryError as e:
            raise MemoryError(f"cupyffn needs {self.nbytes} bytes for the bias gradients' partial sums: {e}") from None
        self.dgelu_rows = self._scratch.ptr
        rows2 = self._scratch.ptr + 4 * rows1 * self.H
        self.bias2 = (self._colsum(self.T, self.D, band, dst=rows2),  # source: this call's grad_output
                      self._colsum(bands, self.D, bands, rows2, self.D))
        self.bias1 = self._colsum(rows1, self.H, rows1, self.dgelu_rows, self.H)
        # the summing dgelu pass's full grid (dgelu_grid)
        self._dgelu_full = 2 * sms * _kernels.blocks_per_sm("dgelu", f"dgelu_sums_kernel<{plan.fmt}>", device_id) \
            if not self.split else None

    def _colsum(self, rows, cols, band, src=0, ld=0, dst=0):
        job = _kernels.ColsumJob()
        job.src, job.ld, job.dst, job.rows, job.cols, job.band = src, ld, dst, rows, cols, band
        job.col_blocks = -(-cols // COLSUM_COLS)
        job.vec = _vec(src, ld, cols) if src else 0
        launch = _kernels.KernelLaunch(_kernels.get_function("bias", "colsum_kernel", self.device_id), job)
        launch.grid = job.col_blocks * -(-rows // band)
        return launch

    def dgelu_grid(self, vec):
        """(grid, rows of sums) of the summing dgelu pass: a multiple of the blocks one row's columns take, so that
        every block keeps its columns (dgelu.cu), with at most DGELU_SUM_ROWS groups of them."""
        per_row = -(-self.H // ((8 if vec else 1) * _kernels.BLOCK))
        groups = max(1, min(DGELU_SUM_ROWS, self.T, self._dgelu_full // per_row))
        return groups * per_row, groups

    def bind(self, dy, grad_bias1, grad_bias2, accumulate, dgelu):
        """This call's grad_output (a Matrix) and bias gradients (device pointers); `dgelu`: the plan's gathering
        dgelu launch, whose grid (dgelu.cu's) follows the vec path its bind chose."""
        part, total = self.bias2
        part.args[0].src, part.args[0].ld, part.args[0].vec = dy.ptr, dy.ld, _vec(dy.ptr, dy.ld, self.D)
        total.args[0].dst, total.args[0].accumulate = grad_bias2, int(accumulate)
        job = self.bias1.args[0]
        job.dst, job.accumulate = grad_bias1, int(accumulate)
        if not self.split:  # split_e4m3's rows (one per step) were fixed at build; dgelu.cu's follow its grid
            dgelu.grid, rows = self.dgelu_grid(dgelu.args[0].vec)
            job.rows = job.band = rows  # one band: the launch's grid stays col_blocks
