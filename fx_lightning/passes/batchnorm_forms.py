"""``batchnorm_forms``: make third-party BatchNorm forms visible to the folds, before capture.

Some libraries wrap BatchNorm in their own module: timm's ``BatchNormAct2d`` is a ``BatchNorm2d`` subclass
whose forward is the BatchNorm, then ``self.drop``, then ``self.act``; ``FrozenBatchNormAct2d`` and Hugging
Face's ``*FrozenBatchNorm2d`` hold the statistics as buffers and compute ``x * scale + shift``. A
:class:`BatchNormForm` declares such a class as "BatchNorm, then these submodules" (an *epilogue*); this pass
replaces every instance in the working copy by ``Sequential(bn=<plain BatchNorm on the same tensors>,
<epilogue...>)``, which every fold understands, and the epilogue (an activation, an eval-mode dropout)
stays in the graph. With example inputs every replacement is run on the input the module received, beside
the module itself, and refused when its output differs: a wrong declaration cannot give wrong numbers.

Declare your own with :func:`register_batchnorm_form` or in config::

    passes:
      batchnorm_forms:
        modules: [{module: "my_pkg.layers:BNReLU", epilogue: [act]}]
"""

from __future__ import annotations

import fnmatch
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fx_lightning.common.imports import import_checked, import_object
from fx_lightning.passes.base import PassContext, PassResult, Stage, builtin_pass
from fx_lightning.passes.graph_utils import owner_of
from fx_lightning.passes.module_check import ModuleCheckOptions, output_change, record_module_inputs

__all__ = [
    "BatchNormForm",
    "BatchNormFormConfig",
    "BatchNormFormsOptions",
    "PlainBatchNorm",
    "register_batchnorm_form",
    "batchnorm_forms",
    "declared_form",
]


@dataclass(frozen=True)
class BatchNormForm:
    """A class that computes "BatchNorm, then ``epilogue``" in eval mode.

    ``match``: the class's qualified name (``module.Class``; ``fnmatch`` wildcards allowed), matched against
    the instance's class and its bases that share its forward. ``epilogue``: names of submodules applied, in
    order, to the normalised output. ``eps``: for classes that hard-code epsilon instead of holding ``eps``.
    The class is a BatchNorm (its statistics and affine parameters are its own) or "frozen" (buffers
    ``weight``, ``bias``, ``running_mean``, ``running_var``).
    """

    match: str
    epilogue: Tuple[str, ...] = ()
    eps: Optional[float] = None


# Declared by qualified name: nothing here imports timm or transformers.
_FORMS: List[BatchNormForm] = [
    BatchNormForm("timm.layers.norm_act.BatchNormAct2d", ("drop", "act")),
    BatchNormForm("timm.layers.norm_act.SyncBatchNormAct", ("drop", "act")),
    BatchNormForm("timm.layers.norm_act.FrozenBatchNormAct2d", ("drop", "act")),
    # DETR, RT-DETR, Grounding DINO...: frozen BatchNorms with epsilon 1e-5 written into their forward.
    BatchNormForm("transformers.models.*FrozenBatchNorm2d", (), eps=1e-5),
]


def register_batchnorm_form(cls_or_name: Any, epilogue: Iterable[str] = (), eps: Optional[float] = None) -> None:
    """Declare a module class as "BatchNorm, then ``epilogue``" so the folds see it (see :class:`BatchNormForm`).

    Example::

        register_batchnorm_form(MyBNReLU, epilogue=["act"])      # forward: act(batch_norm(x))
    """
    name = cls_or_name if isinstance(cls_or_name, str) else _qualified(cls_or_name)
    _FORMS.insert(0, BatchNormForm(name, tuple(epilogue), eps))


@dataclass
class BatchNormFormConfig:
    """A declaration in config: ``module`` is an import path ``pkg.module:Class`` (or a qualified name)."""

    module: str = "???"
    epilogue: List[str] = field(default_factory=list)
    eps: Optional[float] = None


@dataclass
class BatchNormFormsOptions(ModuleCheckOptions):
    # Your own declarations, tried before the built-in ones (timm's BatchNormAct2d family, Hugging Face's
    # frozen BatchNorms).
    modules: List[BatchNormFormConfig] = field(default_factory=list)

    def check(self) -> None:
        super().check()
        for i, item in enumerate(self.modules):
            if ":" in item.module:
                cls = import_checked(item.module, f"modules[{i}].module")
                if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                    raise ValueError(f"modules[{i}].module: {item.module!r} is not a torch.nn.Module class.")
            elif "." not in item.module:
                raise ValueError(f"modules[{i}].module: {item.module!r} is neither an import path "
                                 "('pkg.module:Class') nor a qualified class name ('pkg.module.Class').")
            if item.eps is not None and not (math.isfinite(item.eps) and item.eps > 0):
                raise ValueError(f"modules[{i}].eps: must be a positive number or null, got {item.eps}.")


