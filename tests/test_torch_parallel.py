"""cupyffn.torch's tensor-parallel layer (TensorParallelGeluFFN, shard_weights, tensor_parallel_gelu_ffn).

The multi-rank tests start real process groups (torch.multiprocessing spawn, a FileStore rendezvous in the
test's temporary directory, so no port is reserved): 2 CPU ranks with gloo (runs in CI), 2 ranks with gloo
on CUDA tensors sharing one GPU (the overlapped all-reduce must not read grad_hidden_states before its
GEMM has written it), 2 GPUs with NCCL. Each rank runs the sharded block on its shard of the same
unsharded inputs and saves what it got; the test process then checks every output (the full output and
grad_hidden_states on every rank, each rank's grad_weight1 / grad_weight2 shard) against torch autograd of
the unsharded block in float64 (within the precision's contract) and against the unsharded single-process
cupyffn result (GeluFFNFunction).
"""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest

torch = pytest.importorskip(
    "torch", reason="torch not installed: framework tests are opt-in, pip install '.[test-frameworks]'")
dist = pytest.importorskip("torch.distributed")
F = torch.nn.functional

import cupyffn  # noqa: E402
import cupyffn.torch as ct  # noqa: E402
from cupyffn.frameworks import torch_parallel as tp  # noqa: E402

if not dist.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NAMES = ("output", "grad_hidden_states", "grad_weight1", "grad_weight2")
CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda is not available")]
SEED = 20261201
# How far the sharded result may sit from the unsharded cupyffn result. Sharding changes only the order
# of fp32 sums for precisions that round each element on its own (ieee, bf16x3, bf16; bf16 can flip the
# rounding of a few elements near a tie), so they agree far within the contract; tf32's per-tensor
# power-of-two scales follow each shard's largest value, so the two can differ by up to the contract each.
# fp16+fp8's pair also follows per-tensor scales, but a shift of them changes its hi/e4m3 roundings only
# in their subnormal ranges (measured ~1e-8 on a shifted exponent): bf16x3's bound.
VS_UNSHARDED = {"ieee": 2e-6, "bf16x3": 5e-6, "fp16+fp8": 5e-6, "bf16": 1e-3,
                "tf32": 2 * cupyffn.PRECISIONS["tf32"].contract}


# ---------------------------------------------------------------------- the ranks' side (spawned processes)
def _rank_main(rank, world, backend, device_kind, folder):
    """One rank: join the group, run every case of folder/cases.pt on its shard, save folder/rank<r>.pt."""
    if device_kind == "cuda":
        index = rank % torch.cuda.device_count()  # one GPU shared by all ranks, or one GPU per rank
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, store=dist.FileStore(os.path.join(folder, "store"), world), rank=rank,
                            world_size=world)
    try:
        poison_outputs(setattr)
        data = torch.load(os.path.join(folder, "cases.pt"))
        results = {name: _run_case(case, rank, world, device) for name, case in data["cases"].items()}
        results["api"] = _api_checks(rank, world, device) if data.get("api") else None
        torch.save(results, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run_case(case, rank, world, device):
    """(output, grad_x, grad_w1 shard, grad_w2 shard) of loss = sum(y * r) on this rank, on the CPU."""
    w1, w2 = tp.shard_weights(case["w1"], case["w2"], rank, world)
    x = case["x"].to(device).requires_grad_(case["need_x"])
    w1 = w1.to(device).requires_grad_(case["need_w"])
    w2 = w2.to(device).requires_grad_(case["need_w"])
    r = case["r"].to(device)
    out = None
    for _ in range(case.get("repeats", 1)):
        for t in (x, w1, w2):
            t.grad = None
        y = tp.tensor_parallel_gelu_ffn(x, w1, w2, None, case["precision"], case["save"], case["overlap"])
        (y * r).sum().backward()
        got = (y.detach(), x.grad, w1.grad, w2.grad)
        got = tuple(None if a is None else a.detach().cpu() for a in got)
        if out is not None:  # every repetition computes the same thing from the same inputs
            for a, b in zip(out, got):
                if a is not None and not torch.equal(a, b):
                    raise AssertionError(f"rank {rank}: a repetition of case {case['precision']} differs")
        out = got
    return out


def poison_outputs(setattr_):
    """Make every tensor cupyffn.torch allocates for cupyffn to write NaN-filled: an output left unwritten,
    or an all-reduce that reads grad_hidden_states before its GEMM wrote it, then shows as NaN."""
    from cupyffn.frameworks import torch_ops

    setattr_(torch_ops.TorchDevice, "empty", lambda dev, shape, dtype=torch.float32: torch.full(
        shape, float("nan"), dtype=dtype, device=dev.device))


def _api_checks(rank, world, device):
    """What the layer's constructors give on this rank (compared with GeluFFN by the test process)."""
    torch.manual_seed(123)
    layer = tp.TensorParallelGeluFFN(24, 16 * world, device=device)
    full = torch.randn(16 * world, 24), torch.randn(24, 16 * world)
    from_full = tp.TensorParallelGeluFFN.from_full(*full, precision="ieee", device=device)
    try:
        tp.TensorParallelGeluFFN(24, 16 * world + 1, device=device)
        indivisible = None
    except ValueError as e:
        indivisible = str(e)
    return {"init": (layer.weight1.detach().cpu(), layer.weight2.detach().cpu()),
            "meta": (layer.rank, layer.world_size, layer.local_hidden_dim),
            "full": full, "from_full": (from_full.weight1.detach().cpu(), from_full.weight2.detach().cpu(),
                                        from_full.precision), "indivisible": indivisible}


# ---------------------------------------------------------------------- the test process's side
def spawn(tmp, world, backend, device_kind, cases, api=True, timeout=300):
    """Run `cases` on `world` spawned ranks; returns the list of what each rank saved."""
    torch.save({"cases": cases, "api": api}, tmp / "cases.pt")
    context = torch.multiprocessing.start_processes(_rank_main, args=(world, backend, device_kind, str(tmp)),
                                                    nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=5):  # raises, with the rank's traceback, if a rank failed
        if time.monotonic() > deadline:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"the {world} ranks ({backend}) did not finish within {timeout} s")
    return [torch.load(tmp / f"rank{r}.pt") for r in range(world)]


