"""``reparameterize``: apply a model's own deploy-form conversion to the working copy before capture.

Re-parameterisable blocks (RepVGG, MobileOne, FastViT, RepGhost, LeViT's ConvNorm/LinearNorm...) train with
several branches and serve as one conv. They follow timm's protocol, which any module can implement:

- ``fuse()`` returns a new module that replaces this one;
- ``reparameterize()`` converts this module in place;
- ``switch_to_deploy()`` converts this module in place;

tried in that order (as ``timm.utils.reparameterize_model`` does), parents before their children. Only
methods that take no arguments are called (a VAE's ``reparameterize(mu, logvar)`` is not a conversion).
With example inputs every converted module is checked on the input it received, against its own output
before the conversion, and put back when it differs beyond ``rtol``. The input module is never changed:
this runs on the working copy.
"""

from __future__ import annotations

import copy
import inspect
from typing import Dict, Optional, Tuple

from torch import nn

from fx_lightning.passes.base import PassContext, PassResult, Stage, builtin_pass
from fx_lightning.passes.module_check import ModuleCheckOptions, output_change, record_module_inputs

__all__ = ["reparameterize", "DEPLOY_METHODS"]

# The conversion protocol, in order of precedence (timm's).
DEPLOY_METHODS: Tuple[str, ...] = ("fuse", "reparameterize", "switch_to_deploy")


def _deploy_method(module: nn.Module) -> Optional[str]:
    """The first protocol method of ``module`` that can be called without arguments."""
    for name in DEPLOY_METHODS:
        method = getattr(type(module), name, None)
        if not callable(method):
            continue
        try:
            params = list(inspect.signature(getattr(module, name)).parameters.values())
        except (TypeError, ValueError):
            continue
        if all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            return name
    return None


def _convert(module: nn.Module, method: str) -> nn.Module:
    """Run the protocol method; the module that now stands in ``module``'s place: the one ``fuse()`` returned, or
    ``module`` itself, converted in place (``reparameterize()``, ``switch_to_deploy()``, and the ``fuse()`` of
    libraries that change the module and return None)."""
    result = getattr(module, method)()
    if method == "fuse" and result is not None:
        if not isinstance(result, nn.Module):
            raise TypeError(f"fuse() returned a {type(result).__name__}, neither a module nor None")
        return result.eval()
    return module.eval()


def _visit(parent: nn.Module, prefix: str, inputs: Dict[int, Tuple[tuple, dict]], options: ModuleCheckOptions,
           result: PassResult) -> None:
    for name, child in list(parent.named_children()):
        path = f"{prefix}{name}"
        method = _deploy_method(child)
        walk = child
        if method is not None:
            walk = _convert_checked(parent, name, path, child, method, inputs.get(id(child)), options, result)
        if walk is not None:
            _visit(walk, f"{path}.", inputs, options, result)


def _convert_checked(parent: nn.Module, name: str, path: str, child: nn.Module, method: str,
                     recorded: Optional[Tuple[tuple, dict]], options: ModuleCheckOptions,
                     result: PassResult) -> Optional[nn.Module]:
    """Convert ``child`` in ``parent``, or put it back; returns the module whose children are walked next
    (None for a ``fuse()`` replacement, which is already in deploy form)."""
    kind = type(child).__qualname__
    # A deep copy whatever the method: some libraries' fuse() changes the module in place (and returns None).
    backup = copy.deepcopy(child)
    try:
        new, change = output_change(child, lambda: _convert(child, method), recorded, options.rtol)
    except Exception as exc:  # noqa: BLE001 - a model's own conversion code; put the module back
        setattr(parent, name, backup)
        result.skip(path, f"{kind}.{method}() raised {type(exc).__name__}: {exc}", module=kind)
        return backup
    if change is not None and not change.passed:
        setattr(parent, name, backup)
        result.skip(path, f"{kind}.{method}() changed the module's outputs ({change.describe()}; passes."
                          f"reparameterize.rtol {options.rtol:g}): left as trained", module=kind)
        return backup
    setattr(parent, name, new)
    checked = ({"checked": "no example inputs: not checked here (parity checks the whole model)"} if change is None
               else {"relative_change": change.relative_error})
    result.change(path, "reparameterized", module=kind, method=method, **checked)
    return None if new is not child else new


@builtin_pass("reparameterize", options=ModuleCheckOptions, stage=Stage.module)
def reparameterize(module: nn.Module, options: ModuleCheckOptions, ctx: PassContext) -> PassResult:
    """Convert re-parameterisable blocks to their deploy form (fuse / reparameterize / switch_to_deploy)."""
    result = PassResult()
    if _deploy_method(module) is not None:
        result.skip("<root>", f"the fused module itself ({type(module).__qualname__}) has a deploy method; "
                              "only its submodules are converted (call it yourself before fusing)")
    inputs = record_module_inputs(module, lambda m: _deploy_method(m) is not None, ctx.example_inputs)
    _visit(module, "", inputs, options, result)
    return result
