"""GPT-2 with cupyffn's MLPs, trained next to the same model in plain torch under bf16 autocast.

Builds a transformers GPT-2 from a config (no downloaded weights), clones it, swaps the clone's MLPs for
``cupyffn.torch.GeluFFN`` with ``cupyffn.torch.replace_mlps``, trains both from the same initial weights on the
same synthetic batches, and checks that the loss curves agree: the mean loss of the last fifth of the steps (at
least 20) within `tolerance` (relative) of eager torch's. With compilation (the default) both are also trained
under ``torch.compile`` (default mode) and ``torch.compile(mode="reduce-overhead")`` (CUDA graphs on the GPU), the
plain model and the swapped one compiled alike (the swapped MLPs then run their modules' own forward, as in the
plain model, unless --compiled cupyffn keeps cupyffn's operators in the compiled graph: replace_mlps' `compiled`).
Reports per run the median step time, the last step's loss as each run ends, and at the end the final loss: the mean
loss of the last fifth of the steps (at least 20), which the agreement is judged on. ``--paired`` trains each plain
run beside its swapped twin, their steps alternating, and also reports the swapped run's speed step by step: the
median over the steps of its twin's step time over its own (above 1: the swapped run is faster).

    python examples/train_gpt2.py                       # dim 1536, hidden 6144 (SD3.5 medium's MLP shape), 4 layers
    python examples/train_gpt2.py --model gpt2-medium   # GPT-2 medium: dim 1024, hidden 4096, 24 layers, seq 1024
    python examples/train_gpt2.py --small --device cpu  # a tiny config on the CPU (torch's CPU ops)

The same comparison for an SD3.5-shaped stack of residual MLP blocks (diffusers' FeedForward when diffusers is
installed, else the equivalent nn.Sequential): ``--model sd35``. ``--device auto`` (the default) takes the GPU where
torch and CuPy can use one, else the CPU; ``--device cuda`` on a machine where they cannot exits with the reason.
"""

import argparse
import contextlib
import copy
import statistics
import time

import torch

import cupyffn
import cupyffn.torch as ct

#: --model: the model kind ("gpt2": transformers' GPT-2; "sd35": SD35Stack) and main()'s default sizes (hidden = 4 dim).
PRESETS = {
    "gpt2": dict(kind="gpt2", dim=1536, layers=4, heads=12, vocab=512, seq=256, batch=8),  # SD3.5 medium's MLP shape
    "gpt2-medium": dict(kind="gpt2", dim=1024, layers=24, heads=16, vocab=512, seq=1024, batch=8),  # GPT-2 medium
    "sd35": dict(kind="sd35", dim=1536, layers=4, heads=12, vocab=512, seq=256, batch=8),
}
#: The runs, in order: (name, MLPs swapped by replace_mlps, torch.compile mode: None for eager). The plain model and
#: the swapped one go through the same torch.compile call for each mode.
RUNS = (("torch eager", False, None), ("cupyffn", True, None),
        ("torch.compile", False, "default"), ("cupyffn + torch.compile", True, "default"),
        ("torch.compile reduce-overhead", False, "reduce-overhead"),
        ("cupyffn + torch.compile reduce-overhead", True, "reduce-overhead"))
#: Each cupyffn run and the plain run it is compared with.
TWINS = {"cupyffn": "torch eager", "cupyffn + torch.compile": "torch.compile",
         "cupyffn + torch.compile reduce-overhead": "torch.compile reduce-overhead"}


def cuda_unavailable_reason():
    """None when CUDA can train here, else why not (one line): torch must see a device (torch.cuda.is_available())
    and cupyffn's GPU path, CuPy, must run a kernel on it."""
    if not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"torch.cuda.is_available() is False (torch {torch.__version__}, {build})"
    return cupyffn.gpu_unavailable_reason(run_kernel=True)