def make_case(rng, lead, dim, hidden, precision, save="all", overlap=True, need_x=True, need_w=True, repeats=1):
    """Unsharded inputs: x ~ N(0, 1), weights like nn.Linear's init, r ~ N(0, 1) (the output's gradient)."""
    x = rng.standard_normal(lead + (dim,))
    w1 = rng.uniform(-1, 1, (hidden, dim)) / numpy.sqrt(dim)
    w2 = rng.uniform(-1, 1, (dim, hidden)) / numpy.sqrt(hidden)
    r = rng.standard_normal(lead + (dim,))
    tensors = {k: torch.from_numpy(a.astype(numpy.float32)) for k, a in (("x", x), ("w1", w1), ("w2", w2), ("r", r))}
    return dict(tensors, precision=precision, save=save, overlap=overlap, need_x=need_x, need_w=need_w,
                repeats=repeats)


def reference(case, device):
    """float64 (output, grad_x, grad_w1, grad_w2) of the unsharded block by torch autograd, on the CPU."""
    x, w1, w2 = (case[k].to(device).double().requires_grad_() for k in ("x", "w1", "w2"))
    y = F.linear(F.gelu(F.linear(x, w1), approximate="tanh"), w2)
    (y * case["r"].to(device).double()).sum().backward()
    return tuple(a.detach().cpu() for a in (y, x.grad, w1.grad, w2.grad))


def unsharded(case, device):
    """(output, grad_x, grad_w1, grad_w2) of the unsharded block through cupyffn.torch in this process."""
    x, w1, w2 = (case[k].to(device).requires_grad_() for k in ("x", "w1", "w2"))
    y = ct.GeluFFNFunction.apply(x, w1, w2, case["precision"], case["save"])
    (y * case["r"].to(device)).sum().backward()
    return tuple(a.detach().cpu() for a in (y, x.grad, w1.grad, w2.grad))


def rel(a, ref):
    assert a is not None and a.shape == ref.shape and a.dtype == torch.float32, (None if a is None else a.shape)
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def shard_of(full, name, rank, world):
    """The part of an unsharded result that rank `rank` holds."""
    if name == "grad_weight1":
        h = full.shape[0] // world
        return full[rank * h:(rank + 1) * h]
    if name == "grad_weight2":
        h = full.shape[1] // world
        return full[:, rank * h:(rank + 1) * h]
    return full


