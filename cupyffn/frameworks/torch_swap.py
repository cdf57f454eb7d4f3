"""Putting cupyffn into an existing model without changing it: ``replace_mlps`` gives each MLP it reproduces exactly a
forward of cupyffn's, and ``restore_mlps`` takes it back.

The module itself stays: the same class, submodules, Parameter objects and state_dict keys (``c_fc.weight`` stays
``c_fc.weight``), tied or shared weights intact, an optimizer built before the swap still trains what runs, and
``load_state_dict`` / ``save_pretrained`` see the model they know. Only the module's ``forward`` attribute is set
(a ``functools.partial`` of `_forward`, which pickles and deep-copies with the module), as Liger-Kernel patches a
module's forward. transformers' Conv1D weights (``[in, out]``) are used as stored: cupyffn reads their transposes
as views (cupyffn/frameworks/torch_ops.py `weights`).
"""

import functools
from typing import NamedTuple

import torch

from .torch_layer import block, linear_weights
from .torch_ops import check_save, precision_name

_TANH_GELUS = ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh")
_MARK = "_cupyffn_mlp"  # the attribute a swapped module carries (its Swap)


class Swap(NamedTuple):
    """How a swapped MLP runs: its two linear layers by attribute path, and the layer's options."""

    linear1: tuple     # attribute path from the MLP to its first Linear / Conv1D
    linear2: tuple
    precision: str     # None: the device's default (float32 computation)
    save: str


def _tanh_gelu(act):
    """None when module `act` is GELU with the tanh approximation, as cupyffn computes it; else why not."""
    if isinstance(act, torch.nn.GELU):
        return None if act.approximate == "tanh" else f"GELU(approximate={act.approximate!r}) (erf GELU)"
    name = type(act).__name__
    if name in _TANH_GELUS:
        return None
    if name == "GELU" and getattr(act, "approximate", None) == "tanh":  # diffusers' GELU (with .proj)
        return None
    return f"activation {name} (cupyffn computes GELU(tanh) only)"


def _no_dropout(*modules):
    for m in modules:
        if m is None or isinstance(m, torch.nn.Identity):
            continue
        if isinstance(m, torch.nn.Dropout):
            if m.p > 0:
                return f"dropout p={m.p} (cupyffn has no dropout; set it to 0 to swap this MLP)"
            continue
        return f"unexpected module {type(m).__name__} in the MLP"
    return None


def _layers(module):
    """((path of linear1, path of linear2), None) for an MLP cupyffn reproduces, (None, reason) for an MLP-like
    module it would compute otherwise, (None, None) for anything else."""
    name = type(module).__name__
    if isinstance(module, torch.nn.Sequential) and len(module) == 3 and all(
            isinstance(module[i], torch.nn.Linear) for i in (0, 2)):
        why = _tanh_gelu(module[1])
        return (None, why) if why else ((("0",), ("2",)), None)
    if name == "FeedForward" and hasattr(module, "net"):  # diffusers: net = [GELU(proj), Dropout, Linear(, Dropout)]
        net = list(module.net)
        if len(net) < 3 or not hasattr(net[0], "proj") or not isinstance(net[2], torch.nn.Linear):
            return None, "a FeedForward whose net is not [GELU(proj), Dropout, Linear]"
        why = _tanh_gelu(net[0]) or _no_dropout(net[1], *net[3:])
        return (None, why) if why else ((("net", "0", "proj"), ("net", "2")), None)
    if name in ("GPT2MLP", "GPTBigCodeMLP") and hasattr(module, "c_fc") and hasattr(module, "c_proj"):
        why = _tanh_gelu(module.act) or _no_dropout(getattr(module, "dropout", None))
        return (None, why) if why else ((("c_fc",), ("c_proj",)), None)
    return None, None


def _walk(module, path):
    for name in path:
        module = getattr(module, name)
    return module


def _forward(module, swap, hidden_states, *args, **kwargs):
    """A swapped MLP's forward: linear2(gelu_tanh(linear1(hidden_states))) on cupyffn (extra arguments, which
    diffusers' FeedForward accepts and ignores, are ignored)."""
    w1, b1, t1 = linear_weights(_walk(module, swap.linear1))
    w2, b2, _ = linear_weights(_walk(module, swap.linear2))
    if t1:  # Conv1D: [in, out] as stored, read through the transposed views
        w1, w2 = w1.t(), w2.t()
    return block(hidden_states, w1, w2, b1, b2, swap.precision, swap.save)


def replace_mlps(model, precision=None, save="all"):
    """Run every MLP of `model` that cupyffn reproduces exactly on cupyffn, in place, keeping the model (module
    docstring).

    Recognized: ``nn.Sequential(Linear, GELU(approximate="tanh"), Linear)``, diffusers' ``FeedForward`` with
    activation "gelu-approximate", transformers' ``GPT2MLP`` (``gelu_new``) and ``GPTBigCodeMLP``
    (``gelu_pytorch_tanh``). `precision` and `save` as in ``GeluFFN``. Swapping a swapped MLP again updates its
    options; ``restore_mlps`` undoes it.

    Returns ``(replaced, skipped)``: the names of the modules now running on cupyffn, and {name: reason} for
    MLP-like modules left alone because cupyffn would compute something else (erf GELU, other activations,
    dropout with p > 0).
    """
    precision, save = precision_name(precision), check_save(save)
    replaced, skipped = [], {}
    for name, module in model.named_modules():
        if any(name.startswith(r + ".") for r in replaced):
            continue
        layers, why = _layers(module)
        if why:
            skipped[name] = why
        if layers is None:
            continue
        for path in layers:
            linear_weights(_walk(module, path))  # a layer of another type: refused before anything is set
        swap = Swap(layers[0], layers[1], precision, save)
        setattr(module, _MARK, swap)
        module.forward = functools.partial(_forward, module, swap)
        replaced.append(name)
    return replaced, skipped


def restore_mlps(model):
    """Give every MLP `replace_mlps` swapped its own forward back; returns their names."""
    restored = []
    for name, module in model.named_modules():
        if getattr(module, _MARK, None) is not None:
            del module.forward, module.__dict__[_MARK]
            restored.append(name)
    return restored


def swapped_mlps(model):
    """The names of `model`'s modules that run on cupyffn now (swapped by replace_mlps, not restored)."""
    return [name for name, module in model.named_modules() if getattr(module, _MARK, None) is not None]
