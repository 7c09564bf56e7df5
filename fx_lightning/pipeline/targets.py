"""What the pipeline fuses and where: the target submodule, its inputs inside the whole model, the device, and
the model-level helpers every step shares. None of them changes the model they are given."""

from __future__ import annotations

import ast
import contextlib
import copy
import inspect
import itertools
import textwrap
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from fx_lightning.capture.working_copy import set_eval
from fx_lightning.common.batches import detached
from fx_lightning.common.calls import Call, run_seeded, tree_of
from fx_lightning.parity.compare import compare_outputs
from fx_lightning.errors import ConfigError, ExportError

__all__ = [
    "resolve_target",
    "has_own_forward",
    "deterministic_inside",
    "random_losses_only",
    "inner_calls",
    "whole_model_with",
    "resolve_device",
    "own_rng",
    "load_buffers",
    "refuse_protected",
]


def resolve_target(module: nn.Module, target: Optional[str]) -> Tuple[str, nn.Module]:
    """``(dotted path, submodule)`` to fuse. ``None``: ``backbone`` when the module has one, else the module.

    Raises :class:`ConfigError` naming the target and listing the module's children when it is missing.
    """
    if target is None:
        backbone = getattr(module, "backbone", None) if "backbone" in dir(module) else None
        if isinstance(backbone, nn.Module):
            return "backbone", backbone
        return "", module
    if target == "":
        return "", module
    current: Any = module
    walked: List[str] = []
    for part in target.split("."):
        parent = current
        current = getattr(parent, part, None) if isinstance(parent, nn.Module) else None
        if not isinstance(current, nn.Module):
            where = ".".join(walked) or "<root>"
            children = ", ".join(f"{n} ({type(c).__name__})" for n, c in parent.named_children()) or "none"
            what = "is not a submodule" if current is None else f"is a {type(current).__name__}, not a torch.nn.Module"
            raise ConfigError(
                f"target: {target!r}: {part!r} {what} of {where} ({type(parent).__name__}). "
                f"Children of {where}: {children}."
            )
        walked.append(part)
    return target, current


def has_own_forward(module: nn.Module) -> bool:
    """Whether ``module`` defines a forward (a LightningModule that only trains its submodules, calling their other
    methods, has none: Lightning's forward calls nn.Module's, which raises; nor does a library base class whose
    forward only raises NotImplementedError, read from its source)."""
    forward = type(module).forward
    name = getattr(forward, "__qualname__", "")
    if name in ("Module._forward_unimplemented", "LightningModule.forward"):
        return False
    return not _only_raises_not_implemented(forward)


