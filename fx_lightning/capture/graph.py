"""Capture: module (never mutated) -> eval-mode copy -> ``torch.fx.GraphModule``.

``fx`` mode uses symbolic tracing with a leaf policy that keeps every BatchNorm-like module opaque, so the
passes can see it. ``export`` mode uses ``torch.export`` (non-strict) and hands the passes its ATen-level
graph. ``auto`` tries fx first, then export when example inputs are known.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import traceback
import types
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch import nn

from fx_lightning.common.imports import import_object
from fx_lightning.common.batches import PlainOutputs
from fx_lightning.common.calls import Call, FlatCall, as_call, no_distribution_validation, run_seeded, tree_of_call
from fx_lightning.config import TraceConfig, TraceMode
from fx_lightning.errors import ExportError, TraceError, first_line
from fx_lightning.common.notes import Note, NoteKind
from fx_lightning.capture.fx_failure import explain_fx_failure, is_tracer_code, is_users_file, user_frame
from fx_lightning.capture.kept_whole import ArgumentOf, call_torch_functions_by_name, object_argument
from fx_lightning.signature.conditions import conditions_from_guards, one_row_conditions
from fx_lightning.capture.faithful import raise_if_unfaithful
from fx_lightning.capture.branches import SIZE_CACHES_FORGOTTEN, call_sizes, settled_branches
from fx_lightning.capture.working_copy import eval_copy, forget_size_caches, set_eval
from fx_lightning.passes.base import RemainingBatchNorm
from fx_lightning.passes.graph_utils import (is_batchnorm_like, is_known_batchnorm, looks_like_batchnorm,
                                             plain_graph_module)
from fx_lightning.signature.program import ExportFailed, capture_dims, export_program, specialised
from fx_lightning.common.rows import rows_of, with_rows
from fx_lightning.signature.signature import DimKind, Signature
from fx_lightning.signature.value_guards import ValueBranches

__all__ = [
    "Capture",
    "capture",
    "is_batchnorm_like",
    "FXLeafTracer",
    "CAPTURE_FELL_BACK",
    "CAPTURE_PREFERRED_EXPORT",
    "CAPTURED_WITH_EXPORT",
    "STATIC_BATCH_CAPTURE",
    "PLAIN_OUTPUTS",
    "CAPTURED_ROUTE",
    "CAPTURED_KEEPING_WHOLE",
    "KEPT_WHOLE",
    "SIZE_CONDITIONS",
]

CAPTURE_FELL_BACK = NoteKind("capture_fell_back", "symbolic tracing {what}, captured with torch.export instead: "
                                                  "{reason}")
CAPTURE_PREFERRED_EXPORT = NoteKind("capture_preferred_export", "captured with torch.export: symbolic tracing cannot "
                                                                "follow the forward of {modules}, so their BatchNorms "
                                                                "would have stayed")
CAPTURED_WITH_EXPORT = NoteKind("captured_with_export", "captured with torch.export (ATen-level graph)")
STATIC_BATCH_CAPTURE = NoteKind("static_batch_capture", "captured for {what} only: with those sizes dynamic, {reason}")
CAPTURED_ROUTE = NoteKind("captured_route", "torch.export needed its {route} route (data-dependent code)")
CAPTURED_KEEPING_WHOLE = NoteKind("captured_keeping_whole", "neither capture followed the whole model (torch.export: "
                                                            "{export}); symbolic tracing kept whole what it could not "
                                                            "follow")
SIZE_CONDITIONS = NoteKind("size_conditions", "the model branches on its input sizes: torch.export guards the branch "
                           "taken with {conditions} (sizes of the input leaves by position), so every artifact takes "
                           "only sizes that meet them and refuses others by name")
KEPT_WHOLE = NoteKind("kept_whole", "kept whole (run as one call, not traced into, unfused): {kept}")
PLAIN_OUTPUTS = NoteKind("plain_outputs", "captured with the outputs' named tuples as tuples and dataclasses as dicts "
                                          "of their fields (torch.export carries no record class it does not know)")


@dataclass
class Capture:
    graph_module: fx.GraphModule
    mode: str  # "fx" or "export"
    notes: List[Note] = field(default_factory=list)
    # BatchNorm-like modules (running statistics, unknown forward) traced into plain arithmetic: not foldable.
    inlined_batchnorms: List[RemainingBatchNorm] = field(default_factory=list)
    # BatchNorm subclasses symbolic tracing had to keep whole (their forward does not trace): not foldable by fx.
    opaque_batchnorms: List[str] = field(default_factory=list)
    # The input shapes a torch.export capture is fixed to (its sizes could not stay dynamic); None: it takes others.
    static_shapes: Optional[List[List[int]]] = None
    # torch.export's guards on the sizes the capture takes, over the input leaves (signature/conditions.py).
    conditions: List[str] = field(default_factory=list)
    # Branches on tensor values captured the example's way, and how each was settled (signature/value_guards.py).
    value_branches: Optional[ValueBranches] = None


class FXLeafTracer(fx.Tracer):
    """Symbolic tracer whose leaves are the standard torch.nn modules, the BatchNorms the folds understand and
    the configured leaf types; it remembers which module was being traced when tracing failed, and which
    BatchNorm-like modules it traced through."""

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
        self.traced_through: Dict[str, str] = {}  # path -> class of BatchNorm-like modules inlined
        self.opaque_batchnorms: Dict[str, str] = {}  # path -> class of BatchNorms that could not be traced into
        self._traceable: Dict[type, bool] = {}
        self._arguments = 0  # the root's ArgumentOf modules made so far (their names)
        self._leaf_calls = 0  # inside the call of a module kept whole (its node's arguments are being made)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if is_known_batchnorm(m) or isinstance(m, (ArgumentOf, *self.leaf_types)):
            return True
        if is_batchnorm_like(m) or looks_like_batchnorm(m):
            # Traced through, so the F.batch_norm in its forward (if any) becomes visible, when that forward
            # traces at all (one calling torch's BatchNorm.forward does not: it branches on the input's rank).
            if self._traces_alone(m):
                return False
            self.opaque_batchnorms[module_qualified_name] = type(m).__qualname__
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def create_arg(self, a: Any) -> Any:
        """A library's object holding tensors (torch_geometric's ``Batch``) passed to a module kept whole: torch.fx
        makes no node of it, so the graph passes its tensors to an :class:`ArgumentOf` that rebuilds it."""
        try:
            return super().create_arg(a)
        except NotImplementedError:
            tree = object_argument(a) if self._leaf_calls else None  # a leaf's argument, not a parameter's default
            if tree is None:
                raise
            name = f"fx_lightning_argument_{self._arguments}"
            self._arguments += 1
            self.root.add_module(name, ArgumentOf(tree))
            leaves = tuple(super(FXLeafTracer, self).create_arg(leaf) for leaf in tree.leaves(a))
            return self.create_node("call_module", name, leaves, {})

    def _traces_alone(self, m: nn.Module) -> bool:
        cls = type(m)
        if cls not in self._traceable:
            try:
                fx.Tracer(autowrap_modules=(math,)).trace(m)
                self._traceable[cls] = True
            except Exception:  # noqa: BLE001 - any failure means: keep it whole
                self._traceable[cls] = False
        return self._traceable[cls]

    def call_module(self, m: nn.Module, forward: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        try:
            name = self.path_of_module(m)
        except NameError:  # made inside forward (tabnet's nn.ReLU()(x)): not one of the model's, its code inlined
            return forward(*args, **kwargs)
        self._module_stack.append((name, type(m).__qualname__))
        leaf = self.is_leaf_module(m, name)
        if looks_like_batchnorm(m) and not leaf:
            self.traced_through[name] = type(m).__qualname__
        self._leaf_calls += leaf
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = list(self._module_stack)
            raise
        finally:
            self._leaf_calls -= leaf
            self._module_stack.pop()


def capture(
    module: nn.Module,
    trace: TraceConfig,
    example_inputs: Optional[Any] = None,
    *,
    already_copied: bool = False,
    signature: Optional[Signature] = None,
    check: Sequence[Call] = (),
    dynamic_samples: bool = True,
    observed: Sequence[Call] = (),
) -> Capture:
    """Capture ``module`` as a GraphModule. ``module`` itself is never changed.

    ``example_inputs``: forward's arguments (a tuple, or a :class:`~fx_lightning.common.calls.Call`); ``signature``: what
    the observed calls showed (which dimensions vary); ``check``: other calls the captured graph must run as the
    model does (the sizes the signature says vary). ``already_copied``: the caller passes a working copy it owns
    (saves one deep copy). ``dynamic_samples`` (``export.dynamic_batch``): a torch.export capture marks the sample
    axis dynamic. ``observed``: every call observed, on which a branch on tensor values is decided
    (:mod:`~fx_lightning.signature.value_guards`).
    """
    working = module if already_copied else eval_copy(module)
    working.eval()
    call = as_call(tuple(example_inputs)) if example_inputs is not None and not isinstance(example_inputs, Call) \
        else example_inputs
    mode = TraceMode(trace.mode)
    if mode is TraceMode.export:
        return _capture_export(working, dynamic_samples, call, signature, check, observed)
    try:
        result = _capture_fx(working, trace, call=call)
        raise_if_unfaithful(result.graph_module, result.mode, working, call, check)
        if result.opaque_batchnorms and mode is TraceMode.auto and call is not None:
            return _prefer_export(result, working, dynamic_samples, call, signature, check, observed)
        return result
    except TraceError as fx_error:
        if mode is TraceMode.fx:
            raise
        if call is None:
            raise TraceError(
                f"{fx_error}\n  - trace.mode is auto but no example inputs were given, so the torch.export "
                "fallback could not run: pass example_inputs=(tensor, ...) to fuse()."
            ) from fx_error.__cause__
        try:
            result = _capture_export(working, dynamic_samples, call, signature, check, observed)
        except TraceError as export_error:
            result, tried = _capture_fx_keeping_whole(working, trace, call, check, fx_error)
            if result is None:
                export_part = str(export_error)
                if tried.kept:  # wrapping in a leaf module is what was just tried
                    export_part = export_part.replace(_EXPORT_FIXES, "")
                raise TraceError(
                    f"Neither capture mode worked.\n[fx] {_advice_left(fx_error, tried)}\n[export] {export_part}",
                    fix=_NOTHING_TO_SET if tried.kept else None,
                ) from export_error.__cause__
            result.notes.insert(0, CAPTURED_KEEPING_WHOLE(export=first_line(export_error)))
            return result
        if result.value_branches is not None:  # the example's way, guarded or shown alike on the calls observed
            whole, _ = _capture_fx_keeping_whole(working, trace, call, check, fx_error)
            if whole is not None:  # exact whichever way a call takes (an adaptive solver's step count), the rest fused
                whole.notes.insert(0, CAPTURED_KEEPING_WHOLE(export="its capture takes the example's way at "
                                                                    + "; ".join(result.value_branches.sites)))
                return whole
        what = "gave a graph that differs from the model" if "unfaithful" in str(fx_error) else "failed"
        result.notes.insert(0, CAPTURE_FELL_BACK(what=what, reason=first_line(fx_error)))
        return result


def _advice_left(fx_error: TraceError, tried: "KeptWholeTries") -> str:
    """The fx failure's message less the advice just shown not to work: capturing with torch.export, and keeping
    the failing module or function whole where the automatic route kept them whole and tracing still failed."""
    shown = ("  - trace.mode: export",) + (("  - keep that module opaque", "  - move the offending code",
                                           "  - a Python branch on a traced value") if tried.kept else ())
    lines = [line for line in str(fx_error).splitlines() if not line.startswith(shown)]
    if lines and lines[-1] == "  Fixes that apply:":  # none left
        lines.pop()
    if tried.kept:
        lines.append(f"  Kept whole, tracing still failed ({', '.join(tried.kept)}): {tried.last}")
    return "\n".join(lines)


_EXPORT_FIXES = "\n  Fixes: make the failing code shape-generic, or wrap it in a leaf module and use trace.mode: fx."
# Where keeping whole was tried and failed, no setting is known to work: advice that cannot work is not given.
_NOTHING_TO_SET = ("no setting is known to capture it (keeping whole what tracing failed in was tried): the model's "
                   "code must change where it fails (above), or fx-lightning cannot export this model")


def _prefer_export(fx_result: Capture, working: nn.Module, dynamic_samples: bool, call: Call,
                   signature: Optional[Signature], check: Sequence[Call], observed: Sequence[Call] = ()) -> Capture:
    """Symbolic tracing had to keep some BatchNorms whole; torch.export traces their forward, so they fold."""
    try:
        result = _capture_export(working, dynamic_samples, call, signature, check, observed)
    except TraceError:
        return fx_result
    names = ", ".join(fx_result.opaque_batchnorms[:3]) + (" ..." if len(fx_result.opaque_batchnorms) > 3 else "")
    result.notes.insert(0, CAPTURE_PREFERRED_EXPORT(modules=names))
    return result


def _capture_fx(working: nn.Module, trace: TraceConfig, kept_whole: Tuple[Any, ...] = (),
                call: Optional[Call] = None) -> Capture:
    """Symbolic tracing with the configured leaves and wrapped functions, and ``kept_whole`` (module classes and
    functions the automatic route adds). forward's parameters ``call`` leaves out are their defaults (a
    ``labels=None`` branch is traced as the call runs it, not as if labels were given)."""
    leaf_types = tuple(import_object(p) for p in trace.leaf_modules) + tuple(k for k in kept_whole
                                                                              if isinstance(k, type))
    functions = tuple(import_object(p) for p in trace.autowrap_functions) + tuple(k for k in kept_whole
                                                                                  if not isinstance(k, type))
    modules = tuple(__import__(m, fromlist=["_"]) for m in trace.autowrap_modules)
    tracer = FXLeafTracer(leaf_types, functions, modules)
    concrete = {**_left_out_defaults(working, call), **dict(trace.concrete_args)} or None
    try:
        with no_distribution_validation(), _attributes_kept(working):
            graph = tracer.trace(working, concrete_args=concrete)
        call_torch_functions_by_name(graph)
        if isinstance(working, FlatCall):  # its outputs are rebuilt from their recorded tree, dtypes included
            _no_dtypes_out(graph)
        gm = fx.GraphModule(tracer.root, graph, working.__class__.__name__)  # its code generated: it may fail too
    except Exception as exc:  # noqa: BLE001 - any trace failure becomes one explained error
        error = explain_fx_failure(working, tracer, exc)
        error.keep_functions = _failing_functions(exc)  # type: ignore[attr-defined]
        error.keep_module = _failing_module_class(working, tracer)  # type: ignore[attr-defined]
        raise error from exc
    # torch.fx's Tracer.trace leaves the tracer in a reference cycle (its patched __call__/__getattr__
    # closures), and the tracer holds the working copy (root, tensor_attrs): the whole copy would
    # stay alive until the cyclic GC runs, so every fused weight would sit beside its unfused
    # original (2x the model). Drop those references; gm keeps the submodules it calls.
    tracer.root = None  # type: ignore[assignment]
    tracer.tensor_attrs = {}
    set_eval(gm)
    inlined = [RemainingBatchNorm(path, f"{cls} holds BatchNorm statistics but its forward is not a BatchNorm's: "
                                        "traced into plain arithmetic, not folded; declare it under "
                                        "passes.batchnorm_forms.modules")
               for path, cls in tracer.traced_through.items() if not _has_batch_norm_call(gm, path)]
    opaque = [f"{path} ({cls})" for path, cls in tracer.opaque_batchnorms.items()]
    return Capture(gm, "fx", inlined_batchnorms=inlined, opaque_batchnorms=opaque)


@contextlib.contextmanager
def _attributes_kept(root: nn.Module) -> Iterator[None]:
    """The modules' own attributes as they were before tracing: a forward that assigns one
    (torchdiffeq's ODE block: ``self.integration_time = self.integration_time.type_as(x)``) leaves a Proxy there
    while tracing, and the module run after it (the check against the eager model) then fails on that Proxy."""
    before = [(module, dict(vars(module))) for module in root.modules()]
    try:
        yield
    finally:
        for module, attributes in before:
            for key, value in list(vars(module).items()):
                if isinstance(value, fx.Proxy):
                    if key in attributes:
                        object.__setattr__(module, key, attributes[key])
                    else:
                        delattr(module, key)


def _no_dtypes_out(graph: fx.Graph) -> None:
    """A dtype or device among the outputs (a cache's ``dtype = keys.dtype``, read from a Proxy while tracing) as
    None: torch.export refuses them there, and the outputs' description restores them on load."""
    output = next(n for n in graph.nodes if n.op == "output")

    def plain(arg: Any) -> Any:
        return None if isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target is getattr and \
            len(arg.args) == 2 and arg.args[1] in ("dtype", "device") else arg

    output.args = tuple(fx.node.map_aggregate(output.args, plain))  # type: ignore[arg-type]
    graph.lint()  # no dead-code pass: it would drop in-place calls whose results go unused


# Modules and functions the automatic route keeps whole, at most (each retry traces the model again).
MAX_KEPT_WHOLE = 8


def _left_out_defaults(module: nn.Module, call: Optional[Call]) -> Mapping[str, object]:
    """forward's parameters with a default that ``call`` does not give, by name: their defaults (what leaving them
    out means, and the only value the artifact's call gives them), where the default is None or a scalar."""
    if call is None or isinstance(module, FlatCall):
        return {}
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    by_position, by_name = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    return {p.name: p.default for i, p in enumerate(parameters) if p.kind in (by_position, by_name)
            and (p.default is None or type(p.default) in _PINNED) and p.name not in call.kwargs
            and not (p.kind is by_position and i < len(call.args))}


# Defaults torch.fx takes as concrete arguments as they are (a container is flattened, an object is not a value
# its generated code can hold): the others stay arguments, traced as before. Positional-only parameters too.
_PINNED = (bool, int, float, str)


@dataclass
class KeptWholeTries:
    """What :func:`_capture_fx_keeping_whole` kept whole (qualified names) and the last failure, in words."""

    kept: List[str] = field(default_factory=list)
    last: str = ""


def _capture_fx_keeping_whole(working: nn.Module, trace: TraceConfig, call: Call, check: Sequence[Call],
                              error: TraceError) -> Tuple[Optional[Capture], KeptWholeTries]:
    """Symbolic tracing once more, keeping whole what it could not follow: the module class or the module-level
    function its failure was in (its own code runs as one call, unfused: BatchNorms inside a module kept whole are
    counted as left). When torch.export cannot capture the model either (a value read in Python, say), this is the
    graph the passes can still work on. None: nothing more to keep whole, or it still fails (what was tried)."""
    kept: List[Any] = []
    given_up: List[Any] = []
    tries = KeptWholeTries()
    for _ in range(MAX_KEPT_WHOLE):  # tries, not kept entries: a swap below keeps the count the same
        module = getattr(error, "keep_module", None)
        functions = getattr(error, "keep_functions", None) or []
        for function in [f for f in functions if f in kept]:  # kept whole, it still fails there: fx patches a
            kept.remove(function)                            # function only where the traced code names it
            given_up.append(function)                        # (not inside a library): the next one out instead
        fresh = [f for f in functions if f not in given_up]
        more = fresh[0] if fresh else module
        if more is None or more in kept:  # it fails at a module already kept whole (its call's arguments)
            return None, tries
        kept.append(more)
        tries.kept.append(_qualified(more))
        try:
            result = _capture_fx(working, trace, tuple(kept), call)
            raise_if_unfaithful(result.graph_module, result.mode, working, call, check)
        except TraceError as exc:
            error = exc
            tries.last = first_line(exc)
            continue
        result.notes.append(KEPT_WHOLE(kept=", ".join(_qualified(k) for k in kept)))
        return result, tries
    return None, tries


def _qualified(kept: Any) -> str:
    return f"{kept.__module__}.{kept.__qualname__}"


def _failing_functions(exc: BaseException) -> List[types.FunctionType]:
    """The module-level functions symbolic tracing failed in, the first to keep whole first: the innermost user
    frame's, the library function that frame called (``pack_padded_sequence`` called from a forward: tracing fails
    inside torch's own Python code), then the user frames around it that are module-level functions, innermost first
    (torch_geometric's ``global_add_pool`` around the ``scatter`` that reads a tensor's value: fx patches only the
    names the traced code calls, so ``scatter`` kept whole still fails)."""
    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    users = [i for i, frame in enumerate(frames) if is_users_file(frame.f_code.co_filename)]
    if not users:
        return []
    inner = users[-1]
    found: List[types.FunctionType] = []
    for frame in [*frames[inner:inner + 2], *(frames[i] for i in reversed(users[:-1]))]:
        fn = frame.f_globals.get(frame.f_code.co_name)
        if isinstance(fn, types.FunctionType) and fn.__code__ is frame.f_code and not is_tracer_code(frame) \
                and fn not in found:
            found.append(fn)
    return found


def _failing_module_class(root: nn.Module, tracer: FXLeafTracer) -> Optional[type]:
    """The class of the innermost module symbolic tracing failed in (not the root's: kept whole, nothing would be
    fused)."""
    stack = [(p, c) for p, c in (tracer.failed_in or []) if p]
    if not stack:
        return None
    try:
        module = root.get_submodule(stack[-1][0])
    except AttributeError:
        return None
    return type(module) if type(module) is not type(root) else None


def _has_batch_norm_call(gm: fx.GraphModule, path: str) -> bool:
    """Whether the traced-through module at ``path`` left a batch_norm call on its own statistics in the graph
    (a BatchNorm subclass with its own forward: the folds see that call)."""
    return any(n.op == "call_function" and "batch_norm" in str(n.target) and
               any(a.op == "get_attr" and str(a.target).startswith(path + ".") for a in n.all_input_nodes)
               for n in gm.graph.nodes)


def _capture_export(working: nn.Module, dynamic_samples: bool, call: Optional[Call], signature: Optional[Signature],
                    check: Sequence[Call], observed: Sequence[Call] = ()) -> Capture:
    """torch.export (:func:`fx_lightning.signature.program.export_program`: non-strict, then the routes data-dependent code
    needs) with the sample axis and the sizes that vary dynamic, checked against the eager module on the example
    and the ``check`` calls. A model that fixes a size is captured for the example's sizes, with a note naming the
    dimension (parity then compares it at those sizes).

    A batch of one would be specialised: it is captured with the batch repeated to two (when the sample axis is
    not known, dim 0), which keeps the graph batch-generic."""
    if call is None:
        raise TraceError(
            "trace.mode=export needs example inputs: pass example_inputs=(tensor, ...) to fuse() "
            "(the callback takes them from the validation data)."
        )
    leaves = tree_of_call(call).leaves(call)
    dims = capture_dims(signature, leaves, dynamic_samples=dynamic_samples)
    caches = forget_size_caches(working, [call, *check[:1]], run_seeded, call_sizes) if any(dims) else []
    # Dynamic first (a sample repeated to two: torch.export specialises 0 and 1), then the example's own sizes, for a
    # model whose graph is right only at the size it was traced with.
    # A graph fixed to sizes that vary (a graph's node count) would take no other graph: no static capture then.
    varies = signature is not None and any(d.kind is DimKind.variable for leaf in signature.inputs for d in leaf.dims)
    plans = ([(dims, _at_least_two(call, signature) if dynamic_samples else call)] if any(dims) else []) + \
        ([] if varies else [(None, call)])
    target: nn.Module = working
    first: Optional[TraceError] = None
    for plan_dims, plan_call in plans:
        try:
            made, target = _exported(working, target, plan_call, plan_dims, check)
        except TraceError as exc:
            first = first or exc
            continue
        result = Capture(made.program.module(), "export", notes=[CAPTURED_WITH_EXPORT()] + (
            [SIZE_CACHES_FORGOTTEN(caches=", ".join(caches))] if caches else []))
        if target is not working:
            result.notes.append(PLAIN_OUTPUTS())
        if made.route != "non-strict":
            result.notes.append(CAPTURED_ROUTE(route=made.route))
        try:
            if made.values_observed:
                try:
                    result.value_branches = settled_branches(result.graph_module, result.notes, working,
                                                             [plan_call, call, *check, *observed])
                except ExportError as exc:
                    raise TraceError(str(exc) + _EXPORT_FIXES) from exc
            raise_if_unfaithful(result.graph_module, result.mode, working, call, check if made.dynamic else ())
        except TraceError as exc:
            first = first or exc
            continue
        fixed_by_code = made.dynamic and signature is None and specialised(made.program, plan_dims)
        conditions, unreadable = conditions_from_guards(made.program, target, plan_call) if made.dynamic else ([], [])
        if (not made.dynamic or fixed_by_code or unreadable) and any(dims):
            if made.values_observed:  # values and sizes both the example's: keeping whole what branches takes more
                first = first or TraceError(f"torch.export captured {type(working).__qualname__} only at the "
                                            "example's sizes with its branches on values taken its way")
                continue
            reason = "torch.export fixed the batch size the model's code depends on" if fixed_by_code else \
                f"torch.export guards the sizes with {unreadable[0]!r}, which cannot be checked on a call" \
                if unreadable else made.static_reason or (first_line(first) if first is not None else "unknown")
            result.notes.append(STATIC_BATCH_CAPTURE(what=_static_what(signature, leaves), reason=reason))
            result.static_shapes = [list(t.shape) for t in leaves]
        else:
            conditions = one_row_conditions(_unguarded(result.graph_module), working, call, signature, conditions)
            if conditions:
                result.conditions = conditions
                result.notes.append(SIZE_CONDITIONS(conditions="; ".join(conditions)))
        return result
    if first is None:
        raise TraceError(f"torch.export could not capture {type(working).__qualname__} with the sizes that vary "
                         "dynamic, and a capture fixed to the example's sizes would take no other")
    raise first


def _unguarded(graph: nn.Module) -> Any:
    """``graph`` (an unlifted torch.export module) called as the model is, without torch.export's own checks of the
    sizes (its ``_guards_fn``): what the graph computes at a size its guards refuse, for the experiment to judge."""
    try:
        plain = plain_graph_module(graph)
    except TraceError:
        return graph

    def run(*args: Any, **kwargs: Any) -> Any:
        call = Call(args, kwargs)
        return plain(*tree_of_call(call).leaves(call))

    return run


def _exported(working: nn.Module, target: nn.Module, call: Call, dims: Any, check: Sequence[Call]) -> Any:
    """(the program, the module exported): ``target``, or a wrapper making its record outputs plain when torch.export
    cannot carry them. Raises TraceError naming the user's line and every route tried."""
    for attempt in range(2):
        try:
            return export_program(target, call, dims, allow_static=dims is None, check=check, values=True), target
        except ExportFailed as exc:
            cause = exc.first
            if attempt == 0 and "not a known type" in str(exc) and target is working:
                target = PlainOutputs(working)  # a named tuple or dataclass output: the same fields, made plain
                continue
            frame = user_frame(cause)
            raise TraceError(
                f"torch.export could not capture {type(working).__qualname__}: {first_line(cause, with_type=True)}"
                + (f"\n  at {frame}" if frame else "")
                + "".join(f"\n  tried {a}" for a in exc.attempts[1:])
                + _EXPORT_FIXES
            ) from cause
    raise AssertionError("unreachable")


def _at_least_two(call: Call, signature: Optional[Signature]) -> Call:
    """``call`` with a sample axis of one repeated to two (torch.export specialises sizes 0 and 1)."""
    tree = tree_of_call(call)
    leaves = tree.leaves(call)
    axes = signature.input_axes() if signature is not None and signature.batched else \
        [0 if isinstance(t, torch.Tensor) and t.dim() > 0 else None for t in leaves]
    rows = rows_of(leaves, axes)
    if rows is None or rows >= 2:
        return call
    if rows == 0:
        raise TraceError("a tensor argument has batch size 0; give at least one sample")
    if signature is None or not signature.batched:  # dim 0 of every tensor: only when they all agree
        if len({int(t.shape[0]) for t, a in zip(leaves, axes) if a is not None}) != 1:
            return call
    return tree.rebuild(with_rows(leaves, axes, 2))


def _static_what(signature: Optional[Signature], leaves: Sequence[Any]) -> str:
    """The sizes a static capture is fixed to, named."""
    if signature is None:
        first = next((t for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        return f"batch size {int(first.shape[0])}" if first is not None else "the example's sizes"
    fixed = [f"{leaf.name} dim {d} = {dim.size}" for leaf in signature.inputs for d, dim in enumerate(leaf.dims)
             if dim.kind is not DimKind.fixed]
    return ", ".join(fixed) or "the example's sizes"


# ---------------------------------------------------------------------------------- error explanation


