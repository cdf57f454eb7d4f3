"""Putting cupyffn into an existing model without changing it: ``replace_mlps`` gives each MLP it reproduces exactly a
forward of cupyffn's, and ``restore_mlps`` takes it back.

The module itself stays: the same class, submodules, Parameter objects and state_dict keys (``c_fc.weight`` stays
``c_fc.weight``), tied or shared weights intact, an optimizer built before the swap still trains what runs, and
``load_state_dict`` / ``save_pretrained`` see the model they know. Only the module's ``forward`` attribute is set
(a ``functools.partial`` of `_forward`, which pickles and deep-copies with the module), as Liger-Kernel patches a
module's forward, and its ``extra_repr`` (`_extra_repr`: ``print(model)`` shows which MLPs run on cupyffn; neither
a Parameter nor a buffer, so state_dict keys stay, and nothing torch.compile traces). transformers' Conv1D weights (``[in, out]``) are used as stored: cupyffn reads their transposes
as views (cupyffn/frameworks/torch_ops.py `weights`).

What is recognized is data (`FAMILIES`, and the two structural forms in `_layers`): which attributes are the two
linear layers, the activation and the dropouts, and where each dropout sits. A dropout on the MLP's output (after the
second linear) is the module's own, run on cupyffn's output as the module runs it (train and eval, the same RNG
draws). A dropout between the activation and the second linear cannot be placed around cupyffn's block: with p > 0
such an MLP is swapped in eval mode only, and in training its swapped forward is the module's own forward
(docs/decisions/060-swap-places-dropout.md).

Under torch.compile (and torch.export), where the activations are 16-bit, a swapped MLP runs the module's own forward
by default (``compiled="module"``): the compiler then generates and fuses its code as in the plain model, whose GEMMs
are the same cuBLAS products cupyffn's 16-bit route runs, and the operators' Python host time per call is not paid
(docs/decisions/065-swap-in-a-compiled-step.md). ``compiled="cupyffn"`` keeps cupyffn's operators in the compiled
graph. float32 activations always run cupyffn (its precisions are not torch's).
"""

import functools
import warnings
from typing import NamedTuple, Optional

import torch

from ..core.precision import checked_name
from .torch_layer import activation_dtype, block, linear_weights
from .torch_ops import HALF, check_save

_TANH_GELUS = ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh", "FastGELUActivation")
_ERF_GELUS = ("GELUActivation",)
_MARK = "_cupyffn_mlp"  # the attribute a swapped module carries (its Swap)
#: What a swapped MLP runs under torch.compile / torch.export with 16-bit activations (module docstring).
COMPILED = ("module", "cupyffn")


class Family(NamedTuple):
    """An MLP class whose forward is ``dropout(linear2(inner(act(linear1(x)))))``, by attribute name."""

    linear1: str
    act: str
    linear2: str
    dropout: Optional[str] = None     # after linear2, on the output
    inner: Optional[str] = None       # between the activation and linear2
    identity: tuple = ()              # children that must be nn.Identity (timm's norm)


_TRANSFORMERS_GPT = Family("c_fc", "act", "c_proj", "dropout")
_TRANSFORMERS_FC = Family("fc_in", "act", "fc_out", "dropout")
#: MLP classes by name (transformers' modeling files; timm's Mlp also by module, its name being common).
FAMILIES = {
    "GPT2MLP": _TRANSFORMERS_GPT,            # Conv1D layers, gelu_new
    "GPTBigCodeMLP": _TRANSFORMERS_GPT,      # gelu_pytorch_tanh
    "GPTNeoMLP": _TRANSFORMERS_GPT,          # nn.Linear, gelu_new
    "GPTJMLP": _TRANSFORMERS_FC,
    "CodeGenMLP": _TRANSFORMERS_FC,
    "PhiMLP": Family("fc1", "activation_fn", "fc2"),
    "timm.Mlp": Family("fc1", "act", "fc2", dropout="drop2", inner="drop1", identity=("norm",)),
}


class Swap(NamedTuple):
    """How a swapped MLP runs: its layers by attribute path, and the layer's options."""

    linear1: tuple     # attribute path from the MLP to its first Linear / Conv1D
    linear2: tuple
    precision: str     # None: the device's default (float32 computation)
    save: str
    dropout: tuple = None      # path of the dropout on the output, run after cupyffn's block
    eval_only: bool = False    # a dropout p > 0 before linear2: in training, the module's own forward runs
    compiled: str = "module"   # a COMPILED value


