"""Capture: module (never mutated) -> eval-mode copy -> ``torch.fx.GraphModule``.

``fx`` mode uses symbolic tracing with a leaf policy that keeps every BatchNorm-like module opaque, so the
passes can see it. ``export`` mode uses ``torch.export`` (non-strict) and hands the passes its ATen-level
graph. ``auto`` tries fx first, then export when example inputs are known.
"""

from __future__ import annotations

import copy
import os
import traceback
import types
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch import nn

from fx_lightning._imports import import_object
from fx_lightning.config import TraceConfig, TraceMode
from fx_lightning.errors import TraceError, first_line
from fx_lightning.passes.graph_utils import is_batchnorm_like

__all__ = [
    "Capture",
    "capture",
    "eval_copy",
    "set_eval",
    "strip_compiled",
    "plain_state_dict",
    "is_batchnorm_like",
    "FXLeafTracer",
]

_TORCH_DIR = os.path.dirname(torch.__file__)
_PKG_DIR = os.path.dirname(__file__)


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


def plain_state_dict(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """A state dict without the ``_orig_mod.`` segments that ``torch.compile``d submodules add to its keys
    (Lightning #17415, #20233), so it loads into the uncompiled module."""
    return {k.replace("._orig_mod.", ".").removeprefix("_orig_mod."): v for k, v in state_dict.items()}


def eval_copy(module: nn.Module, device: Optional[torch.device] = None) -> nn.Module:
    """A deep copy in eval mode with gradients off and ``torch.compile`` wrappers removed, moved to ``device``
    when given; the input keeps its weights, buffers and flags."""
    working = strip_compiled(copy.deepcopy(module))
    if device is not None:
        working.to(device)
    working.eval()
    working.requires_grad_(False)
    return working


@dataclass
class Capture:
    graph_module: fx.GraphModule
    mode: str  # "fx" or "export"
    notes: List[str] = field(default_factory=list)


class FXLeafTracer(fx.Tracer):
    """Symbolic tracer whose leaves are the standard torch.nn modules, BatchNorm-like modules and
    the configured leaf types; it remembers which module was being traced when tracing failed."""

    def __init__(
        self,
        leaf_types: Tuple[type, ...] = (),
        autowrap_functions: Tuple[Any, ...] = (),
        autowrap_modules: Tuple[types.ModuleType, ...] = (),
    ) -> None:
        super().__init__(autowrap_modules=autowrap_modules, autowrap_functions=autowrap_functions)
        self.leaf_types = leaf_types
        self._module_stack: List[Tuple[str, str]] = []
        self.failed_in: Optional[List[Tuple[str, str]]] = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if is_batchnorm_like(m) or (self.leaf_types and isinstance(m, self.leaf_types)):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        try:
            name = self.path_of_module(m)
        except NameError:
            name = "<unregistered>"
        self._module_stack.append((name, type(m).__qualname__))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = list(self._module_stack)
            raise
        finally:
            self._module_stack.pop()


def capture(
    module: nn.Module,
    trace: TraceConfig,
    example_inputs: Optional[Sequence[Any]] = None,
    *,
    already_copied: bool = False,
) -> Capture:
    """Capture ``module`` as a GraphModule. ``module`` itself is never changed.

    ``already_copied``: the caller passes a working copy it owns (saves one deep copy).
    """
    working = module if already_copied else eval_copy(module)
    working.eval()
    mode = TraceMode(trace.mode)
    if mode is TraceMode.export:
        return _capture_export(working, trace, example_inputs)
    try:
        return _capture_fx(working, trace)
    except TraceError as fx_error:
        if mode is TraceMode.fx:
            raise
        if example_inputs is None:
            raise TraceError(
                f"{fx_error}\n  - trace.mode is auto but no example inputs were given, so the torch.export "
                "fallback could not run: pass example_inputs=(tensor, ...) to fuse()."
            ) from fx_error.__cause__
        try:
            result = _capture_export(working, trace, example_inputs)
        except TraceError as export_error:
            raise TraceError(
                f"Neither capture mode worked.\n[fx] {fx_error}\n[export] {export_error}"
            ) from export_error.__cause__
        result.notes.insert(0, f"symbolic tracing failed, captured with torch.export instead: {first_line(fx_error)}")
        return result


def _capture_fx(working: nn.Module, trace: TraceConfig) -> Capture:
    leaf_types = tuple(import_object(p) for p in trace.leaf_modules)
    functions = tuple(import_object(p) for p in trace.autowrap_functions)
    modules = tuple(__import__(m, fromlist=["_"]) for m in trace.autowrap_modules)
    tracer = FXLeafTracer(leaf_types, functions, modules)
    concrete = dict(trace.concrete_args) or None
    try:
        graph = tracer.trace(working, concrete_args=concrete)
    except Exception as exc:  # noqa: BLE001 - any trace failure becomes one explained error
        raise _explain_fx_failure(working, tracer, exc) from exc
    name = working.__class__.__name__
    gm = fx.GraphModule(tracer.root, graph, name)
    # torch.fx's Tracer.trace leaves the tracer in a reference cycle (its patched __call__/__getattr__
    # closures), and the tracer holds the working copy (root, tensor_attrs): the whole copy would
    # stay alive until the cyclic GC runs, so every fused weight would sit beside its unfused
    # original (2x the model). Drop those references; gm keeps the submodules it calls.
    tracer.root = None  # type: ignore[assignment]
    tracer.tensor_attrs = {}
    set_eval(gm)
    return Capture(gm, "fx")


def _capture_export(working: nn.Module, trace: TraceConfig, example_inputs: Optional[Sequence[Any]]) -> Capture:
    if example_inputs is None:
        raise TraceError(
            "trace.mode=export needs example inputs: pass example_inputs=(tensor, ...) to fuse() "
            "(the callback takes them from the validation data)."
        )
    args = tuple(example_inputs)
    dynamic_shapes = None
    if trace.dynamic_batch:
        batch = torch.export.Dim.AUTO
        dynamic_shapes = tuple({0: batch} if isinstance(a, torch.Tensor) and a.dim() > 0 else None for a in args)
    try:
        program = torch.export.export(working, args, strict=False, dynamic_shapes=dynamic_shapes)
    except Exception as exc:  # noqa: BLE001
        frame = _user_frame(exc)
        raise TraceError(
            f"torch.export could not capture {type(working).__qualname__}: {first_line(exc, with_type=True)}"
            + (f"\n  at {frame}" if frame else "")
            + "\n  Fixes: make the failing code shape-generic, or wrap it in a leaf module and use trace.mode: fx."
        ) from exc
    gm = program.module()
    return Capture(gm, "export", notes=["captured with torch.export (ATen-level graph)"])


# ---------------------------------------------------------------------------------- error explanation


def _explain_fx_failure(root: nn.Module, tracer: FXLeafTracer, exc: BaseException) -> TraceError:
    stack = tracer.failed_in or []
    if stack:
        path, cls = stack[-1]
        where = f"module '{path}' ({cls})"
    else:
        path, cls = "", type(root).__qualname__
        where = f"the root module ({cls})"
    frame = _user_frame(exc)
    message = first_line(exc, with_type=True)
    lines = [f"torch.fx could not trace {where}: {message}"]
    if frame:
        lines.append(f"  at {frame}")
    lines.append("  Fixes that apply:")
    data_dependent = "control flow" in message or "iterate" in message or "bool" in message.lower()
    mod_path = f"{type(root).__module__}.{cls}" if not stack else _class_path(root, path)
    lines.append(f"  - keep the module opaque: trace.leaf_modules: ['{mod_path}'] (it stays unfused inside)")
    lines.append(
        "  - move the offending code into a free function and list it in trace.autowrap_functions "
        "(['pkg.module:function'])"
    )
    if data_dependent:
        lines.append(
            "  - data-dependent control flow (a branch on tensor values) cannot be captured by any tracer; "
            "for a branch on a flag, pin it with trace.concrete_args"
        )
    lines.append(
        "  - trace.mode: export (or auto, the default, with example inputs) captures shape-dependent code "
        "such as torch.zeros(x.shape[0], ...)"
    )
    return TraceError("\n".join(lines))


def _class_path(root: nn.Module, path: str) -> str:
    try:
        mod = root.get_submodule(path)
    except AttributeError:
        return path
    return f"{type(mod).__module__}.{type(mod).__qualname__}"


def _user_frame(exc: BaseException) -> Optional[str]:
    """The innermost traceback frame outside torch and this package: the user's source line."""
    found = None
    for fs in traceback.extract_tb(exc.__traceback__):
        fname = os.path.abspath(fs.filename)
        if fname.startswith(_TORCH_DIR) or fname.startswith(_PKG_DIR) or "<" in fs.filename:
            continue
        found = fs
    if found is None:
        return None
    code = (found.line or "").strip()
    return f"{found.filename}:{found.lineno} in {found.name}: {code}"
