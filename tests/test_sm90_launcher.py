"""The sm90 GEMM's host side without a GPU (cupyffn/_sm90_gemm.py): the variant list, the engine's prebuilt
fused launch (DgeluLaunch) with stand-ins for the compiled kernels and the tensor maps, and its choice of
epilogue by the activations' alignment."""

import ctypes
import re

import pytest

from cupyffn import _kernels, _sm90_gemm as G


def _parse(expression):
    m = re.fullmatch(r"gemm_sm90_(kernel|cluster2_kernel)<(\d), (\d+), (\d), (\d), (\d), (\d)>", expression)
    return tuple(int(v) for v in m.groups()[1:]) + ({"kernel": 1, "cluster2_kernel": 2}[m.group(1)],)


LAYOUT_OF_BT = {0: "nk", 1: "kn", 2: G.KN32}


def test_variants_cover_each_schedule_layout_and_epilogue_once():
    everything = [_parse(e) for e in G.EXPRESSIONS if "pair" not in e]
    # b converted in the kernel: test_kn32_variants; the epilogue warps: test_epilogue_warps_variants
    parsed = [p for p in everything if p[5] != 2 and p[4] != 2]
    assert len(everything) == len(set(everything)) == 2 * 82 + 6 + 20
    # the cluster-2 kernels are exactly the single-CTA ones again
    assert sorted(p[:-1] for p in parsed if p[-1] == 2) == sorted(p[:-1] for p in parsed if p[-1] == 1)
    for op, bn, epi, pp, xs, bt, cl in everything:
        assert G.expression(op, bn, epi, pp, xs, LAYOUT_OF_BT[bt], cl) == G.EXPRESSIONS[everything.index((op, bn, epi, pp, xs, bt, cl))]
    for op, bn, epi, pp, xs, bt, cl in parsed:
        assert cl in G.CLUSTERS
        assert (bn, bool(pp)) in G.CONFIGS and bt in (0, 1)
        assert epi != G.EPI_DGELU_BF16X3 or op == G.OP_BF16, "the three bf16 planes take bf16 operands"
        assert epi != G.EPI_DGELU_F16G or op == G.OP_F16, "gelu_out's fp16 codes beside fp16 operands"
        assert not xs or epi != G.EPI_F32, "the staged epilogue is a dgelu epilogue"
    # every dgelu epilogue exists staged and direct for every schedule and layout (but GELU_NO_STAGED)
    for op, epis in ((G.OP_F16, (G.EPI_DGELU_BF16, G.EPI_DGELU_F16, G.EPI_DGELU_F16G)),
                     (G.OP_BF16, (G.EPI_DGELU_BF16, G.EPI_DGELU_F16, G.EPI_DGELU_BF16X3))):
        for epi in epis:
            for bn, pp in G.CONFIGS:
                for bt in (0, 1):
                    for xs in (0, 1):
                        missing = xs and (epi, bn, pp) == G.GELU_NO_STAGED
                        assert ((op, bn, epi, int(pp), xs, bt, 1) in parsed) != missing


def test_kn32_variants():
    """b converted in the kernel (BT = 2): fp16 operands, no clusters, the two 128 x 128 schedules, fp32 out and the
    fp16 dgelu epilogue staged and direct; more shared memory per stage, fewer stages."""
    kn32 = {_parse(e) for e in G.EXPRESSIONS if "pair" not in e and _parse(e)[5] == 2}
    want = {(G.OP_F16, bn, G.EPI_F32, int(pp), 0, 2, 1) for bn, pp in G.KN32_CONFIGS}
    want |= {(G.OP_F16, bn, G.EPI_DGELU_F16, int(pp), xs, 2, 1) for bn, pp in G.KN32_CONFIGS for xs in (0, 1)}
    assert kn32 == want
    assert G.stage_bytes(128, 2) == G.stage_bytes(128) + 128 * 64 * 4 and G.stages_for(128, 2) == 3
    assert G.launch_smem_bytes(128, False, G.KN32) == G.smem_bytes(128, 2) == 3 * 65536 + 1024 + 3 * 8 * 3
    assert G.launch_smem_bytes(128, True, G.KN32) == G.xs_smem_bytes(128, 2) <= 232448
    assert G.launch_smem_bytes(128, True, "kn") == G.xs_smem_bytes(128)  # the 16-bit layouts keep their sizes
    args = G.GemmArgs(0, None, None, 1, 0, 0, 1, 1, 1, 1.0, None)
    assert (args.b_slot, args.b_alpha, args.b_amax) == (-1, 1.0, None)  # no state slot unless given


