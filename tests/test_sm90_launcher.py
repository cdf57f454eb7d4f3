"""The sm90 GEMM's host side without a GPU (cupyffn/gemm/sm90/): the typed configs and can_implement, the engine's
prebuilt fused launch (DgeluLaunch) and pair launch (PairLaunch) with stand-ins for the compiled kernels and the
tensor maps, and the fused launch's choice of epilogue by the activations' alignment."""

import ctypes
import dataclasses

import pytest

from cupyffn.cuda import kernels as _kernels
from cupyffn.gemm import sm90 as G
from cupyffn.gemm.sm90 import config as cfg
from cupyffn.gemm.sm90 import launch as L
from cupyffn.gemm.sm90 import tensor_map


def test_variants_are_what_the_plans_run():
    """24 variants: the fp16 dgelu epilogue on every schedule direct and staged plus the epilogue warps (7), with
    gelu_out on the 128 x 128 schedules (5), the bf16x3 planes on every schedule direct and staged (6), the pair on
    its three cooperative schedules with either A layout (6); each expression once, each accepted by can_implement."""
    v = G.VARIANTS
    assert len(v) == len({c.expression for c in v}) == 24
    assert all(G.can_implement(c) and not c.trace for c in v)
    count = {}
    for c in v:
        count[c.op, c.epi] = count.get((c.op, c.epi), 0) + 1
    assert count == {(G.OP_F16, G.EPI_DGELU_F16): 7, (G.OP_F16, G.EPI_DGELU_F16G): 5,
                     (G.OP_BF16, G.EPI_DGELU_BF16X3): 6, (G.OP_F16E4M3, G.EPI_F32): 6}
    assert {c.expression for c in v if c.op == G.OP_F16E4M3} == {
        f"gemm_sm90_pair_kernel<{bn}, {ta}>" for bn in (128, 192, 256) for ta in (0, 1)}
    assert G.Sm90Config(G.OP_F16, 256, False, G.EPI_DGELU_F16, "staged").expression == "gemm_sm90_kernel<0, 256, 2, 0, 1>"


@pytest.mark.parametrize("config,why", [
    (G.Sm90Config(G.OP_F16, 192, False, G.EPI_DGELU_F16), "block_n, pingpong"),
    (G.Sm90Config(G.OP_F16, 256, True, G.EPI_DGELU_F16), "block_n, pingpong"),
    (G.Sm90Config(G.OP_F16, 256, False, G.EPI_DGELU_F16G, "staged"), "no 128 x 256 variant"),  # it spills
    (G.Sm90Config(G.OP_F16, 256, False, G.EPI_DGELU_F16G, "direct"), "no 128 x 256 variant"),
    (G.Sm90Config(G.OP_BF16, 128, False, G.EPI_DGELU_F16), "dgelu epilogues"),  # one-plane bf16: removed
    (G.Sm90Config(G.OP_F16, 128, False, G.EPI_DGELU_BF16X3), "dgelu epilogues"),
    (G.Sm90Config(G.OP_BF16, 128, False, G.EPI_DGELU_BF16X3, G.WARPS), "epilogue 'warps'"),
    (G.Sm90Config(G.OP_F16, 128, True, G.EPI_DGELU_F16, G.WARPS), "epilogue 'warps'"),
    (G.Sm90Config(G.OP_F16, 128, False, G.EPI_F32), "dgelu epilogues"),  # a plain fp32 GEMM: removed
    (G.Sm90Config(G.OP_F16E4M3, 128, True), "schedules"),  # the pair's ping-pong: removed
    (G.Sm90Config(G.OP_F16E4M3, 128, a_layout="nk"), "a_layout"),
    (G.Sm90Config(G.OP_F16, 128, False, G.EPI_DGELU_F16, "cluster"), "epilogue must be"),
])
def test_can_implement_refuses_what_does_not_exist(config, why):
    assert not G.can_implement(config)
    with pytest.raises(ValueError, match=why):
        G.check_config(config)