def pick_device(device):
    """The device to run on, "cpu" or "cuda", for `device` ("auto", "cpu" or "cuda"); "cuda" where CUDA cannot be
    used exits (SystemExit, status 1) with cuda_unavailable_reason() on one line."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda'; got {device!r}")
    if device == "cpu":
        return device
    reason = cuda_unavailable_reason()
    if reason is None:
        return "cuda"
    if device == "auto":
        return "cpu"
    raise SystemExit(f"train_gpt2.py: --device cuda, but {reason}; --device cpu runs on the CPU")


def gpt2(dim, layers, heads, vocab, seq, device):
    import transformers

    # bos / eos: GPT-2's convention, the last id of the vocabulary (its default, 50256, lies outside a small one and
    # transformers warns); the training feeds no special tokens.
    config = transformers.GPT2Config(n_embd=dim, n_inner=4 * dim, n_layer=layers, n_head=heads, vocab_size=vocab,
                                     n_positions=seq, activation_function="gelu_new", resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    # The loss GPT2LMHeadModel computes from labels, named: transformers infers it from the class name, finds none for
    # "GPT2LMHeadModel" and warns that it falls back to this same one (and torch.compile cannot trace that
    # logging call: a graph break in every compiled step).
    model.loss_type = "ForCausalLM"
    return model.to(device)


class SD35Stack(torch.nn.Module):
    """Residual blocks x + FeedForward(LayerNorm(x)) with SD3.5's MLP (dim -> 4 dim -> dim, GELU(tanh), biases)."""

    def __init__(self, dim, layers):
        super().__init__()
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(dim) for _ in range(layers))
        try:
            from diffusers.models.attention import FeedForward

            self.mlps = torch.nn.ModuleList(FeedForward(dim, activation_fn="gelu-approximate") for _ in range(layers))
        except ImportError:
            self.mlps = torch.nn.ModuleList(torch.nn.Sequential(
                torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(4 * dim, dim))
                for _ in range(layers))

    def forward(self, x):
        for norm, mlp in zip(self.norms, self.mlps):
            x = x + mlp(norm(x))
        return x