def _probe_is_tanh_gelu(act):
    """None when `act` computes GELU(tanh) on a probe (fp32, -6..6), else why not."""
    x = torch.linspace(-6.0, 6.0, 193)
    try:
        with torch.no_grad():
            got = act(x)
    except Exception as e:  # an activation that cannot run here cannot be verified
        return f"activation {type(act).__name__} could not be checked ({type(e).__name__}: {e})"
    if not isinstance(got, torch.Tensor) or got.shape != x.shape:
        return f"activation {type(act).__name__} is not elementwise"
    if float((got.float() - torch.nn.functional.gelu(x, approximate="tanh")).abs().max()) <= 1e-5:
        return None
    erf = float((got.float() - torch.nn.functional.gelu(x)).abs().max()) <= 1e-5
    return f"activation {type(act).__name__} computes {'erf GELU' if erf else 'something other than GELU(tanh)'}"


def _tanh_gelu(act):
    """None when module `act` is GELU with the tanh approximation, as cupyffn computes it; else why not."""
    if isinstance(act, torch.nn.GELU):
        return None if act.approximate == "tanh" else f"GELU(approximate={act.approximate!r}) (erf GELU)"
    name = type(act).__name__
    if name in _TANH_GELUS:
        return _probe_is_tanh_gelu(act)  # known by name, and checked by value
    if name in _ERF_GELUS:
        return f"activation {name} (erf GELU; cupyffn computes GELU(tanh) only)"
    if name == "GELU" and hasattr(act, "proj"):  # diffusers' GELU (with .proj)
        approximate = getattr(act, "approximate", None)
        return None if approximate == "tanh" else f"diffusers GELU(approximate={approximate!r}) (erf GELU)"
    return f"activation {name} (cupyffn computes GELU(tanh) only)"


def _dropout_p(m, where):
    """(p, None) of a dropout slot (None, Identity: p = 0), or (None, why) for another module."""
    if m is None or isinstance(m, torch.nn.Identity):
        return 0.0, None
    if type(m) is torch.nn.Dropout:
        return m.p, None
    return None, f"unexpected module {type(m).__name__} {where}"


def _linear(layer, name):
    """None when `layer` computes as nn.Linear or transformers' Conv1D, in a dtype cupyffn takes; else why not."""
    plain = isinstance(layer, torch.nn.Module) and (
        type(layer).forward is torch.nn.Linear.forward or type(layer).__name__ == "Conv1D")
    if not plain or "forward" in vars(layer):
        return f"{name} is {type(layer).__name__} (cupyffn computes nn.Linear or transformers' Conv1D layers)"
    if layer.weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"{name}'s weight is {layer.weight.dtype} (cupyffn takes float32, bfloat16 or float16)"
    return None


def _shapes(module, path1, path2):
    """None when linear2 maps linear1's output back to its input's width (dim -> hidden -> dim), else why not."""
    (w1, _, t1), (w2, _, t2) = linear_weights(_walk(module, path1)), linear_weights(_walk(module, path2))
    if t1 != t2:
        return "one linear layer is nn.Linear and the other Conv1D"
    (h, d), (d2, h2) = (tuple(w1.shape[::-1]), tuple(w2.shape[::-1])) if t1 else (tuple(w1.shape), tuple(w2.shape))
    if (d2, h2) != (d, h):
        return f"the layers map {d} -> {h} and {h2} -> {d2}; cupyffn's block maps dim -> hidden -> dim"
    return None


def _family(module):
    name = type(module).__name__
    if name == "Mlp" and type(module).__module__.startswith("timm."):
        return FAMILIES["timm.Mlp"]
    return FAMILIES.get(name)