def _only_raises_not_implemented(function: Any) -> bool:
    """Whether ``function``'s body, past its docstring, is one ``raise NotImplementedError``; False where its
    source cannot be read (then it is taken for a forward: calling it says the rest)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return False
    definition = tree.body[0] if tree.body else None
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    body = [statement for statement in definition.body
            if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    raised = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(raised, ast.Name) and raised.id == "NotImplementedError"


# The share of a target's parameters a module inside it must hold to be the model inside: nearly all, so that the
# target around it trains almost nothing of its own (a diffusion wrapper around its denoiser), and one layer of a
# network that draws noise itself is never taken for it.
INNER_SHARE = 0.9


def deterministic_inside(reference: nn.Module, call: Call) -> Optional[Tuple[str, int, int]]:
    """Where every output of ``reference`` is drawn at random (a diffusion model's training loss, around its
    denoiser): the module it calls once on ``call`` that holds nearly all its parameters (:data:`INNER_SHARE`) and
    whose outputs, run again on what it received with another seed, are the same. ``(path inside reference, its
    parameters, reference's)``, the outermost such module; None: there is none (a module called twice, as with
    self-conditioning, is not one: which call is the model's is not observable)."""
    total = sum(p.numel() for p in reference.parameters())
    if not total:
        return None
    held = {name: sum(p.numel() for p in m.parameters()) for name, m in reference.named_modules() if name}
    for name in sorted((n for n, count in held.items() if count >= INNER_SHARE * total),
                       key=lambda n: (-held[n], n.count("."))):
        module = reference.get_submodule(name)
        received = inner_calls(reference, module, [call])
        try:
            same = received is not None and compare_outputs(run_seeded(module, received[0], 1),
                                                            run_seeded(module, received[0], 0)).passed
        except Exception:  # noqa: BLE001 - not a module that runs alone on what it received
            continue
        if same:
            return name, held[name], total
    return None


def random_losses_only(module: nn.Module, call: Call) -> bool:
    """Whether ``module`` returns only losses (0-d float tensors) on ``call``, each changing with the seed and only
    with it (a diffusion model's training loss on a timestep and noise it draws): nothing deterministic an artifact
    could be checked on, and nothing a user serves. Outputs that change with the same seed come from state the calls
    leave, which the signature refuses; a sampled prediction (MC dropout) is not a loss, and stays refused."""
    try:
        first = run_seeded(module, call, 0)
        leaves = [tree_of(first).leaves(first)]
        if not leaves[0] or not all(t.dim() == 0 and t.is_floating_point() for t in leaves[0]):
            return False  # one run decides it for every model that returns more than losses
        for seed in (0, 1):
            out = run_seeded(module, call, seed)
            leaves.append(tree_of(out).leaves(out))
    except Exception:  # noqa: BLE001 - the pipeline's own steps report the model's failures
        return False
    if len({len(ls) for ls in leaves}) != 1:
        return False
    return all(compare_outputs(b, a).passed for a, b in zip(leaves[0], leaves[1])) and \
        not any(compare_outputs(c, a).passed for a, c in zip(leaves[0], leaves[2]))


def inner_calls(outer: nn.Module, inner: nn.Module, calls: Sequence[Call]) -> Optional[List[Call]]:
    """What ``inner`` received on each of ``outer``'s ``calls`` (run as parity runs them: seed 0); None unless it
    was called once on each."""
    received: List[List[Call]] = []

    def record(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        received[-1].append(Call(detached(args), detached(kwargs)))

    handle = inner.register_forward_pre_hook(record, with_kwargs=True)
    try:
        for call in calls:
            received.append([])
            run_seeded(outer, call, 0)
    except Exception:  # noqa: BLE001 - then there is no inner target to take
        return None
    finally:
        handle.remove()
    return [r[0] for r in received] if all(len(r) == 1 for r in received) else None


def whole_model_with(model: nn.Module, path: str, replacement: nn.Module) -> nn.Module:
    """A copy of ``model`` whose submodule at ``path`` is ``replacement``; ``model`` is not changed.

    Parameters and buffers are shared with ``model`` rather than copied (neither side is ever trained),
    so this costs module objects, not weights.
    """
    if not path:
        return replacement
    original = model.get_submodule(path)
    memo: Dict[int, Any] = {id(original): replacement}
    for t in itertools.chain(model.parameters(), model.buffers()):
        memo[id(t)] = t
    whole = copy.deepcopy(model, memo)
    set_eval(whole)  # not .eval(): a torch.export-captured replacement refuses it
    return whole


def resolve_device(setting: str, auto: Optional[torch.device]) -> Optional[torch.device]:
    """``device`` from the config as a torch.device (``auto``: ``auto``, e.g. where training ran; None: where
    the model is). Raises :class:`ConfigError` when that device is not available in this process."""
    if setting == "auto":
        return auto
    device = torch.device(setting)
    available = True
    if device.type == "cuda":
        available = torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    elif device.type == "mps":
        available = torch.backends.mps.is_available()
    if not available:
        raise ConfigError(
            f"device: {setting!r} is not available in this process (cuda available: {torch.cuda.is_available()}, "
            f"{torch.cuda.device_count()} device(s)); use auto (where training ran) or cpu."
        )
    return device


@contextlib.contextmanager
def own_rng(module: nn.Module, device: Optional[torch.device] = None) -> Iterator[None]:
    """Run a block without touching the caller's RNG streams (CPU, and the CUDA devices in use): parity
    runs forward passes, and shuffled loaders may draw."""
    cuda = {t.device.index or 0 for t in module.parameters() if t.is_cuda}
    if device is not None and device.type == "cuda":
        cuda.add(device.index or 0)
    with torch.random.fork_rng(devices=sorted(cuda)):
        yield


def load_buffers(module: nn.Module, buffers: Mapping[str, torch.Tensor]) -> None:
    """Copy ``buffers`` (name -> tensor, as ``named_buffers()``) into ``module``'s buffers of the same shape."""
    own = dict(module.named_buffers())
    for name, value in buffers.items():
        mine = own.get(name)
        if mine is not None and mine.shape == value.shape:
            mine.copy_(value.to(device=mine.device, dtype=mine.dtype))


def refuse_protected(directory: Path, protected: Sequence[Union[str, Path]]) -> None:
    """An export replaces its directory atomically: it must never be (or contain) a checkpoint."""
    target = directory.resolve()
    for item in protected:
        p = Path(item).resolve()
        if p == target or target in p.parents:
            raise ExportError(
                f"export.dir: {str(directory)!r} is or contains {str(item)!r}; exporting there could replace a "
                "checkpoint. Choose another export.dir."
            )