def test_epilogue_warps_variants():
    """XS = 2 (epilogue WARPS): the one-plane dgelu epilogues of either operand type (gelu_out's with fp16 operands),
    the cooperative 128 x 128 tile, both 16-bit B layouts and both cluster sizes; 512 threads and its own shared
    memory (4 stages, the fp32 accumulator tile, 7 warps' rings of 2 items of 2 KiB)."""
    warps = {_parse(e) for e in G.EXPRESSIONS if "pair" not in e and _parse(e)[4] == 2}
    want = {(op, 128, epi, 0, 2, bt, cl) for op, epis in ((G.OP_F16, (1, 2, 4)), (G.OP_BF16, (1, 2)))
            for epi in epis for bt in (0, 1) for cl in G.CLUSTERS}
    assert warps == want and G.WARPS_CONFIG == (128, False)
    assert G.threads_for(2) == G.EW_THREADS == 512 and G.threads_for(True) == G.threads_for(0) == G.THREADS
    assert G.launch_smem_bytes(128, 2, "kn") == G.ew_smem_bytes() == 4 * 32768 + 65536 + 7 * 2 * 2048 + 1024 + 80
    assert G.ew_smem_bytes() <= 232448
    with pytest.raises(ValueError, match="stages 2-4"):
        G.set_ew(4, 3)  # 7 rings of 3 items do not fit beside 4 stages


def test_pair_variants_cover_each_schedule_and_layout_once():
    """The fp16+fp8 pair kernel: every schedule with each fp16 A and B layout (its e4m3 operands are K-major)."""
    pairs = [e for e in G.EXPRESSIONS if "pair" in e]
    want = {G.pair_expression(bn, pp, al, bl) for bn, pp in G.CONFIGS for al in G.A_LAYOUTS for bl in G.B_LAYOUTS}
    assert len(pairs) == len(set(pairs)) == 12 and set(pairs) == want
    assert G.pair_expression(256, False, "km", "kn") == "gemm_sm90_pair_kernel<256, 0, 1, 1>"


class _Holder:
    def __init__(self):
        self.desc = G.TmaDesc()


@pytest.fixture
def stand_ins(monkeypatch):
    """_kernel, sm_count and the tensor-map cache replaced: records which variants a launch looks up."""
    looked_up = _Recorded()

    class Fn:
        def __init__(self, ptr):
            self.kernel = type("K", (), {"ptr": ptr})()

    def kernel(op, block_n, epi, pingpong, device_id, staged=False, b_layout="nk", cluster=1):
        looked_up.append((op, block_n, epi, pingpong, staged, b_layout, cluster))
        return Fn(1000 + len(looked_up))

    maps = []

    def get(*key):
        maps.append(key)
        return _Holder()

    monkeypatch.setattr(G, "_kernel", kernel)
    monkeypatch.setattr(_kernels, "sm_count", lambda device_id: 132)
    monkeypatch.setattr(G._maps, "get", get)
    monkeypatch.setattr(G, "max_active_clusters", lambda function_ptr, smem, cluster, threads: 60)  # < 132 / 2
    looked_up.maps = maps
    return looked_up


class _Recorded(list):
    pass


def _launch(m=1024, **kw):
    T, D, H = m, 1536, 6144
    where = (0x10000, D, 0x20000, H, "kn", 0x30000, H, T, H, D)
    common = dict(state_ptr=0x40000, consts_ptr=0x50000, acc_scale_ptr=0x50008, slot=5, rescue=False,
                  alpha_mask=0, device_id=0)
    common.update(kw)
    return G.DgeluLaunch(*where, **common)