def batches(kind, steps, batch, seq, dim, vocab, device):
    """Synthetic data, the same for every model: token sequences of a fixed random successor table (GPT-2 learns
    it), or inputs and targets of a fixed random smooth map (the SD3.5 stack regresses it)."""
    g = torch.Generator().manual_seed(1)
    if kind == "gpt2":
        successor = torch.randint(0, vocab, (vocab,), generator=g)
        for _ in range(steps):
            ids = torch.empty(batch, seq, dtype=torch.long)
            ids[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
            for t in range(1, seq):
                noise = torch.rand(batch, generator=g) < 0.1
                ids[:, t] = torch.where(noise, torch.randint(0, vocab, (batch,), generator=g), successor[ids[:, t - 1]])
            yield ids.to(device)
    else:
        proj = torch.randn(dim, dim, generator=g) / dim ** 0.5
        for _ in range(steps):
            x = torch.randn(batch, seq, dim, generator=g)
            yield x.to(device), torch.tanh(x @ proj).to(device)


def stepper(model, kind, device, lr, mark_steps=False, autocast=torch.bfloat16, after_backward=None):
    """step(item) -> (loss, ms): one AdamW step under `autocast` (a dtype; None: none, the model computes in its own
    dtype), the gradient norm clipped at 1, its time in ms (CUDA events around the step, the host synchronized after
    it; on the CPU the host's clock). mark_steps: tell torch.compile's CUDA graphs (reduce-overhead) where each step
    begins. after_backward(), if given, is called after each backward, before the gradients are clipped (timed too:
    benchmarks/training_fp32.py reads the first step's gradients there)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    cuda = device != "cpu"
    context = (lambda: torch.autocast(device, dtype=autocast)) if autocast is not None else contextlib.nullcontext

    def step(item):
        start = time.perf_counter()
        if cuda:
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
        if mark_steps:
            torch.compiler.cudagraph_mark_step_begin()
        with context():
            loss = loss_of(model, kind, item)
        loss.backward()
        if after_backward is not None:
            after_backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as real training loops do: no late loss spikes
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            t1.record()
            t1.synchronize()
            ms = t0.elapsed_time(t1)
        else:
            ms = 1e3 * (time.perf_counter() - start)
        return loss.item(), ms

    return step


def loss_of(model, kind, item):
    """The training loss of `model` on batch `item` (`batches`): GPT-2's next-token cross-entropy, the SD3.5 stack's
    mean squared error in float32 (in the targets' dtype)."""
    if kind == "gpt2":
        return model(item, labels=item).loss
    return torch.nn.functional.mse_loss(model(item[0]).to(item[1].dtype), item[1])


def train(model, kind, data, device, lr, mark_steps=False):
    """Losses and step times (ms) of one AdamW step (`stepper`) per item of `data`."""
    step = stepper(model, kind, device, lr, mark_steps)
    losses, times = [], []
    for item in data:
        loss, ms = step(item)
        losses.append(loss)
        times.append(ms)
    return losses, times


def build(kind, sizes, device):
    """The plain model of `kind` at `sizes` (dim, layers, heads, vocab, seq), seeded: the same weights every time."""
    if kind == "gpt2":
        return gpt2(sizes["dim"], sizes["layers"], sizes["heads"], sizes["vocab"], sizes["seq"], device)
    torch.manual_seed(0)
    return SD35Stack(sizes["dim"], sizes["layers"]).to(device)


def layers_that_fit(kind, sizes, device):
    """sizes["layers"], or on a GPU where one eager training step at that depth runs out of memory, the first of
    half, a quarter, ... that does not (with a printed note). The other runs may still need more (each is recorded)."""
    layers = sizes["layers"]
    while device == "cuda":
        try:
            model = build(kind, dict(sizes, layers=layers), device)
            train(model, kind, batches(kind, 1, sizes["batch"], sizes["seq"], sizes["dim"], sizes["vocab"], device),
                  device, 1e-4)  # one step: the learning rate does not matter
            return layers
        except torch.cuda.OutOfMemoryError:
            if layers == 1:
                raise
            total = torch.cuda.mem_get_info()[1]
            print(f"note: {kind} with {layers} layers (dim {sizes['dim']}, seq {sizes['seq']}, batch {sizes['batch']}) "
                  f"does not fit in GPU memory ({total / 2**30:.0f} GiB); trying {layers // 2} layers", flush=True)
            layers //= 2
        finally:
            model = None
            torch.cuda.empty_cache()
    return layers


class _Run:
    """One run of main() in progress: its step function, its batches, what it has measured so far."""

    def __init__(self, name, mode, data):
        self.name, self.mode, self.data, self.step = name, mode, data, None
        self.losses, self.times, self.graph_breaks, self.error = [], [], 0, None

    def fail(self, error, model, keep_going):
        """Record `error` as this run's outcome (keep_going), or raise it."""
        if not keep_going:
            raise error
        self.error = _one_line(error)
        print(f"{model}: {self.name} failed: {self.error[:300]}", flush=True)


def train_together(runs, steps, model, keep_going):
    """Step every run of `runs` (each with its .step and .data set, or its .error) `steps` times, in turn: step i
    starts with run i mod len(runs), so with two runs each goes first every other step. Each run records its losses,
    step times and the graph breaks Dynamo counted during its own steps; a run that raises is recorded (keep_going)
    and the others go on, or the error propagates."""
    for i in range(steps):
        k = i % len(runs)
        for run in runs[k:] + runs[:k]:
            if run.error is not None:
                continue
            breaks = sum(torch._dynamo.utils.counters["graph_break"].values())  # Dynamo's count (no public API)
            try:
                loss, ms = run.step(next(run.data))
            except Exception as e:
                run.fail(e, model, keep_going)
                continue
            run.graph_breaks += sum(torch._dynamo.utils.counters["graph_break"].values()) - breaks
            run.losses.append(loss)
            run.times.append(ms)


def _one_line(error, limit=1000):
    text = f"{type(error).__name__}: {' '.join(str(error).split())}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def main(model="gpt2", steps=300, device="auto", dim=None, layers=None, heads=None, vocab=None, seq=None, batch=None,
         lr=None, compile=True, tolerance=0.03, keep_going=False, say=None, compiled="module", paired=False):
    """Train the torch model and its cupyffn clone, each eager and (compile=True) under torch.compile's default and
    reduce-overhead modes (RUNS); returns a dict: per run its losses, median step time, final loss (the mean of the
    last fifth of the steps, at least 20: "final_loss_steps" of them), its ratio to torch eager's and whether that
    is within `tolerance` (relative); "final_loss_ratio" and "agree" of cupyffn (eager) against torch eager;
    "learned"; "sizes".

    model: a PRESETS name; dim, layers, heads, vocab, seq, batch default to its sizes (gpt2-medium's 24 layers come
    down on a GPU whose memory they do not fit: layers_that_fit). device: "auto", "cpu" or "cuda" (pick_device).
    lr: AdamW's (default 3e-4 for GPT-2; 1e-4 for sd35, whose regression at 3e-4 spikes: measured on the H200,
    eager and torch.compile then ended 17% apart). keep_going: a run that raises is recorded as {"error": "..."}
    and the others still run (the bench suite); otherwise the exception propagates. say(line), if given, reports
    each run as it starts and ends (the script prints them: a compiled run can take a minute). compiled: replace_mlps'
    option, what the swapped MLPs run under torch.compile ("module": the module's own forward, as the plain model;
    "cupyffn": cupyffn's operators). paired: train each plain run and its swapped twin side by side, their steps
    alternating (each first every other step), so that both see the same state of the host and the GPU; the swapped
    run then also has "paired_speedup_vs_twin", the median over its steps (after the fifth) of the twin's step time
    over its own. Otherwise one run after the other."""
    if model not in PRESETS:
        raise ValueError(f"model must be one of {sorted(PRESETS)}; got {model!r}")
    given = dict(dim=dim, layers=layers, heads=heads, vocab=vocab, seq=seq, batch=batch)
    sizes = {k: PRESETS[model][k] if v is None else v for k, v in given.items()}
    kind = PRESETS[model]["kind"]
    device = pick_device(device)
    if lr is None:
        lr = 3e-4 if kind == "gpt2" else 1e-4
    sizes["layers"] = layers_that_fit(kind, sizes, device)
    base = build(kind, sizes, device)
    fast = copy.deepcopy(base)
    replaced, skipped = ct.replace_mlps(fast, compiled=compiled)
    if len(replaced) != sizes["layers"] or skipped:
        raise RuntimeError(f"replace_mlps swapped {replaced}, left {skipped}")
    results = {"sizes": dict(sizes, hidden=4 * sizes["dim"]), "compiled": compiled}
    say = say or (lambda line: None)
    runs = [r for r in RUNS if compile or r[2] is None]
    # one run at a time, or (paired) each plain run beside its swapped twin (RUNS lists them in pairs)
    groups = [runs[i:i + 2] for i in range(0, len(runs), 2)] if paired else [[r] for r in runs]
    for g, group in enumerate(groups):
        label, compiled_group = f"{model}: run {g + 1}/{len(groups)}", group[0][2] is not None  # twins share a mode
        say(f"{label}, {' and '.join(name for name, _, _ in group)}: {steps} steps on {device}"
            + (", steps alternating" if len(group) > 1 else "") + (" (compiling first)" if compiled_group else ""))
        if compiled_group:
            torch._dynamo.reset()  # each compiled group from empty caches (and no CUDA graphs of the last)
        active = []
        for name, swapped, mode in group:
            run = _Run(name, mode, batches(kind, steps, sizes["batch"], sizes["seq"], sizes["dim"], sizes["vocab"],
                                           device))
            try:
                m = copy.deepcopy(fast if swapped else base)  # every run from the same initial weights
                if mode is not None:
                    m = torch.compile(m, mode=None if mode == "default" else mode)
                run.step = stepper(m, kind, device, lr, mark_steps=mode == "reduce-overhead")
            except Exception as e:
                run.fail(e, model, keep_going)
            active.append(run)
        train_together(active, steps, model, keep_going)  # paired: each goes first every other step
        for run in active:
            if run.error is not None:
                results[run.name] = {"error": run.error}
                continue
            results[run.name] = {"losses": run.losses,
                                 "median_step_ms": statistics.median(run.times[5:] or run.times)}
            if run.mode is not None:
                results[run.name]["graph_breaks"] = run.graph_breaks
            say(f"{label}, {run.name}: median step {results[run.name]['median_step_ms']:.2f} ms, "
                f"loss at the last step {run.losses[-1]:.4f}")
        if len(active) == 2 and all(run.error is None for run in active):
            plain, twin = active  # the swapped run's step time against its plain twin's, step by step
            ratios = [a / b for a, b in zip(plain.times, twin.times)]
            results[twin.name]["paired_speedup_vs_twin"] = statistics.median(ratios[5:] or ratios)
        active = m = None  # free this group's models (and their optimizer state) before the next
        if device == "cuda":
            torch.cuda.empty_cache()
    tail = min(max(20, steps // 5), steps)
    results["final_loss_steps"] = tail
    for name, _, _ in RUNS:
        if "losses" in results.get(name, {}):
            results[name]["final_loss"] = sum(results[name]["losses"][-tail:]) / tail
    eager = results.get("torch eager", {})
    for name, _, _ in RUNS:
        r = results.get(name, {})
        if "final_loss" in r and "final_loss" in eager:
            r["final_loss_vs_eager"] = r["final_loss"] / eager["final_loss"]
            r["agree"] = abs(r["final_loss_vs_eager"] - 1) <= tolerance
    results["final_loss_ratio"] = results.get("cupyffn", {}).get("final_loss_vs_eager")
    results["agree"] = results.get("cupyffn", {}).get("agree", False)
    results["learned"] = "final_loss" in eager and eager["final_loss"] < 0.8 * sum(eager["losses"][:tail]) / tail
    return results


def report(r, tolerance=0.03):
    """The lines the script prints at the end for main()'s results `r`: per run its median step time and final loss
    (its ratio to eager's; paired: its speed against its twin, step by step), then whether cupyffn's final loss
    agrees with torch eager's."""
    lines = []
    tail = r.get("final_loss_steps")
    for name, _, _ in RUNS:
        e = r.get(name)
        if e is None:
            continue
        if "error" in e:
            lines.append(f"{name:40s} failed: {e['error']}")
            continue
        lines.append(f"{name:40s} median step {e['median_step_ms']:8.2f} ms   mean loss of the last {tail} steps "
                     f"{e['final_loss']:.4f}"
                     + (f" ({e['final_loss_vs_eager']:.4f}x eager's)" if "final_loss_vs_eager" in e else "")
                     + (f"; step by step {e['paired_speedup_vs_twin']:.3f}x the speed of {TWINS[name]} "
                        f"({TWINS[name]}'s step time / its own, median over the steps)"
                        if "paired_speedup_vs_twin" in e else ""))
    if r["final_loss_ratio"] is not None:
        lines.append(f"mean loss of the last {tail} steps, cupyffn / torch eager = {r['final_loss_ratio']:.4f}: "
                     f"{'agree' if r['agree'] else 'DISAGREE'} (within {tolerance:.0%}: {r['agree']})")
    return lines


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=tuple(PRESETS), default="gpt2",
                   help="gpt2: dim 1536, 4 layers; gpt2-medium: dim 1024, 24 layers; sd35: an SD3.5-shaped MLP stack")
    p.add_argument("--steps", type=int, default=300, help="AdamW steps per run")
    p.add_argument("--small", action="store_true", help="dim 64, 2 layers, 2 heads, vocab 64, seq 32, batch 4")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: the GPU where torch and CuPy can use one, else the CPU")
    p.add_argument("--no-compile", action="store_true", help="eager runs only (no torch.compile)")
    p.add_argument("--compiled", choices=ct.COMPILED, default="module",
                   help="what the swapped MLPs run under torch.compile: the module's own forward, or cupyffn's "
                        "operators (replace_mlps' compiled=)")
    p.add_argument("--paired", action="store_true",
                   help="train each plain run beside its swapped twin, their steps alternating (one run at a time "
                        "otherwise)")
    return p.parse_args(argv)


if __name__ == "__main__":
    a = _parse()
    sizes = dict(dim=64, layers=2, heads=2, vocab=64, seq=32, batch=4) if a.small else {}
    r = main(a.model, a.steps, a.device, compile=not a.no_compile, keep_going=True, compiled=a.compiled,
             paired=a.paired, say=lambda line: print(line, flush=True), **sizes)
    print("\n".join(report(r)))
    failed = [name for name, _, _ in RUNS if "error" in r.get(name, {})]
    if failed:
        raise SystemExit(f"train_gpt2.py: {len(failed)} of the runs failed: {', '.join(failed)}")