def test_config_is_frozen_and_hashable():
    c = G.VARIANTS[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_n = 256
    assert {c: 1}[dataclasses.replace(c)] == 1
    traced = dataclasses.replace(c, trace=True)
    assert traced.expression == c.expression and traced != c
    assert traced.nvrtc_options == c.nvrtc_options + ("-DCUPYFFN_SM90_TRACE=1",)
    assert c.nvrtc_options == ("-arch=sm_90a", "--std=c++17")


def test_threads_and_shared_memory_per_epilogue():
    """The epilogue warps: 512 threads and their own shared memory (4 stages, the fp32 accumulator tile, 7 warps'
    rings of 2 items of 2 KiB); the others 384 threads, the staged epilogue one stage fewer and its x/t slots."""
    warps = G.Sm90Config(G.OP_F16, 128, False, G.EPI_DGELU_F16, G.WARPS)
    assert (warps.threads, warps.smem_bytes) == (512, 4 * 32768 + 65536 + 7 * 2 * 2048 + 1024 + 80)
    for bn in (128, 256):
        direct = G.Sm90Config(G.OP_F16, bn, False, G.EPI_DGELU_F16, "direct")
        staged = dataclasses.replace(direct, epilogue="staged")
        assert direct.threads == staged.threads == G.THREADS == 384
        assert direct.smem_bytes == cfg.smem_bytes(bn) and staged.smem_bytes == cfg.xs_smem_bytes(bn)
        assert cfg.xs_stages_for(bn) == cfg.stages_for(bn) - 1 and cfg.xt_slots_for(bn) >= 1
    assert max(c.smem_bytes for c in G.VARIANTS) <= cfg.SMEM_LIMIT
    assert G.Sm90Config(G.OP_F16E4M3, 256).smem_bytes == cfg.smem_bytes(256)


class _Holder:
    def __init__(self):
        self.desc = G.TmaDesc()


class _Recorded(list):
    pass


@pytest.fixture
def stand_ins(monkeypatch):
    """launch.function, sm_count and the tensor-map cache replaced: records which configs a launch looks up."""
    looked_up = _Recorded()

    class Fn:
        def __init__(self, ptr):
            self.kernel = type("K", (), {"ptr": ptr})()

    def function(config, device_id):
        looked_up.append(config)
        return Fn(1000 + len(looked_up))

    maps = []

    def get(*key):
        maps.append(key)
        return _Holder()

    monkeypatch.setattr(L, "function", function)
    monkeypatch.setattr(_kernels, "sm_count", lambda device_id: 132)
    monkeypatch.setattr(tensor_map.maps, "get", get)
    looked_up.maps = maps
    return looked_up


def _launch(m=1024, **kw):
    T, D, H = m, 1536, 6144
    where = (0x10000, D, 0x20000, H, "kn", 0x30000, H, T, H, D)
    common = dict(state_ptr=0x40000, consts_ptr=0x50000, acc_scale_ptr=0x50008, slot=5, rescue=False,
                  alpha_mask=0, device_id=0)
    common.update(kw)
    return G.DgeluLaunch(*where, **common)


def test_tf32_launch_gathers_into_the_state_and_its_rescue_does_not(stand_ins):
    launch = _launch()
    assert {c.op for c in stand_ins} == {G.OP_F16} and {c.epi for c in stand_ins} == {G.EPI_DGELU_F16}
    assert {c.epilogue for c in stand_ins} == {"staged", "direct"}  # both epilogues looked up once, at build
    assert launch.args.amax == 0x40000 + 4 * (_kernels.STATE_SLOTS + 5)
    assert launch.args.state == 0x40000 and launch.args.acc_scale == 0x50008 and launch.args.rescue == 0
    assert launch.args.raster == G.FUSED_RASTER == 8
    for (has_t, staged), config in launch.configs.items():
        assert (config.block_n, config.pingpong) == G.choose_config(1024, 6144, 132, tanh_inner=has_t)
        assert config.epilogue == ("staged" if staged else "direct") and config in stand_ins
        grid = launch._variants[has_t, staged][2]
        assert grid == min(-(-1024 // G.BLOCK_M) * -(-6144 // config.block_n), 132)  # the grid of its tile
    assert len(launch._variants) == 4
    # A [T, D] in boxes of 128 rows; B [D, H] as stored in 64 x 64 boxes: one pair of maps for every variant
    assert stand_ins.maps == [(0x10000, 1024, 1536, 2 * 1536, G.OP_F16, G.BLOCK_M), (0x20000, 1536, 6144, 2 * 6144,
                                                                                       G.OP_F16, 64)]
    rescue = _launch(rescue=True, alpha_mask=0b1100)
    assert rescue.args.amax is None and rescue.args.rescue == 1 and rescue.args.alpha_mask == 0b1100


def test_gelu_launch_writes_gelu_out_and_gathers_its_maximum(stand_ins):
    """The tf32 plan's GEMM1 with gelu_out (EPI_DGELU_F16G): its codes at the given address with C's leading
    dimension, their maximum gathered into gelu_out's slot (not by the rescue launch), the 128 x 128 ping-pong
    tile where the rule says 128 x 256 (no 128 x 256 variant), memory mode unchanged."""
    gelu = dict(gelu_ptr=0x60000, ldg=6144, gelu_slot=2)
    T = 8192  # where the rule says 128 x 256
    launch = _launch(m=T, **gelu)
    assert G.choose_config(T, 6144, 132) == (256, False)
    assert {(c.block_n, c.pingpong) for (has_t, _), c in launch.configs.items() if has_t} == {(128, True)}
    assert {(c.block_n, c.pingpong) for (has_t, _), c in launch.configs.items() if not has_t} == \
        {G.choose_config(T, 6144, 132, False)}
    assert {c.epi for c in stand_ins} == {G.EPI_DGELU_F16G} and launch.epi == G.EPI_DGELU_F16G
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
    assert launch.configs[True, True] == G.Sm90Config(G.OP_F16, 128, False, G.EPI_DGELU_F16G, G.WARPS)
    assert launch.configs[True, False] == G.Sm90Config(G.OP_F16, 128, False, G.EPI_DGELU_F16G, "direct")
    assert launch.configs[False, True] == G.Sm90Config(G.OP_F16, *G.choose_config(8192, 6144, 132, False),
                                                       G.EPI_DGELU_F16G, "staged")
    function, smem, grid, threads = launch._variants[True, True]
    assert (smem, grid, threads) == (cfg.ew_smem_bytes(), 132, 512)
    assert launch._variants[True, False][1:] == (cfg.smem_bytes(128), 132, 384)
    assert launch._variants[False, True][3] == 384  # memory mode: its own schedule, staged
    launched = []
    driver = pytest.importorskip("cupy_backends.cuda.api.driver")
    monkeypatch.setattr(driver, "launchKernel", lambda *argv: launched.append(argv))
    launch.set_activations(0x1000, 6144, 0x9000, 6144)
    launch(0x77)
    assert launched[-1][0] == function and launched[-1][4] == 512 and launched[-1][7] == cfg.ew_smem_bytes()
    assert launch.node_params()[:4] == (function, 132, 512, cfg.ew_smem_bytes())
    bf16x3 = _launch(epi=G.EPI_DGELU_BF16X3, state_ptr=None, consts_ptr=None, acc_scale_ptr=None, slot=0, warps=True)
    assert G.WARPS not in {c.epilogue for c in bf16x3.configs.values()}  # three planes: no epilogue warps variant


def test_bf16x3_launch_takes_bf16_operands_and_no_scale(stand_ins):
    launch = _launch(epi=G.EPI_DGELU_BF16X3, state_ptr=None, consts_ptr=None, acc_scale_ptr=None, slot=0)
    assert {c.op for c in stand_ins} == {G.OP_BF16} and {c.epi for c in stand_ins} == {G.EPI_DGELU_BF16X3}
    assert launch.args.amax is None and launch.args.state is None and launch.args.acc_scale is None


def test_an_unknown_epilogue_or_b_layout_is_refused(stand_ins):
    with pytest.raises(ValueError, match="epi must be"):
        _launch(epi=G.EPI_F32)
    with pytest.raises(ValueError, match="b_layout must be 'kn'"):
        G.DgeluLaunch(16, 1536, 32, 1536, "nk", 48, 6144, 256, 6144, 1536, state_ptr=64, consts_ptr=128,
                      acc_scale_ptr=136, slot=5, rescue=False, alpha_mask=0, device_id=0)
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
    assert ctypes.sizeof(launch.args) == 160


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
    chosen = G.choose_dgelu_config(T, 6144, 132, G.EPI_DGELU_F16, tanh_inner=True, rows_16b=True)
    assert (chosen.block_n, chosen.pingpong, chosen.epilogue) == config + ("staged",)


@pytest.mark.parametrize("a_layout", G.A_LAYOUTS)
def test_pair_launch_maps_args_and_grid(stand_ins, monkeypatch, a_layout):
    """The pair launch (the fp16+fp8 plan's GEMM1, or GEMM2/GEMM4 with A MN-major): the four tensor maps' geometry,
    the arguments the kernel reads, the grid, and a launch of exactly its variant on the given stream."""
    m, n, k, k8 = 2048, 6144, 1536, 2 * 1536
    lda = k if a_layout == "mk" else m
    launch = G.PairLaunch(0x1000, lda, a_layout, 0x2000, n, "kn", 0x3000, k8, 0x4000, k8, m, n, k, k8,
                          device_id=0, alpha_ptr=0x5008, pair_scale=8.0, block_n=256, out_ptr=0x6000)
    a_map = (0x1000, m, k, 2 * lda, G.OP_F16, G.BLOCK_M) if a_layout == "mk" else (0x1000, k, m, 2 * lda, G.OP_F16, 64)
    assert stand_ins.maps == [a_map, (0x2000, k, n, 2 * n, G.OP_F16, 64),  # B [K, N]: 64 x 64 boxes
                              (0x3000, m, k8, k8, G.OP_E4M3, G.BLOCK_M), (0x4000, n, k8, k8, G.OP_E4M3, 256)]
    assert list(stand_ins) == [G.Sm90Config(G.OP_F16E4M3, 256, a_layout=a_layout)]
    a = launch.args
    assert (a.c, a.ldc, a.m, a.n, a.k, a.k8, a.pair_scale, a.acc_scale, a.accumulate) == \
        (0x6000, n, m, n, k, k8, 8.0, 0x5008, 0)
    assert a.state is None and a.amax is None and a.rescue == 0  # the fp32 epilogue: no scale state
    assert launch.grid == min(-(-m // G.BLOCK_M) * -(-n // 256), 132) and launch.smem == cfg.smem_bytes(256)
    launched = []
    driver = pytest.importorskip("cupy_backends.cuda.api.driver")
    monkeypatch.setattr(driver, "launchKernel", lambda *argv: launched.append(argv))
    launch(0x77)
    function, grid, _, _, block, _, _, smem, stream, _, _ = launched[0]
    assert (function, grid, block, smem, stream) == (1001, launch.grid, G.THREADS, cfg.smem_bytes(256), 0x77)
    assert launch.node_params()[:4] == (1001, launch.grid, G.THREADS, cfg.smem_bytes(256))


def test_pair_launch_refuses_what_does_not_exist(stand_ins):
    where = (0x1000, 1536, "mk", 0x2000, 6144, "kn", 0x3000, 3072, 0x4000, 3072, 2048, 6144, 1536, 3072)
    with pytest.raises(ValueError, match="schedules"):
        G.PairLaunch(*where, device_id=0, block_n=128, pingpong=True)
    with pytest.raises(ValueError, match="b_layout must be 'kn'"):
        G.PairLaunch(*where[:5], "nk", *where[6:], device_id=0)
    assert stand_ins == []


@pytest.mark.parametrize("m,n,want", [(8192, 6144, 256), (2048, 6144, 256), (1024, 6144, 192), (256, 6144, 128),
                                      (1536, 6144, 192), (6144, 1536, 192), (2048, 1536, 192), (8192, 1536, 256),
                                      (512, 1536, 128)])
def test_pair_config_fills_the_last_wave(m, n, want):
    """choose_pair_config: the tile width whose waves (each counted full) take the least time, the wider one on a
    tie; never ping-pong (measured 1.5-2.2x slower for the pair). GEMM2's 1536 x 6144 output: 576 tiles of 128 x 128
    are 5 waves of 132 SMs (640 columns of work per SM), 384 of 128 x 192 are 3 (576), 288 of 128 x 256 are 3 (768)."""
    assert G.choose_pair_config(m, n, 132) == (want, False)


def test_pair_config_never_picks_a_slower_wave_count():
    """Against the three schedules' wave cost over many shapes: the choice is always a minimum."""
    for m in range(128, 9000, 352):
        for n in (1536, 4096, 6144, 1000):
            block_n, _ = G.choose_pair_config(m, n, 132)
            cost = {bn: -(-(-(-m // 128) * -(-n // bn)) // 132) * bn for bn, _ in G.PAIR_SCHEDULES}
            assert cost[block_n] == min(cost.values()), (m, n, cost)



def test_pair_raster_bands_only_the_tall_outputs():
    """choose_pair_raster: bands of PAIR_RASTER tile rows where the output has at least as many rows as columns
    (GEMM4's [H, D], GEMM1 and GEMM3 at large T), the column order for the wide ones (GEMM2's [D, H])."""
    assert G.PAIR_RASTER == 8
    assert G.choose_pair_raster(6144, 1536) == 8 and G.choose_pair_raster(8192, 6144) == 8
    assert G.choose_pair_raster(1536, 1536) == 8
    assert G.choose_pair_raster(1536, 6144) == 0 and G.choose_pair_raster(256, 1536) == 0
