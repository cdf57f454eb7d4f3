"""cupyffn/f32/bias_sums.py without a GPU (the device queries and the allocation are stand-ins): the summing dgelu
pass's grid keeps every block on one chunk of columns and gives every (row, chunk) item to exactly one block of one
group of rows; the colsum launches cover their matrices; a call's bind points them at its arrays."""

import types

import pytest

cupy = pytest.importorskip("cupy")

from cupyffn.cuda import kernels as _kernels  # noqa: E402
from cupyffn.core import precision as P  # noqa: E402
from cupyffn.core.arrays import Matrix  # noqa: E402
from cupyffn.f32 import bias_sums as B  # noqa: E402

SMS, RESIDENT = 132, 5


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.setattr(_kernels, "sm_count", lambda device: SMS)
    monkeypatch.setattr(_kernels, "blocks_per_sm", lambda module, expression, device: RESIDENT)
    monkeypatch.setattr(_kernels, "get_function",
                        lambda module, expression, device: types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=1)))
    monkeypatch.setattr(cupy.cuda, "alloc", lambda n: types.SimpleNamespace(ptr=1 << 20))


def sums(T, D, H, fmt=P.FMT_BF16X3):
    return B.BiasSums(types.SimpleNamespace(T=T, D=D, H=H, fmt=fmt), 0)


@pytest.mark.parametrize("T, H", [(1, 8), (5, 300), (256, 6144), (1000, 2056), (8192, 6144)])
@pytest.mark.parametrize("vec", [0, 1])
def test_every_item_belongs_to_one_block_and_one_group(stand_ins, T, H, vec):
    grid, groups = sums(T, 64, H).dgelu_grid(vec)
    per_row = -(-H // ((8 if vec else 1) * _kernels.BLOCK))
    assert grid == groups * per_row and 1 <= groups <= min(B.DGELU_SUM_ROWS, T)
    assert grid <= max(per_row, 2 * SMS * RESIDENT)
    if T * per_row > 20000:
        return
    owner = {}
    for b in range(grid):  # dgelu.cu's grid-stride loop over (row, chunk) items
        for w in range(b, T * per_row, grid):
            row, chunk = divmod(w, per_row)
            assert chunk == b % per_row  # a block keeps its columns
            assert (row, chunk) not in owner
            owner[row, chunk] = b // per_row  # the row of sums the block writes
    assert len(owner) == T * per_row
    for row in range(T):  # a row's chunks land in one group of rows
        assert len({owner[row, c] for c in range(per_row)}) == 1


@pytest.mark.parametrize("T", [1, 100, 2048, 8192])
def test_the_colsum_launches_cover_their_matrices(stand_ins, T):
    s = sums(T, 1536, 6144)
    part, total = s.bias2
    job = part.args[0]
    bands = part.grid // job.col_blocks
    assert job.col_blocks * B.COLSUM_COLS >= 1536 and bands * job.band >= T > (bands - 1) * job.band
    assert total.args[0].rows == total.args[0].band == bands and total.grid == job.col_blocks
    assert s.nbytes == 4 * (min(B.DGELU_SUM_ROWS, T) * 6144 + bands * 1536)
    split = sums(T, 1536, 6144, P.FMT_F16E4M3)
    assert split.bias1.args[0].rows == -(-T // B.SPLIT_DGELU_STEP_ROWS)


def test_bind_points_the_launches_at_the_call(stand_ins):
    s = sums(300, 64, 2048)
    dgelu = types.SimpleNamespace(grid=None, args=[types.SimpleNamespace(vec=1)])
    s.bind(Matrix(4096, 300, 64, 64), 8192, 12288, True, dgelu)
    part, total = s.bias2
    assert (part.args[0].src, part.args[0].ld, part.args[0].vec) == (4096, 64, 1)
    assert (total.args[0].dst, total.args[0].accumulate) == (12288, 1)
    job = s.bias1.args[0]
    grid, groups = s.dgelu_grid(1)
    assert (job.dst, job.accumulate, dgelu.grid, job.rows, job.band) == (8192, 1, grid, groups, groups)
    s.bind(Matrix(4100, 300, 64, 65), 8192, 12288, False, dgelu)  # unaligned rows: the scalar path
    assert part.args[0].vec == 0 and job.accumulate == 0
