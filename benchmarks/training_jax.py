"""The JAX model of ``bench.py --suite train-fp32`` ("jax-mlp"): examples/train_jax.py's float32 training loop at the
GPT-2 MLP's size (dim 1536, hidden 6144, 2048 tokens a step), its FFN in plain jnp ops under ``jax.jit`` against
``cupyffn.jax.gelu_ffn`` in the same jitted step.

The task is the example's (`problem`, `batch_of`, `objective`): regression onto a fixed teacher FFN with plain SGD.
The batches are drawn outside the timed step (the teacher's output at HIGHEST precision, the same for every row), so
a step is the FFN's forward, ``jax.value_and_grad`` and the update, timed on the host's clock around the call with
the results waited for. Rows: the plain FFN at HIGHEST precision ("jax.jit highest": float32 products, the strict
reference) and at JAX's default ("jax.jit default": TF32 on GPUs that have it); cupyffn's fp16+fp8 and ieee beside
highest and tf32 beside default. Per row, as for the torch models (benchmarks/training_fp32.py): the median step
after the fifth, the loss curve's largest relative distance from highest's, and the first step's gradients against
float64 (`float64_gradients`, NumPy). --paired trains every row together, steps in turn. Without a GPU that JAX and
CuPy can use, the model is skipped with the reason.
"""

import importlib.util
import os
import statistics
import time

import numpy

from . import report as R
from .training_fp32 import JAX_MODEL, loss_distance

SIZES = dict(dim=1536, hidden=6144, tokens=2048)
#: (row, precision: a cupyffn precision, or "highest" / "default" for the plain jnp FFN)
ROWS = (("jax.jit highest", "highest"), ("cupyffn fp16+fp8", "fp16+fp8"), ("cupyffn ieee", "ieee"),
        ("jax.jit default", "default"), ("cupyffn tf32", "tf32"))
TWINS = {"cupyffn fp16+fp8": "jax.jit highest", "cupyffn ieee": "jax.jit highest", "cupyffn tf32": "jax.jit default"}
REFERENCE = "jax.jit highest"
_SQRT_2_OVER_PI = 0.7978845608028654


def _example():
    spec = importlib.util.spec_from_file_location("cupyffn_example_train_jax", R.ROOT / "examples" / "train_jax.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def float64_gradients(x, w1, w2, target):
    """(dL/dw1, dL/dw2) in float64 (NumPy) of the example's objective 0.5 * sum((y - target)^2) / batch, y =
    gelu_tanh(x w1^T) w2^T, on these (float32) values."""
    x, w1, w2, target = (numpy.asarray(a, numpy.float64) for a in (x, w1, w2, target))
    z = x @ w1.T
    t = numpy.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z ** 3))
    g = 0.5 * z * (1 + t)
    dy = (g @ w2.T - target) / x.shape[0]
    dz = (dy @ w2) * (0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * z * z))
    return dz.T @ x, dy.T @ g


def rel_l2(got, want):
    got, want = numpy.asarray(got, numpy.float64), numpy.asarray(want, numpy.float64)
    return float(numpy.linalg.norm(got - want) / numpy.linalg.norm(want))