def _layers(module):
    """(Swap fields, None) for an MLP cupyffn reproduces (linear1, linear2, dropout, inner dropout's p), (None, why)
    for an MLP-like module it would compute otherwise, (None, None) for anything else."""
    name = type(module).__name__
    if isinstance(module, torch.nn.Sequential) and len(module) == 3 and all(
            isinstance(module[i], torch.nn.Linear) for i in (0, 2)):
        return _check(module, ("0",), module[1], ("2",), None, 0.0)
    if name == "FeedForward" and hasattr(module, "net"):  # diffusers: net = [GELU(proj), Dropout, Linear(, Dropout)]
        net = list(module.net)
        if not 3 <= len(net) <= 4 or not hasattr(net[0], "proj") or not isinstance(net[2], torch.nn.Linear):
            return None, "a FeedForward whose net is not [GELU(proj), Dropout, Linear(, Dropout)]"
        inner, why = _dropout_p(net[1], "between the activation and the second linear")
        if why:
            return None, why
        out = ("net", "3") if len(net) == 4 else None
        return _check(module, ("net", "0", "proj"), net[0], ("net", "2"), out, inner)
    family = _family(module)
    if family is None:
        return None, None
    expected = {family.linear1, family.act, family.linear2} | {n for n in (family.dropout, family.inner) if n}
    children = set(dict(module.named_children()))
    extra = sorted(children - expected - set(family.identity))
    if extra or not expected <= children:
        return None, f"a {name} with submodules {sorted(children)} (expected {sorted(expected)})"
    for n in family.identity:  # absent (an older timm) or nn.Identity
        m = getattr(module, n, None)
        if m is not None and not isinstance(m, torch.nn.Identity):
            return None, f"{n} is {type(m).__name__} between the activation and the second linear"
    inner, why = _dropout_p(getattr(module, family.inner) if family.inner else None,
                            "between the activation and the second linear")
    if why:
        return None, why
    return _check(module, (family.linear1,), getattr(module, family.act), (family.linear2,),
                  (family.dropout,) if family.dropout else None, inner)


def _check(module, path1, act, path2, dropout, inner):
    why = _linear(_walk(module, path1), ".".join(path1)) or _linear(_walk(module, path2), ".".join(path2))
    why = why or _tanh_gelu(act) or _shapes(module, path1, path2)
    if dropout is not None and not why:
        why = _dropout_p(_walk(module, dropout), "on the output")[1]
    if why:
        return None, why
    if inner > 0 and module.training and getattr(module, _MARK, None) is None:  # swapped already: options only
        return None, (f"dropout p={inner} between the activation and the second linear, in training (cupyffn has no "
                      f"dropout there; in eval mode, where it is the identity, the MLP is swapped: call "
                      f"model.eval() first)")
    return (path1, path2, dropout, inner > 0), None


def _walk(module, path):
    for name in path:
        module = getattr(module, name)
    return module


def _forward(module, swap, hidden_states, *args, **kwargs):
    """A swapped MLP's forward: linear2(gelu_tanh(linear1(hidden_states))) on cupyffn, then the module's own output
    dropout (extra arguments, which diffusers' FeedForward accepts and ignores, are ignored). An eval-only swap in
    training runs the module's own forward (its dropout before linear2 included)."""
    if swap.eval_only and module.training:
        return type(module).forward(module, hidden_states, *args, **kwargs)
    w1, b1, t1 = linear_weights(_walk(module, swap.linear1))
    if swap.compiled == "module" and torch.compiler.is_compiling() and activation_dtype(hidden_states, w1) in HALF:
        return type(module).forward(module, hidden_states, *args, **kwargs)
    w2, b2, _ = linear_weights(_walk(module, swap.linear2))
    if t1:  # Conv1D: [in, out] as stored, read through the transposed views
        w1, w2 = w1.t(), w2.t()
    out = block(hidden_states, w1, w2, b1, b2, swap.precision, swap.save)
    return out if swap.dropout is None else _walk(module, swap.dropout)(out)


def _extra_repr(module, swap):
    """A swapped MLP's line in ``print(model)``: its own extra_repr, then that it runs on cupyffn and how."""
    own = type(module).extra_repr(module)
    where = ", eval mode only: in training its own forward" if swap.eval_only else ""
    line = (f"cupyffn: swapped by replace_mlps (precision={swap.precision!r}, save={swap.save!r}, "
            f"compiled={swap.compiled!r}{where})")
    return f"{own}\n{line}" if own else line


def check_compiled(compiled):
    if compiled not in COMPILED:
        raise ValueError(f"compiled must be one of {', '.join(repr(c) for c in COMPILED)}; got {compiled!r}")
    return compiled