def check_ranks(case, ranks_out, device="cpu"):
    """Every rank's results against the float64 reference and the unsharded cupyffn result on `device`
    (on the CPU within VS_UNSHARDED; on the GPU, whose GEMM algorithms change with the shape, within twice
    the contract); returns the errors."""
    world = len(ranks_out)
    contract = cupyffn.PRECISIONS[case["precision"]].contract
    vs_unsharded = VS_UNSHARDED[case["precision"]] if device == "cpu" else 2 * contract
    wanted = (True, case["need_x"], case["need_w"], case["need_w"])
    refs, single = reference(case, device), unsharded(case, device)
    errors = {}
    for rank, got in enumerate(ranks_out):
        for name, a, ref, one, want in zip(NAMES, got, refs, single, wanted):
            if not want:
                assert a is None, (rank, name)
                continue
            e64 = rel(a, shard_of(ref, name, rank, world))
            e1 = rel(a, shard_of(one, name, rank, world))
            errors[(rank, name)] = (e64, e1)
            assert e64 <= contract, (rank, name, e64, contract)
            assert e1 <= vs_unsharded, (rank, name, e1)
    return errors


def check_api(ranks_out):
    world = len(ranks_out)
    torch.manual_seed(123)
    layer = ct.GeluFFN(24, 16 * world)  # the same seed: TensorParallelGeluFFN holds its slices
    for rank, out in enumerate(ranks_out):
        api = out["api"]
        w1, w2 = api["init"]
        assert torch.equal(w1, shard_of(layer.weight1.detach(), "grad_weight1", rank, world))
        assert torch.equal(w2, shard_of(layer.weight2.detach(), "grad_weight2", rank, world))
        assert api["meta"] == (rank, world, 16)
        f1, f2, precision = api["from_full"]
        assert torch.equal(f1, shard_of(api["full"][0], "grad_weight1", rank, world))
        assert torch.equal(f2, shard_of(api["full"][1], "grad_weight2", rank, world))
        assert precision == "ieee"
        assert api["indivisible"] == (f"hidden_dim ({16 * world + 1}) must be divisible by the world size ({world}): "
                                      "every rank holds hidden_dim / world_size rows of weight1")


def cpu_cases(rng):
    lead, dim, hidden = (2, 33), 96, 256
    cases = {p: make_case(rng, lead, dim, hidden, p) for p in cupyffn.PRECISIONS}
    cases["bf16x3-memory-mode"] = make_case(rng, lead, dim, hidden, "bf16x3", save="linear1_out")
    cases["ieee-no-overlap"] = make_case(rng, (50,), 40, 72, "ieee", overlap=False)
    cases["bf16x3-frozen-weights"] = make_case(rng, lead, dim, hidden, "bf16x3", need_w=False)
    cases["ieee-first-layer"] = make_case(rng, lead, dim, hidden, "ieee", need_x=False)
    return cases


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    cases = cpu_cases(numpy.random.default_rng(SEED))
    return cases, spawn(tmp_path_factory.mktemp("tp-gloo-cpu"), 2, "gloo", "cpu", cases)


@pytest.mark.parametrize("name", list(cpu_cases(numpy.random.default_rng(SEED))))
def test_two_cpu_ranks_match_the_unsharded_block(cpu_run, name):
    cases, ranks_out = cpu_run
    check_ranks(cases[name], [out[name] for out in ranks_out])


def test_two_cpu_ranks_hold_the_same_full_output_and_grad_hidden(cpu_run):
    cases, ranks_out = cpu_run
    for name in cases:
        first, second = ranks_out[0][name], ranks_out[1][name]
        for i in (0, 1):  # the all-reduced results
            if first[i] is not None:
                assert torch.equal(first[i], second[i]), (name, NAMES[i])


def test_two_cpu_ranks_constructors(cpu_run):
    check_api(cpu_run[1])


def test_three_cpu_ranks(tmp_path):
    cases = {"ieee": make_case(numpy.random.default_rng(SEED + 3), (30,), 24, 3 * 20, "ieee"),
             "bf16": make_case(numpy.random.default_rng(SEED + 4), (30,), 24, 3 * 20, "bf16", save="linear1_out")}
    ranks_out = spawn(tmp_path, 3, "gloo", "cpu", cases)
    for name, case in cases.items():
        check_ranks(case, [out[name] for out in ranks_out])
    check_api(ranks_out)


