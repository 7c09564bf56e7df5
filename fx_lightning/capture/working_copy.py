"""The working copy a capture owns: the module deep-copied, in eval mode, gradients off, without ``torch.compile``'s
wrappers (tracing, hooks and parity must see the eager modules). The user's module is never changed."""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

import torch
from torch import nn

__all__ = ["eval_copy", "set_eval", "strip_compiled", "is_compiled_module", "plain_state_dict", "forget_size_caches"]


def set_eval(module: nn.Module) -> None:
    """``module.eval()``; torch.export's unlifted modules refuse ``eval()``, so set the flags directly
    (their graphs are already specialised to eval)."""
    try:
        module.eval()
    except NotImplementedError:
        for m in module.modules():
            m.training = False


def _is_compiled(module: nn.Module) -> bool:
    return type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module)


def is_compiled_module(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``d (a wrapper, or a LightningModule passed to fit() compiled)."""
    return _is_compiled(module) or getattr(module, "_compiler_ctx", None) is not None


# Methods Lightning replaces with dynamo-compiled versions on the instance of a LightningModule passed to
# fit() compiled (lightning.pytorch.utilities.compile.from_compiled, which records them in _compiler_ctx).
_LIGHTNING_COMPILED_METHODS = ("forward", "training_step", "validation_step", "test_step", "predict_step")


def strip_compiled(module: nn.Module) -> nn.Module:
    """``module`` with every ``torch.compile`` wrapper (``OptimizedModule``) replaced by the module it wraps and
    Lightning's compiled instance methods dropped, in place (callers pass copies): tracing, hooks and parity
    must see the eager modules, not dynamo's (whose hooks do not run, and whose wrapped ``forward`` of a copied
    LightningModule would still call the original)."""
    while _is_compiled(module):
        module = module._orig_mod
    for parent in list(module.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None and _is_compiled(child):
                while _is_compiled(child):
                    child = child._orig_mod
                parent._modules[name] = child
    for m in module.modules():
        if getattr(m, "_compiler_ctx", None) is not None:
            for method in _LIGHTNING_COMPILED_METHODS:
                m.__dict__.pop(method, None)
            m._compiler_ctx = None
    return module


def plain_state_dict(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A state dict without the ``_orig_mod.`` segments that ``torch.compile``d submodules add to its keys
    (Lightning #17415, #20233), so it loads into the uncompiled module."""
    return {k.replace("._orig_mod.", ".").removeprefix("_orig_mod."): v for k, v in state_dict.items()}


def eval_copy(module: nn.Module, device: Optional[torch.device] = None) -> nn.Module:
    """A deep copy in eval mode with gradients off and ``torch.compile`` wrappers removed, moved to ``device``
    when given; the input keeps its weights, buffers and flags."""
    memo = _detached_memo(module)
    working = strip_compiled(copy.deepcopy(module, memo))
    memo.clear()  # it holds every object of the copy: the copy must be freed by reference counting alone
    if device is not None:
        working.to(device)
    working.eval()
    working.requires_grad_(False)
    return working


def _detached_memo(module: nn.Module) -> Dict[int, Any]:
    """A deepcopy memo mapping each tensor with autograd history that a module keeps as an attribute (Lightning's GAN
    tutorial keeps ``self.generated_imgs = self(z)``) or as a buffer (snntorch's neurons keep their membrane
    potential, computed in the last training step) to a detached copy: deepcopy refuses such tensors."""
    memo: Dict[int, Any] = {}
    for m in module.modules():
        for name, value in vars(m).items():
            if name not in ("_parameters", "_modules"):
                _detach_into(memo, value, 0)
    return memo


def _detach_into(memo: Dict[int, Any], value: Any, depth: int) -> None:
    if isinstance(value, torch.Tensor):
        if value.grad_fn is not None and id(value) not in memo:
            memo[id(value)] = value.detach().clone()
    elif depth < 4 and isinstance(value, (list, tuple, dict)):
        for item in value.values() if isinstance(value, dict) else value:
            _detach_into(memo, item, depth + 1)


def forget_size_caches(working: nn.Module, calls: Sequence[Any], run: Callable[[nn.Module, Any], Any],
                       sizes_of: Callable[[Any], Set[int]]) -> List[str]:
    """Python ints the working copy's modules keep from the sizes of their last call (a rotary embedding's
    ``_seq_len_cached``, compared with the next call's length to reuse its tables), found by experiment: after a run
    on each of two ``calls`` of different sizes, each such attribute held a size of the call just run, and another
    one each time. Capture would compare a size it keeps dynamic with the cached one and fix it; each is set to -1,
    a size no call has, so capture takes the path a call of a new size takes. Returns their paths (module.attribute).
    """
    if len(calls) < 2:
        return []
    seen: List[Dict[str, int]] = []
    for call in calls[:2]:
        run(working, call)
        seen.append({f"{path}.{name}" if path else name: value for path, module in working.named_modules()
                     for name, value in vars(module).items() if type(value) is int})
    first, second = (sizes_of(c) for c in calls[:2])
    caches = [key for key, value in seen[1].items() if key in seen[0] and seen[0][key] != value
              and seen[0][key] in first and value in second]
    for key in caches:
        path, _, name = key.rpartition(".")
        setattr(working.get_submodule(path), name, -1)
    return caches