def replace_mlps(model, precision=None, save="all", compiled="module"):
    """Run every MLP of `model` that cupyffn reproduces exactly on cupyffn, in place, keeping the model (module
    docstring).

    Recognized, with GELU(tanh) verified (``nn.GELU(approximate="tanh")``, transformers' ``gelu_new``,
    ``gelu_pytorch_tanh``, ``gelu_fast``; an erf GELU or another activation is refused, saying so):
    ``nn.Sequential(Linear, GELU, Linear)``; diffusers' ``FeedForward`` (``activation_fn="gelu-approximate"``: DiT,
    PixArt, SD3, Flux); transformers' ``GPT2MLP``, ``GPTBigCodeMLP``, ``GPTNeoMLP``, ``GPTJMLP``, ``CodeGenMLP`` and
    ``PhiMLP``; timm's ``Mlp`` (``act_layer=partial(nn.GELU, approximate="tanh")``, SigLIP-style ViTs). A dropout on the
    MLP's output runs as the module runs it; an MLP with a dropout p > 0 between the activation and the second linear
    is swapped only when it is in eval mode, and computes with its own forward whenever it is in training
    (``swapped_mlps`` then leaves it out). `precision` and `save` as in ``GeluFFN``. `compiled`: what a swapped MLP
    runs while torch.compile or torch.export traces it with 16-bit activations (autocast or 16-bit inputs):
    "module" (the default), the module's own forward, so that the compiled model's code for its MLPs is the plain
    model's (inductor's fused kernels, no Python per call); "cupyffn", cupyffn's operators, opaque calls in the graph
    (1-2% faster on the GPU-bound GPT-2 medium, 7-12% slower on host-bound small models: docs/decisions/065). Eager
    calls and float32 activations run cupyffn either way. Swapping a swapped MLP again updates its options;
    ``restore_mlps`` undoes it.

    Returns ``(replaced, skipped)``: the names of the modules now running on cupyffn, and {name: reason} for
    MLP-like modules left alone because cupyffn would compute something else. Where the model has MLP-like modules
    and none was swapped, one warning says why.
    """
    precision, save, compiled = checked_name(precision), check_save(save), check_compiled(compiled)
    replaced, skipped = [], {}
    for name, module in model.named_modules():
        if any(name.startswith(r + ".") for r in replaced):
            continue
        if "forward" in vars(module) and getattr(module, _MARK, None) is None:
            if _layers(module) != (None, None):
                skipped[name] = "its forward was replaced already (by another library?)"
            continue
        fields, why = _layers(module)
        if why:
            skipped[name] = why
        if fields is None:
            continue
        path1, path2, dropout, eval_only = fields
        swap = Swap(path1, path2, precision, save, dropout, eval_only, compiled)
        setattr(module, _MARK, swap)
        module.forward = functools.partial(_forward, module, swap)
        module.extra_repr = functools.partial(_extra_repr, module, swap)
        replaced.append(name)
    if skipped and not replaced:
        _warn_none_swapped(model, skipped)
    return replaced, skipped


def _warn_none_swapped(model, skipped):
    reasons = {}
    for name, why in skipped.items():
        reasons.setdefault(why, []).append(name or "(the model)")
    parts = [f"{names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''}: {why}"
             for why, names in reasons.items()]
    warnings.warn(f"cupyffn.torch.replace_mlps swapped none of the {len(skipped)} MLP-like modules of "
                  f"{type(model).__name__}: " + "; ".join(parts), stacklevel=3)


def restore_mlps(model):
    """Give every MLP `replace_mlps` swapped its own forward back; returns their names."""
    restored = []
    for name, module in model.named_modules():
        if getattr(module, _MARK, None) is not None:
            del module.forward, module.extra_repr, module.__dict__[_MARK]
            restored.append(name)
    return restored


def swapped_mlps(model):
    """The names of `model`'s modules that run on cupyffn now: swapped by replace_mlps and not restored (an MLP
    swapped for eval mode only is left out while it is in training)."""
    names = []
    for name, module in model.named_modules():
        swap = getattr(module, _MARK, None)
        if swap is not None and not (swap.eval_only and module.training):
            names.append(name)
    return names