# ---------------------------------------------------------------------- single process
@pytest.fixture
def group_of_one(tmp_path):
    """A gloo process group of this process alone (rank 0, world size 1)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_shard_weights_slices_and_copies(rng):
    w1 = torch.from_numpy(rng.standard_normal((12, 5)).astype(numpy.float32))
    w2 = torch.from_numpy(rng.standard_normal((5, 12)).astype(numpy.float32))
    before = w1.clone(), w2.clone()
    parts = [tp.shard_weights(w1, w2, r, 3) for r in range(3)]
    assert torch.equal(torch.cat([p[0] for p in parts], 0), w1)
    assert torch.equal(torch.cat([p[1] for p in parts], 1), w2)
    for a, b in parts:
        assert a.shape == (4, 5) and b.shape == (5, 4) and a.is_contiguous() and b.is_contiguous()
        a.fill_(7)
        b.fill_(7)  # copies: the unsharded weights stay as they were
    assert torch.equal(w1, before[0]) and torch.equal(w2, before[1])


def test_shard_weights_errors():
    w1, w2 = torch.ones(10, 4), torch.ones(4, 10)
    with pytest.raises(ValueError, match=r"hidden_dim \(10\) must be divisible by the world size \(4\)"):
        tp.shard_weights(w1, w2, 0, 4)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 2\); got 2"):
        tp.shard_weights(w1, w2, 2, 2)
    with pytest.raises(ValueError, match="world_size must be an integer >= 1; got 0"):
        tp.shard_weights(w1, w2, 0, 0)
    with pytest.raises(ValueError, match=r"weight2 must have shape \(dim, hidden_dim\) = \(4, 10\)"):
        tp.shard_weights(w1, torch.ones(10, 4), 0, 2)
    with pytest.raises(ValueError, match="weight1 must be 2-D"):
        tp.shard_weights(torch.ones(10), w2, 0, 2)
    with pytest.raises(TypeError, match="weight1 must be a torch.Tensor"):
        tp.shard_weights(numpy.ones((10, 4)), w2, 0, 2)


def test_layer_needs_an_initialized_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"torch.distributed is not initialized: call "
                                           r"torch.distributed.init_process_group"):
        tp.TensorParallelGeluFFN(8, 16)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        tp.tensor_parallel_gelu_ffn(torch.ones(2, 8), torch.ones(16, 8), torch.ones(8, 16))


def test_layer_argument_errors(group_of_one):
    with pytest.raises(ValueError, match="hidden_dim must be an integer >= 1; got 0"):
        tp.TensorParallelGeluFFN(8, 0)
    with pytest.raises(TypeError, match="float32 only"):
        tp.TensorParallelGeluFFN(8, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="precision must be one of"):
        tp.TensorParallelGeluFFN(8, 16, precision="fp8")
    with pytest.raises(ValueError, match="save must be one of"):
        tp.TensorParallelGeluFFN(8, 16, save="none")
    with pytest.raises(TypeError, match="weight1 must be float32"):
        tp.TensorParallelGeluFFN.from_full(torch.ones(16, 8, dtype=torch.float64), torch.ones(8, 16))
    with pytest.raises(TypeError, match="hidden_states must be float32"):
        tp.tensor_parallel_gelu_ffn(torch.ones(2, 8, dtype=torch.float64), torch.ones(16, 8), torch.ones(8, 16))


def test_group_of_one_is_the_plain_layer(rng, group_of_one):
    torch.manual_seed(7)
    layer = tp.TensorParallelGeluFFN(48, 160, save="linear1_out")
    torch.manual_seed(7)
    plain = ct.GeluFFN(48, 160, save="linear1_out")
    x = torch.from_numpy(rng.standard_normal((3, 11, 48)).astype(numpy.float32))
    r = torch.from_numpy(rng.standard_normal((3, 11, 48)).astype(numpy.float32))
    results = []
    for module in (layer, plain):
        xs = x.clone().requires_grad_()
        y = module(xs)
        (y * r).sum().backward()
        results.append((y.detach(), xs.grad, module.weight1.grad, module.weight2.grad))
    for name, a, b in zip(NAMES, *results):
        assert torch.equal(a, b), name  # one rank: the same cupyffn calls, and sums of one term


class DeferredSum:
    """Stands in for dist.all_reduce as a 2-rank sum of equal parts (x2); an async one lands only on wait().

    An async all-reduce whose handle is not waited on before its tensor is used shows up as a missing x2.
    """

    def __init__(self):
        self.calls = []

    def __call__(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.calls.append(("all_reduce", tuple(tensor.shape), async_op))
        if not async_op:
            tensor.mul_(2)
            return None
        calls = self.calls

        class Work:
            def wait(self):
                calls.append(("wait", tuple(tensor.shape)))
                tensor.mul_(2)
                return True

        return Work()


@pytest.mark.parametrize("need_w", (True, False))
def test_backward_waits_on_the_async_all_reduce_before_returning(rng, group_of_one, monkeypatch, need_w):
    fake = DeferredSum()
    monkeypatch.setattr(tp.dist, "all_reduce", fake)
    x, r = (torch.from_numpy(rng.standard_normal((20, 32)).astype(numpy.float32)) for _ in range(2))
    w1 = torch.from_numpy((rng.uniform(-1, 1, (64, 32)) / numpy.sqrt(32)).astype(numpy.float32))
    w2 = torch.from_numpy((rng.uniform(-1, 1, (32, 64)) / numpy.sqrt(64)).astype(numpy.float32))
    got, want = [], []
    for fn, out in ((tp.tensor_parallel_gelu_ffn, got), (ct.gelu_ffn, want)):
        xs, w1s, w2s = x.clone().requires_grad_(), w1.clone().requires_grad_(need_w), w2.clone().requires_grad_(need_w)
        y = fn(xs, w1s, w2s)
        (y * r).sum().backward()
        out.extend((y.detach(), xs.grad, w1s.grad, w2s.grad))
    assert fake.calls == [("all_reduce", (20, 32), False), ("all_reduce", (20, 32), True), ("wait", (20, 32))]
    assert torch.equal(got[0], 2 * want[0])  # the forward's sum
    assert torch.equal(got[1], 2 * want[1])  # grad_hidden_states: summed before the backward returned
    for a, b in zip(got[2:], want[2:]):
        assert (a is None and b is None and not need_w) or torch.equal(a, b)  # weight grads stay local


def test_reexported_from_cupyffn_torch():
    for name in tp.__all__:
        assert getattr(ct, name) is getattr(tp, name)


def torchrun(nproc, *args, timeout=300):
    """Run examples/train_tp_torch.py under torchrun (--standalone: a free local port); returns its stdout lines."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(EXAMPLES / "train_tp_torch.py"), *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()