def run(steps, device="cuda", paired=False, sizes=None, say=None, keep_going=True):
    """Train every row of ROWS `steps` steps on `device` ("cuda" or "cpu"); returns {"sizes", "twins", "runs": {row:
    {"losses", "median_step_ms", "loss_distance", "grad_error", "paired_speedup_vs_twin" (paired)} or {"error"}}},
    or {"skipped": why} where JAX or its GPU is missing. `sizes` override SIZES (dim, hidden, tokens)."""
    # before JAX starts: XLA allocates as it goes (its default takes 75% of the GPU, which torch's runs and
    # CuPy's pool need too); a setting given already is kept
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as e:
        return {"skipped": f"JAX is not installed ({e})"}
    try:
        example = _example()
        dev = example.pick_device(device)
    except SystemExit as e:
        return {"skipped": str(e)}
    import cupyffn.jax as cupyffn_jax

    say = say or (lambda line: None)
    sizes = dict(SIZES, **(sizes or {}))
    dim, hidden, tokens = sizes["dim"], sizes["hidden"], sizes["tokens"]
    highest = jax.lax.Precision.HIGHEST
    teacher, params, data_key = jax.device_put(example.problem(dim, hidden), dev)
    lr = 20.0 / hidden  # the example's
    # the teacher and the key as arguments, not constants folded into the program
    make_batch = jax.jit(lambda key, step, teacher: example.batch_of(key, step, tokens, teacher, highest))

    def batch(step):
        return jax.block_until_ready(make_batch(data_key, jnp.asarray(step, jnp.uint32), teacher))

    x0, t0 = batch(0)
    want = float64_gradients(x0, params[0], params[1], t0)

    def ffn_of(precision):
        if precision in ("highest", "default"):
            p = highest if precision == "highest" else None
            return lambda x, w1, w2: example.plain_ffn(x, w1, w2, p)
        return lambda x, w1, w2: cupyffn_jax.gelu_ffn(x, w1, w2, precision)

    runs = []
    for name, precision in ROWS:
        ffn = ffn_of(precision)

        def loss_fn(p, x, target, ffn=ffn):
            return example.objective(ffn(x, p[0], p[1]), target)

        @jax.jit
        def step(p, x, target, loss_fn=loss_fn):
            value, grads = jax.value_and_grad(loss_fn)(p, x, target)
            return tuple(w - lr * g for w, g in zip(p, grads)), value

        runs.append({"name": name, "step": step, "params": params, "losses": [], "times": [], "error": None,
                     "grads": jax.jit(jax.grad(loss_fn))})
    plan = [runs] if paired else [[r] for r in runs]
    for group in plan:
        say(f"{JAX_MODEL}: {' and '.join(r['name'] for r in group)}: {steps} steps on {dev.platform}"
            + (", steps in turn" if len(group) > 1 else ""))
        for r in group:
            try:
                got = r["grads"](params, x0, t0)
                r["grad_error"] = {"mlp_weights": max(rel_l2(g, w) for g, w in zip(got, want)),
                                   "all": rel_l2(numpy.concatenate([numpy.ravel(g) for g in got]),
                                                 numpy.concatenate([numpy.ravel(w) for w in want]))}
            except Exception as e:
                _fail(r, e, keep_going)
        for i in range(steps):
            x, target = batch(i)
            k = i % len(group)
            for r in group[k:] + group[:k]:
                if r["error"] is not None:
                    continue
                try:
                    start = time.perf_counter()
                    r["params"], value = jax.block_until_ready(r["step"](r["params"], x, target))
                    r["times"].append(1e3 * (time.perf_counter() - start))
                    r["losses"].append(float(value))
                except Exception as e:
                    _fail(r, e, keep_going)
    return _results(runs, sizes, paired)



def _fail(run, error, keep_going):
    if not keep_going:
        raise error
    run["error"] = f"{type(error).__name__}: {' '.join(str(error).split())}"[:1000]


def _results(runs, sizes, paired):
    out = {"sizes": sizes, "twins": TWINS, "runs": {}}
    by_name = {r["name"]: r for r in runs}
    for r in runs:
        if r["error"] is not None:
            out["runs"][r["name"]] = {"error": r["error"]}
            continue
        out["runs"][r["name"]] = {"losses": r["losses"], "grad_error": r["grad_error"],
                                  "median_step_ms": statistics.median(r["times"][5:] or r["times"])}
    reference = out["runs"].get(REFERENCE, {}).get("losses")
    for entry in out["runs"].values():
        if reference is not None and "losses" in entry:
            entry["loss_distance"] = loss_distance(entry["losses"], reference)
    if paired:
        for name, twin in TWINS.items():
            a, b = by_name[twin], by_name[name]
            if a["error"] is None and b["error"] is None:
                ratios = [p / q for p, q in zip(a["times"], b["times"])]
                out["runs"][name]["paired_speedup_vs_twin"] = statistics.median(ratios[5:] or ratios)
    return out