class PlainBatchNorm(_BatchNorm):
    """torch's BatchNorm forward for any input rank: what a declared form becomes before the folds."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        return None


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def declared_form(module: nn.Module, forms: Iterable[BatchNormForm]) -> Optional[BatchNormForm]:
    """The form declared for ``module``'s class (or a base whose forward it keeps), if any."""
    cls = type(module)
    bases = [b for b in cls.__mro__ if getattr(b, "forward", None) is cls.forward]
    for form in forms:
        if any(fnmatch.fnmatchcase(_qualified(base), form.match) for base in bases):
            return form
    return None


def _config_forms(options: BatchNormFormsOptions) -> List[BatchNormForm]:
    out = []
    for item in options.modules:
        cls = import_object(item.module) if ":" in item.module else None
        name = _qualified(cls) if isinstance(cls, type) else item.module
        out.append(BatchNormForm(name, tuple(item.epilogue), item.eps))
    return out


def _core(module: nn.Module, form: BatchNormForm) -> PlainBatchNorm:
    """A PlainBatchNorm on ``module``'s own tensors (shared, not copied)."""
    mean, var = getattr(module, "running_mean", None), getattr(module, "running_var", None)
    if not isinstance(mean, torch.Tensor) or not isinstance(var, torch.Tensor):
        raise ValueError("it has no running_mean/running_var tensors")
    eps = form.eps if form.eps is not None else getattr(module, "eps", None)
    if eps is None:
        raise ValueError("it has no eps attribute and the declaration gives none")
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    affine = weight is not None and bias is not None
    core = PlainBatchNorm(mean.numel(), eps=float(eps), momentum=getattr(module, "momentum", 0.1), affine=affine,
                          track_running_stats=True, device="meta")
    if affine:
        core.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        core.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)
    core.running_mean, core.running_var = mean, var
    tracked = getattr(module, "num_batches_tracked", None)
    core.num_batches_tracked = tracked if isinstance(tracked, torch.Tensor) else torch.zeros((), dtype=torch.long)
    return core.eval()


def _replacement(module: nn.Module, form: BatchNormForm) -> nn.Module:
    if isinstance(module, _BatchNorm) and not module.track_running_stats:
        raise ValueError("it tracks no running statistics (it normalises with batch statistics)")
    if module._forward_hooks or module._forward_pre_hooks:
        raise ValueError("it has forward hooks")
    parts: List[Tuple[str, nn.Module]] = [("bn", _core(module, form))]
    for name in form.epilogue:
        sub = getattr(module, name, None)
        if not isinstance(sub, nn.Module):
            raise ValueError(f"the declared epilogue {name!r} is not a submodule of it")
        parts.append((name, sub))
    return nn.Sequential(OrderedDict(parts)).eval()


@builtin_pass("batchnorm_forms", options=BatchNormFormsOptions, stage=Stage.module)
def batchnorm_forms(module: nn.Module, options: BatchNormFormsOptions, ctx: PassContext) -> PassResult:
    """Replace declared BatchNorm forms (BatchNorm + epilogue, frozen BatchNorms) by a plain BatchNorm + epilogue."""
    result = PassResult()
    forms = _config_forms(options) + list(_FORMS)
    inputs = record_module_inputs(module, lambda m: declared_form(m, forms) is not None, ctx.example_inputs)
    for path, sub in list(module.named_modules()):
        form = declared_form(sub, forms) if path else None
        if form is None:
            continue
        parent, name = owner_of(module, path)
        kind = type(sub).__qualname__
        try:
            replacement, change = output_change(sub, lambda: _replacement(sub, form), inputs.get(id(sub)), options.rtol)
        except ValueError as exc:
            result.skip(path, f"{kind} is declared as a BatchNorm form ({form.match}) but {exc}")
            continue
        if change is not None and not change.passed:
            result.skip(path, f"{kind}'s declaration as a BatchNorm form ({form.match}, epilogue "
                              f"{list(form.epilogue)}) does not match its forward: {change.describe()}; left as it is")
            continue
        setattr(parent, name, replacement)
        result.change(path, "BatchNorm form made plain", module=kind, epilogue=list(form.epilogue))
    return result