def example_means(lines):
    """(mean loss of the first 10 steps, of the last 10) from the example's last line."""
    words = lines[-1].replace(",", "").split()
    assert words[:7] == ["mean", "loss", "of", "the", "first", "10", "steps"], lines[-1]
    return float(words[7]), float(words[-2])


def unsharded_example_means(steps, device):
    from test_examples import load  # tests/ is on sys.path (pytest's rootdir-relative import)

    losses = load("train_torch").main(steps=steps, device=device)
    return sum(losses[:10]) / 10, sum(losses[-10:]) / 10


def test_example_trains_like_the_unsharded_layer_under_torchrun_on_cpu():
    lines = torchrun(2, "--device", "cpu", "--steps", "60")
    assert lines[0].startswith(f"check (256x32x128, {cupyffn.CPU_DEFAULT_PRECISION}, world size 2): ") and lines[0].endswith(": ok"), lines[0]
    head, tail = example_means(lines)
    assert tail / head < 0.25, lines[-1]
    # examples/train_torch.py trains the same unsharded GeluFFN (same seed, teacher, data and optimizer)
    want = unsharded_example_means(60, "cpu")
    assert math.isclose(head, want[0], rel_tol=1e-3) and math.isclose(tail, want[1], rel_tol=1e-3), (lines[-1], want)


# ---------------------------------------------------------------------- GPU
def gpu_cases(rng, repeats=1):
    lead, dim, hidden = (4, 256), 1024, 2048
    cases = {p: make_case(rng, lead, dim, hidden, p, repeats=repeats) for p in ("bf16x3", "ieee", "tf32", "bf16")}
    cases["bf16x3-memory-mode"] = make_case(rng, lead, dim, hidden, "bf16x3", save="linear1_out", repeats=repeats)
    cases["bf16x3-no-overlap"] = make_case(rng, lead, dim, hidden, "bf16x3", overlap=False, repeats=repeats)
    cases["bf16x3-frozen-weights"] = make_case(rng, lead, dim, hidden, "bf16x3", need_w=False, repeats=repeats)
    return cases


def check_gpu_run(cases, ranks_out):
    for name, case in cases.items():
        check_ranks(case, [out[name] for out in ranks_out], "cuda")
        first, second = ranks_out[0][name], ranks_out[1][name]
        assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1]), name
    check_api(ranks_out)