def test_tf32_launch_gathers_into_the_state_and_its_rescue_does_not(stand_ins):
    launch = _launch()
    assert {v[0] for v in stand_ins} == {G.OP_F16} and {v[2] for v in stand_ins} == {G.EPI_DGELU_F16}
    assert {v[4] for v in stand_ins} == {True, False}  # both epilogues looked up once, at build
    assert launch.args.amax == 0x40000 + 4 * (_kernels.STATE_SLOTS + 5)
    assert launch.args.state == 0x40000 and launch.args.acc_scale == 0x50008 and launch.args.rescue == 0
    assert launch.configs == {True: G.choose_config(1024, 6144, 132), False: G.choose_config(1024, 6144, 132, False)}
    assert launch.cluster == G.FUSED_CLUSTER == 1 and launch.args.raster == G.FUSED_RASTER == 8
    for (has_t, staged), variant in launch._variants.items():
        block_n, pingpong = launch.configs[has_t]
        assert (G.OP_F16, block_n, G.EPI_DGELU_F16, pingpong, staged, "kn", 1) in stand_ins
        assert variant[2] == min(-(-1024 // G.BLOCK_M) * -(-6144 // block_n), 132)  # the grid of its tile
    assert len(launch._variants) == 4
    rescue = _launch(rescue=True, alpha_mask=0b1100)
    assert rescue.args.amax is None and rescue.args.rescue == 1 and rescue.args.alpha_mask == 0b1100


def test_gelu_launch_writes_gelu_out_and_gathers_its_maximum(stand_ins):
    """The tf32 plan's GEMM1 with gelu_out (EPI_DGELU_F16G): its codes at the given address with C's leading
    dimension, their maximum gathered into gelu_out's slot (not by the rescue launch), the 128 x 128 ping-pong
    tile where the rule says 128 x 256 (no staged 128 x 256 cooperative variant), memory mode unchanged."""
    gelu = dict(gelu_ptr=0x60000, ldg=6144, gelu_slot=2)
    T = 8192  # where the rule says 128 x 256
    launch = _launch(m=T, **gelu)
    assert G.choose_config(T, 6144, 132) == (256, False) and G.GELU_NO_STAGED == (G.EPI_DGELU_F16G, 256, False)
    assert launch.configs == {True: (128, True), False: G.choose_config(T, 6144, 132, False)}
    assert {v[2] for v in stand_ins} == {G.EPI_DGELU_F16G} and launch.epi == G.EPI_DGELU_F16G
    assert launch.args.g == 0x60000 and launch.args.ldg == 6144 and launch.args.g_slot == 2
    assert launch.args.g_amax == 0x40000 + 4 * (_kernels.STATE_SLOTS + 2)
    assert launch.args.amax == 0x40000 + 4 * (_kernels.STATE_SLOTS + 5)
    rescue = _launch(m=T, rescue=True, alpha_mask=0b1110, **gelu)
    assert rescue.args.g_amax is None and rescue.args.amax is None and rescue.args.g == 0x60000
    assert G.choose_config(1024, 6144, 132, gelu_out=True) == G.choose_config(1024, 6144, 132)  # 128 x 128 there
    with pytest.raises(ValueError, match="ldg == ldc"):
        _launch(gelu_ptr=0x60000, ldg=6152, gelu_slot=2)
    with pytest.raises(ValueError, match="EPI_DGELU_F16"):
        _launch(epi=G.EPI_DGELU_BF16X3, state_ptr=None, consts_ptr=None, acc_scale_ptr=None, slot=0, **gelu)


def test_warps_launch_takes_the_epilogue_warps_with_tanh_inner_given(stand_ins, monkeypatch):
    """warps=True: with tanh_inner given and 16-byte rows the XS = 2 variant of the cooperative 128 x 128 tile (512
    threads, its own shared memory); rows off 16 bytes the direct epilogue of that tile; memory mode unchanged."""
    launch = _launch(m=8192, gelu_ptr=0x60000, ldg=6144, gelu_slot=2, warps=True)
    assert launch.warps and launch.configs == {True: G.WARPS_CONFIG, False: G.choose_config(8192, 6144, 132, False)}
    assert (G.OP_F16, 128, G.EPI_DGELU_F16G, False, 2, "kn", 1) in stand_ins
    assert (G.OP_F16, 128, G.EPI_DGELU_F16G, False, 0, "kn", 1) in stand_ins
    function, smem, grid, _, _, threads = launch._variants[True, True]
    assert (smem, grid, threads) == (G.ew_smem_bytes(), 132, 512)
    assert launch._variants[True, False][1:3] == (G.smem_bytes(128), 132) and launch._variants[True, False][5] == 384
    assert launch._variants[False, True][5] == 384  # memory mode: its own schedule, staged
    launched = []
    driver = pytest.importorskip("cupy_backends.cuda.api.driver")
    monkeypatch.setattr(driver, "launchKernel", lambda *argv: launched.append(argv))
    launch.set_activations(0x1000, 6144, 0x9000, 6144)
    launch(0x77)
    assert launched[-1][0] == function and launched[-1][4] == 512 and launched[-1][7] == G.ew_smem_bytes()
    assert launch.node_params()[:4] == (function, 132, 512, G.ew_smem_bytes())
    bf16x3 = _launch(epi=G.EPI_DGELU_BF16X3, state_ptr=None, consts_ptr=None, acc_scale_ptr=None, slot=0, warps=True)
    assert not bf16x3.warps  # three planes: no epilogue warps variant


def test_the_variant_that_would_spill_is_not_built():
    staged_gelu = {_parse(e)[1:3] + (_parse(e)[3],) for e in G.EXPRESSIONS
                   if "pair" not in e and _parse(e)[2] == G.EPI_DGELU_F16G and _parse(e)[4]}
    assert (256, G.EPI_DGELU_F16G, 0) not in staged_gelu
    assert {(128, G.EPI_DGELU_F16G, 0), (128, G.EPI_DGELU_F16G, 1)} <= staged_gelu


def test_bf16x3_launch_takes_bf16_operands_and_no_scale(stand_ins):
    launch = _launch(epi=G.EPI_DGELU_BF16X3, state_ptr=None, consts_ptr=None, acc_scale_ptr=None, slot=0)
    assert {v[0] for v in stand_ins} == {G.OP_BF16} and {v[2] for v in stand_ins} == {G.EPI_DGELU_BF16X3}
    assert launch.args.amax is None and launch.args.state is None and launch.args.acc_scale is None


def test_an_unknown_epilogue_is_refused(stand_ins):
    with pytest.raises(ValueError, match="epi must be"):
        _launch(epi=G.EPI_F32)
    assert stand_ins == []  # refused before anything is looked up


@pytest.mark.parametrize("x_ptr,ldx,t_ptr,ldt,staged,pairs", [
    (0x1000, 6144, 0x9000, 6144, True, 1),   # 16-byte rows: staged
    (0x1000, 6144, 0, 0, True, 1),           # memory mode (no tanh_inner)
    (0x1008, 6146, 0x9000, 6144, False, 1),  # 8-byte rows: direct, float pairs
    (0x1004, 6144, 0x9000, 6144, False, 0),  # 4-byte offset: direct, single floats
    (0x1000, 6144, 0x9000, 6147, False, 0),  # one input's odd row stride decides for both
])
def test_set_activations_picks_the_epilogue_by_alignment(stand_ins, x_ptr, ldx, t_ptr, ldt, staged, pairs, monkeypatch):
    launch = _launch()
    launch.set_activations(x_ptr, ldx, t_ptr, ldt)
    assert launch.staged is staged and launch.args.xt_pairs == pairs
    launched = []
    driver = pytest.importorskip("cupy_backends.cuda.api.driver")
    monkeypatch.setattr(driver, "launchKernel", lambda function, *rest: launched.append(function))
    launch(0)  # the variant of this call's mode (tanh_inner given or not) and epilogue
    assert launched == [launch._variants[bool(t_ptr), staged][0]]
    assert launch.args.x == x_ptr and launch.args.ldx == ldx
    assert launch.args.t == (t_ptr or None) and launch.args.ldt == (ldt if t_ptr else 0)
    assert ctypes.sizeof(launch.args) == 176


@pytest.mark.parametrize("T,b_layout", [(1024, "kn"), (1152, "nk"), (8192, "kn")])
def test_cluster2_launch_grid_and_b_boxes(stand_ins, T, b_layout):
    """Clusters of two: the grid is two CTAs per group of two tile rows (9 rows at T = 1152: the last group half
    past M), at most as many clusters as run at once (the stand-in says 60), and the "nk" B box is half a tile."""
    D, H = 1536, 6144
    ldb = D if b_layout == "nk" else H
    launch = G.DgeluLaunch(0x10000, D, 0x20000, ldb, b_layout, 0x30000, H, T, H, D, state_ptr=0x40000,
                           consts_ptr=0x50000, acc_scale_ptr=0x50008, slot=5, rescue=False, alpha_mask=0, device_id=0,
                           cluster=2)
    assert {v[-1] for v in stand_ins} == {2}
    for has_t in (True, False):
        block_n = launch.configs[has_t][0]
        groups = -(-(-(-T // G.BLOCK_M)) // 2) * -(-H // block_n)
        assert {launch._variants[has_t, staged][2] for staged in (True, False)} == {2 * min(groups, 60)}
    keys = stand_ins.maps  # (A map, B map) per mode
    assert len(keys) == 4 and {k[-1] for k in keys[0::2]} == {G.BLOCK_M}
    assert [k[-1] for k in keys[1::2]] == [launch.configs[has_t][0] // 2 if b_layout == "nk" else 64
                                          for has_t in (True, False)]


def test_an_unknown_cluster_size_is_refused(stand_ins):
    with pytest.raises(ValueError, match="cluster must be one of"):
        _launch(cluster=4)
    assert stand_ins == []


@pytest.mark.parametrize("T,config", [(256, (128, False)), (512, (256, False)), (768, (128, True)), (1024, (128, True)),
                                      (2048, (256, False)), (3142, (256, False)), (4096, (256, False)),
                                      (4904, (128, False)), (8192, (256, False))])
def test_choose_config_at_the_workloads(T, config):
    """The rule at H = 6144 on 132 SMs, where every schedule was measured (docs/decisions/031-schedule-per-t.md):
    128-wide tiles where they fill the last wave better (T = 256: 96 tiles, 4904: 1872 in 15 waves), ping-pong where
    each CTA then has two or three of them (768, 1024), 128 x 256 cooperative elsewhere; memory mode 128 x 128
    cooperative."""
    assert G.choose_config(T, 6144, 132) == config
    assert G.choose_config(T, 6144, 132, tanh_inner=False) == (128, False)


@pytest.mark.parametrize("a_layout", G.A_LAYOUTS)
def test_pair_launch_maps_args_and_grid(stand_ins, monkeypatch, a_layout):
    """The pair launch (the fp16+fp8 plan's GEMM1, or GEMM2/GEMM4 with A MN-major): the four tensor maps' geometry,
    the arguments the kernel reads, the grid, and a launch of exactly its variant on the given stream."""
    looked_up = []

    class Fn:
        kernel = type("K", (), {"ptr": 4242})()

    def pair_kernel(block_n, pingpong, a_layout_, b_layout, device_id):
        looked_up.append((block_n, pingpong, a_layout_, b_layout))
        return Fn()

    monkeypatch.setattr(G, "_pair_kernel", pair_kernel)
    m, n, k, k8 = 2048, 6144, 1536, 2 * 1536
    lda = k if a_layout == "mk" else m
    launch = G.PairLaunch(0x1000, lda, a_layout, 0x2000, n, "kn", 0x3000, k8, 0x4000, k8, m, n, k, k8,
                          device_id=0, alpha_ptr=0x5008, pair_scale=8.0, block_n=256, out_ptr=0x6000)
    a_map = (0x1000, m, k, 2 * lda, G.OP_F16, G.BLOCK_M) if a_layout == "mk" else (0x1000, k, m, 2 * lda, G.OP_F16, 64)
    assert stand_ins.maps == [a_map, (0x2000, k, n, 2 * n, G.OP_F16, 64),  # B [K, N]: 64 x 64 boxes
                              (0x3000, m, k8, k8, G.OP_E4M3, G.BLOCK_M), (0x4000, n, k8, k8, G.OP_E4M3, 256)]
    assert looked_up == [(256, False, a_layout, "kn")]
    a = launch.args
    assert (a.c, a.ldc, a.m, a.n, a.k, a.k8, a.pair_scale, a.acc_scale, a.accumulate) == \
        (0x6000, n, m, n, k, k8, 8.0, 0x5008, 0)
    assert a.state is None and a.amax is None and a.rescue == 0  # the fp32 epilogue: no scale state
    assert launch.grid == min(-(-m // G.BLOCK_M) * -(-n // 256), 132) and launch.smem == G.smem_bytes(256)
    launched = []
    driver = pytest.importorskip("cupy_backends.cuda.api.driver")
    monkeypatch.setattr(driver, "launchKernel", lambda *argv: launched.append(argv))
    launch(0x77)
    function, grid, _, _, block, _, _, smem, stream, _, _ = launched[0]
    assert (function, grid, block, smem, stream) == (4242, launch.grid, G.THREADS, G.smem_bytes(256), 0x77)
    assert launch.node_params()[:4] == (4242, launch.grid, G.THREADS, G.smem_bytes(256))


@pytest.mark.parametrize("m,n,want", [(8192, 6144, 256), (2048, 6144, 256), (1024, 6144, 128), (256, 6144, 128),
                                      (1536, 6144, 128), (8192, 1536, 256)])
def test_pair_config_fills_the_last_wave(m, n, want):
    """choose_pair_config: 128 x 256 unless 128 x 128 fills the last wave better by more than 2%; never
    ping-pong (measured 1.5-2.2x slower for the pair)."""
    assert G.choose_pair_config(m, n, 132) == (want, False)


def test_fused_launch_takes_only_the_16_bit_layouts(stand_ins):
    """The engine's prebuilt launch has no b_scale / b_slot to give a converted weight: kn32 is refused."""
    with pytest.raises(ValueError, match="b_layout must be one of"):
        G.DgeluLaunch(16, 1536, 32, 6144, G.KN32, 48, 6144, 256, 6144, 1536, state_ptr=64, consts_ptr=128,
                      acc_scale_ptr=136, slot=5, rescue=False, alpha_mask=0, device_id=0)