@pytest.mark.gpu
def test_two_gpus_nccl_match_the_unsharded_block(rng, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    cases = gpu_cases(rng)
    check_gpu_run(cases, spawn(tmp_path, 2, "nccl", "cuda", cases, timeout=180))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda is not available")
def test_two_gloo_ranks_on_one_gpu_overlap_ordering(rng, tmp_path):
    # Both ranks on one GPU (gloo takes CUDA tensors; NCCL refuses two ranks on one device): the overlapped
    # all-reduce reads grad_hidden_states on gloo's stream, ordered only by the grad_hidden-ready event.
    cases = gpu_cases(rng, repeats=3)
    check_gpu_run(cases, spawn(tmp_path, 2, "gloo", "cuda", cases, timeout=180))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda is not available")
def test_nccl_group_of_one_takes_the_overlap_path(rng, tmp_path, monkeypatch):
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            device_id=device)
    try:
        seen = {"streams": [], "backward": []}
        all_reduce, backward = tp.dist.all_reduce, tp._gelu_ffn_backward

        def spy_all_reduce(tensor, *args, **kwargs):
            seen["streams"].append((torch.cuda.current_stream(device).cuda_stream, kwargs.get("async_op", False)))
            return all_reduce(tensor, *args, **kwargs)

        def spy_backward(*args, **kwargs):
            seen["backward"].append(kwargs.get("grad_hidden_ready"))
            return backward(*args, **kwargs)

        monkeypatch.setattr(tp.dist, "all_reduce", spy_all_reduce)
        monkeypatch.setattr(tp, "_gelu_ffn_backward", spy_backward)
        poison_outputs(monkeypatch.setattr)
        case = gpu_cases(rng)["bf16x3"]
        caller = torch.cuda.current_stream(device).cuda_stream
        got = _run_case(case, 0, 1, device)
        assert seen["streams"][0] == (caller, False)  # the forward's sum, on the caller's stream
        assert seen["streams"][1][1] is True and seen["streams"][1][0] != caller  # grad_hidden's, from the side
        assert len(seen["backward"]) == 1 and seen["backward"][0] is not None  # the ready event was asked for
        check_ranks(case, [got], "cuda")
        # CUDA autocast: the inputs are cast to float32 and the gradient comes back in the input's dtype
        x16 = case["x"].to(device, torch.bfloat16).requires_grad_()
        w1, w2 = (case[k].to(device).requires_grad_() for k in ("w1", "w2"))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = tp.tensor_parallel_gelu_ffn(x16, w1, w2, None, "bf16x3")
        assert y.dtype == torch.float32
        (y * case["r"].to(device)).sum().backward()
        assert x16.grad.dtype == torch.bfloat16 and w1.grad.dtype == torch.float32
        want = _run_case(dict(case, x=x16.detach().float().cpu()), 0, 1, device)
        assert torch.equal(y.detach().cpu(), want[0]) and torch.equal(x16.grad.cpu(), want[1].to(torch.bfloat16))
    finally:
        dist.destroy_process_group()


def check_example_on_cuda(lines, world):
    assert lines[0].startswith(f"check (1024x512x2048, {cupyffn.DEFAULT_PRECISION}, world size {world}): ") and lines[0].endswith(": ok")
    head, tail = example_means(lines)
    assert tail / head < 0.1, lines[-1]
    # the unsharded layer on one GPU, same run; Adam over 150 steps may carry rounding differences further
    want = unsharded_example_means(150, "cuda")
    assert math.isclose(head, want[0], rel_tol=1e-2) and math.isclose(tail, want[1], rel_tol=1e-2), (lines[-1], want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda is not available")
def test_example_and_bench_under_torchrun_on_one_gpu(tmp_path):
    # a group of one (NCCL): the script paths the two-GPU run takes, on the one-GPU machine
    check_example_on_cuda(torchrun(1, "--steps", "150"), 1)
    path = tmp_path / "tp-bench.json"
    torchrun(1, "--bench", str(path), "--bench-shapes", "1024x512x2048", "--warmup", "1", "--iters", "3")
    data = json.loads(path.read_text())
    assert data["meta"]["world_size"] == 1
    (row,) = data["results"]
    keys = ("tp_step_ms_overlap", "tp_step_ms_no_overlap", "single_gpu_step_ms", "tp_backward_ms_overlap",
            "tp_backward_ms_no_overlap", "single_gpu_backward_ms", "all_reduce_ms")
    assert all(math.isfinite(row[k]) and row[k] > 0 for k in keys), row
    assert max(row["check_vs_float64"].values()) <= cupyffn.PRECISIONS["bf16x3"].contract, row


@pytest.mark.gpu
def test_example_under_torchrun_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    check_example_on_cuda(torchrun(2, "--steps", "150"), 2)
