"""What a pass is, the registry, and the runner that applies a configured sequence of passes.

A pass is a function ``(gm, options, ctx) -> PassResult | None`` over a GraphModule (stage ``graph``), or
``(module, options, ctx)`` over the working copy of the module before it is captured (stage ``module``: a
model's own deploy-form conversion, say), registered under a name with its options dataclass and whether
it preserves computation (like optimum's transformations).
A *built-in* pass is declared once, with :func:`builtin_pass`: its options dataclass becomes its key in
``FuseConfig.passes``; its place in the default order is its place in :data:`DEFAULT_ORDER`, the one list of
that order (the config schema and the planner both read it).
The runner lints and recompiles after every pass and turns any failure into a :class:`PassError`.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple, Type, TypeVar

import torch
import torch.fx as fx

from fx_lightning.common.imports import import_object
from fx_lightning.errors import PassError, raised_in_pass

__all__ = [
    "Stage",
    "PassOptions",
    "PassContext",
    "PassResult",
    "Change",
    "Skip",
    "RemainingBatchNorm",
    "PassSpec",
    "USER_PASSES",
    "DEFAULT_ORDER",
    "register_pass",
    "builtin_pass",
    "builtin_passes",
    "get_pass",
    "resolve_pass",
    "registered_passes",
    "plan_passes",
    "run_pass",
    "run_passes",
]

# Where the user's passes (``passes.extra``) run among the built-ins.
USER_PASSES = "extra"

# The default order of the built-in passes, declared once. Why each is where it is:
DEFAULT_ORDER: Tuple[str, ...] = (
    "reparameterize",  # module stage, first: a deploy form removes whole branches (and their BatchNorms)
    "batchnorm_forms",  # module stage: third-party BatchNorm forms made plain (after the deploy forms)
    "remove_dropout",  # conv -> Dropout -> BN chains become adjacent for the folds
    "remove_identity",  # conv -> Identity -> BN likewise
    "fuse_conv_bn",
    "fuse_linear_bn",
    "fuse_bn_into_next",  # after the producer folds: a BatchNorm that could fold backwards already has
    USER_PASSES,
    "eliminate_dead_code",  # after the user's passes: whatever they left unused goes too
)  # the lossy variants (int8, bf16) are not passes: they are made from the verified result (fx_lightning.variants)


class Stage(str, Enum):
    """What a pass works on: the working copy of the module before capture, or the captured graph."""

    module = "module"
    graph = "graph"


@dataclass
class PassOptions:
    """Options every built-in pass has; a pass's own options dataclass subclasses this."""

    enabled: bool = True

    def check(self) -> None:
        """Value checks the types cannot express: raise ``ValueError("<key>: <what is wrong and allowed>")``
        (the key relative to the pass's options); the config loader names the full key."""


class _ShapeRecorder(fx.Interpreter):
    """torch.fx's ShapeProp, recording metadata only where it can: ShapeProp rebuilds every container a node
    returns with metadata in place of its tensors, which a named tuple that checks its fields refuses (a
    ``PackedSequence`` from a function the capture kept whole: AttributeError, the pass stopped)."""

    def propagate(self, *args: Any) -> Any:
        return self.run(*args)

    def run_node(self, n: fx.Node) -> Any:
        from torch.fx.node import map_aggregate
        from torch.fx.passes.shape_prop import _extract_tensor_metadata

        result = super().run_node(n)
        found = False

        def extract(obj: Any) -> Any:
            nonlocal found
            if isinstance(obj, torch.Tensor):
                found = True
                return _extract_tensor_metadata(obj)
            return obj

        try:
            meta = map_aggregate(result, extract)
        except Exception:  # noqa: BLE001 - a container that cannot hold metadata: its node has none
            found = False
        if found:
            n.meta["tensor_meta"] = meta
        n.meta["type"] = type(result)
        return result


@dataclass
class PassContext:
    """What passes may know besides the graph.

    Shapes cost a forward pass, so they are computed only when a pass asks (``ensure_shapes``) and
    only once: most CNNs never need them. Export captures carry shapes already.
    """

    capture_mode: str = "fx"
    example_inputs: Optional[tuple] = None
    shapes_known: bool = False

    def ensure_shapes(self, gm: fx.GraphModule) -> bool:
        """Annotate ``gm``'s nodes with shapes (ShapeProp on the example inputs); False if impossible."""
        if self.shapes_known:
            return True
        if self.example_inputs is None:
            return False

        with torch.no_grad():
            _ShapeRecorder(gm).propagate(*self.example_inputs)
        self.shapes_known = True
        return True


# The facts passes commonly give, typed; any other fact (``op=``, ``epilogue=``, ``relative_change=``...) is kept
# by name in ``details``. ``to_dict()`` writes them back flat, in this order, because manifests on disk have
# always held each record as one flat JSON object.
_TYPED_FACTS: Tuple[str, ...] = ("into", "kind", "module")


class _DictReadable:
    """``record["reason"]``: the records used to be plain dicts and user code reads them that way; it keeps
    working, with a DeprecationWarning that points at the attribute to read instead."""

    def to_dict(self) -> Dict[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def __getitem__(self, key: str) -> object:
        named = key in {f.name for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        read = f".{key}" if named else f".details[{key!r}]"
        warnings.warn(f"{type(self).__name__} is a dataclass: read {read} (or to_dict()[{key!r}]) instead of "
                      f"[{key!r}]", DeprecationWarning, stacklevel=2)
        return self.to_dict()[key]


_R = TypeVar("_R", bound="_PassRecord")


class _PassRecord(_DictReadable):
    """What :class:`Change` and :class:`Skip` share: the node, a text field named by ``_HEAD[1]``, the common facts
    typed, any other fact in ``details``."""

    _HEAD: ClassVar[Tuple[str, str]]

    def __post_init__(self) -> None:
        # A detail may not repeat a field that is set: ``to_dict()`` would have to pick one of the two.
        clash = sorted((set(self._HEAD) | set(self._typed())) & set(self.details))  # type: ignore[attr-defined]
        if clash:
            raise ValueError(f"{type(self).__name__}: details repeat the field(s) {', '.join(clash)}")

    def _typed(self) -> Dict[str, object]:
        return {k: getattr(self, k) for k in _TYPED_FACTS if getattr(self, k) is not None}

    @classmethod
    def of(cls: Type[_R], node: str, text: str, **facts: object) -> _R:
        """From ``PassResult.change``'s or ``.skip``'s arguments: a common fact typed only when it is a string (a
        user pass that gives, say, ``kind=3`` or ``into=None`` keeps exactly what it gave), the others in
        ``details``."""
        typed = {k: v for k, v in facts.items() if k in _TYPED_FACTS and isinstance(v, str)}
        return cls(node, text, **typed, details={k: v for k, v in facts.items() if k not in typed})  # type: ignore

    def to_dict(self) -> Dict[str, object]:
        """``{"node", "what"/"reason", **facts}``: the JSON shape manifests keep (facts that are None left out)."""
        return {**{k: getattr(self, k) for k in self._HEAD}, **self._typed(), **self.details}  # type: ignore


@dataclass(frozen=True)
class Change(_PassRecord):
    """One edit a pass made: the node (or module path, ``<graph>``...) it made it at and what it did."""

    _HEAD = ("node", "what")
    node: str
    what: str
    into: Optional[str] = None  # what a BatchNorm was folded into (``describe()`` of the node(s))
    kind: Optional[str] = None  # the kind of layer it went into: "conv", "conv_transpose", "linear"
    module: Optional[str] = None  # the module (class name or path) the edit concerns
    # Any other fact, by name. Left out of the hash (a dict has none), so records still go into sets.
    details: Mapping[str, object] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Skip(_PassRecord):
    """A candidate a pass left alone, and why."""

    _HEAD = ("node", "reason")
    node: str
    reason: str
    into: Optional[str] = None  # what it would have been folded into
    kind: Optional[str] = None
    module: Optional[str] = None  # the module (class name or path) left alone
    details: Mapping[str, object] = field(default_factory=dict, hash=False)  # as Change's


@dataclass(frozen=True)
class RemainingBatchNorm(_DictReadable):
    """A BatchNorm still in the fused graph (or traced into arithmetic by the capture), and why it is there."""

    node: str
    reason: str


@dataclass
class PassResult:
    """What a pass did: ``changed`` entries and ``skipped`` candidates with a reason each."""

    changed: List[Change] = field(default_factory=list)
    skipped: List[Skip] = field(default_factory=list)

    def change(self, node: str, what: str, **detail: object) -> None:
        """Record an edit: ``result.change("bn1", "folded", into="conv1 (Conv2d 'conv1')", kind="conv")``."""
        self.changed.append(Change.of(node, what, **detail))

    def skip(self, node: str, reason: str, **detail: object) -> None:
        """Record a candidate left alone: ``result.skip("bn2", "in training mode")``."""
        self.skipped.append(Skip.of(node, reason, **detail))

    def remove_identity(self, gm: fx.GraphModule, node: fx.Node, no_input: str, **detail: object) -> None:
        """Erase ``node`` (the identity in eval mode), its users taking its first argument instead, and record it;
        skipped for the reason ``no_input`` when that argument is not a graph value."""
        if not node.args or not isinstance(node.args[0], fx.Node):
            self.skip(node.name, no_input)
            return
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
        self.change(node.name, "removed", **detail)


PassFn = Callable[..., Optional[PassResult]]


def _options_dict(options: Any) -> Dict[str, object]:
    """A pass's options as keyword arguments: a dataclass's fields, or the mapping given (None: none)."""
    return dataclasses.asdict(options) if dataclasses.is_dataclass(options) else dict(options or {})


def _is_fx_pass(obj: object) -> bool:
    """A torch.fx ``PassBase``: a subclass (made with the pass's options as keyword arguments) or an instance."""
    from torch.fx.passes.infra.pass_base import PassBase

    return isinstance(obj, PassBase) or (isinstance(obj, type) and issubclass(obj, PassBase))


def _fx_pass_fn(fx_pass: Any) -> PassFn:
    """A torch.fx ``PassBase`` as a pass of ours: called on the GraphModule, the ``(graph_module, modified)`` it
    returns taken in place (a new GraphModule's graph and attributes moved onto the one being fused)."""
    name = fx_pass.__name__ if isinstance(fx_pass, type) else type(fx_pass).__name__

    def run(gm: fx.GraphModule, options: Any, ctx: PassContext) -> PassResult:
        given = _options_dict(options)
        if not isinstance(fx_pass, type) and given:
            raise PassError(f"{name} is registered as an instance: it takes no options (got {sorted(given)}); "
                            "register the class to have them passed to its constructor")
        instance = fx_pass(**given) if isinstance(fx_pass, type) else fx_pass
        out = instance(gm)
        result = PassResult()
        if out is None:
            return result
        if out.graph_module is not gm:
            _adopt(gm, out.graph_module)
        if out.modified:
            result.change("<graph>", f"modified by the torch.fx pass {name}")
        return result

    run.__wrapped__ = fx_pass  # type: ignore[attr-defined]  # the same PassBase registered again is the same pass
    return run


def _adopt(gm: fx.GraphModule, new: fx.GraphModule) -> None:
    """Make ``gm`` what ``new`` is: exactly its submodules, parameters and buffers (as such, so ``.to()``,
    ``.double()`` and ``state_dict()`` see them) and the other attributes its graph reads, then its graph. Nothing
    of ``gm``'s own is kept: a later pass that prunes what the graph does not use must not reach, through an old
    name, a module the new graph shares."""
    old_reads = {str(n.target).split(".")[0] for n in gm.graph.nodes if n.op == "get_attr"}
    for attr in old_reads:
        gm.__dict__.pop(attr, None)  # plain tensors the old graph read
    gm._modules.clear()
    gm._parameters.clear()
    gm._buffers.clear()
    for child_name, child in new.named_children():
        gm.add_module(child_name, child)
    for param_name, param in new._parameters.items():
        gm.register_parameter(param_name, param)
    for buffer_name, buffer in new._buffers.items():
        gm.register_buffer(buffer_name, buffer, persistent=buffer_name not in new._non_persistent_buffers_set)
    for node in new.graph.nodes:
        top = str(node.target).split(".")[0]
        if node.op == "get_attr" and not hasattr(gm, top):
            setattr(gm, top, getattr(new, top))
    gm.graph = new.graph


@dataclass(frozen=True)
class PassSpec:
    """One pass, declared once: everything else (config key, default order, report) is derived from it."""

    name: str
    fn: PassFn
    options_type: Optional[type] = None
    preserves_computation: bool = True
    # The pass records every graph edit in its PassResult: an empty result means an unchanged graph,
    # and the runner skips the recompile (it is the costliest step of a no-op pass on a large graph).
    reports_changes: bool = False
    builtin: bool = False  # declared with builtin_pass: configured under passes.<name>, ordered by DEFAULT_ORDER
    stage: Stage = Stage.graph

    def build_options(self, options: Any) -> Any:
        if self.options_type is None:
            return dict(options or {})
        if isinstance(options, self.options_type):
            return options
        return self.options_type(**_options_dict(options))


_REGISTRY: Dict[str, PassSpec] = {}


def _register(spec: PassSpec, replace: bool) -> None:
    existing = _REGISTRY.get(spec.name)
    same = existing is not None and getattr(existing.fn, "__wrapped__", existing.fn) is getattr(spec.fn, "__wrapped__",
                                                                                                 spec.fn)
    # A built-in's name first: replace=True, the other refusal's advice, cannot replace a built-in.
    if existing is not None and existing.builtin and not spec.builtin:
        raise ValueError(f"{spec.name!r} is a built-in pass; configure it under passes.{spec.name} instead")
    if existing is not None and not replace and not same:
        raise ValueError(f"a pass named {spec.name!r} is already registered; pass replace=True to override it")
    _REGISTRY[spec.name] = spec


def _user_spec(name: str, obj: Any, options: Optional[type] = None, preserves_computation: bool = True) -> PassSpec:
    """A user's pass: a function, or a torch.fx ``PassBase`` (its result taken in place); recompiled after it runs,
    whatever it reports."""
    return PassSpec(name, _fx_pass_fn(obj) if _is_fx_pass(obj) else obj, options, preserves_computation)


def register_pass(
    name: str,
    *,
    options: Optional[type] = None,
    preserves_computation: bool = True,
    replace: bool = False,
) -> Callable[[PassFn], PassFn]:
    """Register ``fn(gm, options, ctx) -> PassResult | None`` under ``name``; or a torch.fx ``PassBase``
    (subclass, made with the pass's options as keyword arguments, or instance), whose
    ``PassResult(graph_module, modified)`` is taken in place.

    Example::

        @register_pass("swap_relu_for_gelu", preserves_computation=False)
        def swap(gm, options, ctx):
            ...

    Then ``FuseConfig(passes={"extra": ["swap_relu_for_gelu"]})`` runs it after the built-ins.
    """

    def decorator(fn: PassFn) -> PassFn:
        _register(_user_spec(name, fn, options, preserves_computation), replace)
        return fn

    return decorator


def builtin_pass(name: str, *, options: type, stage: Stage = Stage.graph) -> Callable[[PassFn], PassFn]:
    """Declare a built-in pass (it preserves computation and reports its changes): ``options`` (a
    :class:`PassOptions` dataclass) becomes ``passes.<name>`` in the config schema and ``stage`` says what it works
    on; its place in the default order is in :data:`DEFAULT_ORDER`, which must list it."""
    if not (isinstance(options, type) and issubclass(options, PassOptions)):
        raise TypeError(f"built-in pass {name!r}: options must subclass PassOptions")
    if name not in DEFAULT_ORDER:
        raise ValueError(f"built-in pass {name!r} is not in DEFAULT_ORDER; add it there, at its place in the order")

    def decorator(fn: PassFn) -> PassFn:
        _register(PassSpec(name, fn, options, reports_changes=True, builtin=True, stage=stage), replace=False)
        return fn

    return decorator


def builtin_passes() -> List[PassSpec]:
    """The built-in passes in their default order."""
    return [_REGISTRY[name] for name in DEFAULT_ORDER if name in _REGISTRY and _REGISTRY[name].builtin]


def get_pass(name: str) -> PassSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        # The graph passes only: a module pass (reparameterize...) is refused where a name is looked up (passes.extra).
        graph = sorted(n for n, spec in _REGISTRY.items() if spec.stage is Stage.graph)
        raise KeyError(
            f"unknown pass {name!r}; registered passes: {', '.join(graph)} "
            "(or give an import path 'pkg.module:function')"
        ) from None


def resolve_pass(name: str) -> PassSpec:
    """A registered name, or an import path ``pkg.module:function`` (registered on first use)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" not in name:
        get_pass(name)  # raises with the list of names
    obj = import_object(name)
    if name in _REGISTRY:  # importing the module may have registered it
        return _REGISTRY[name]
    if isinstance(obj, PassSpec):
        return obj
    if not callable(obj):  # a torch.fx PassBase, class or instance, is callable
        raise ValueError(f"{name!r} is not callable")
    return _user_spec(name, obj)


def registered_passes() -> List[str]:
    return sorted(_REGISTRY)


def plan_passes(passes: Any) -> List[Tuple[PassSpec, Any]]:
    """The (pass, options) sequence a ``PassesConfig`` asks for: the enabled built-ins and the enabled user
    passes (``extra``), in :data:`DEFAULT_ORDER`."""
    plan: List[Tuple[PassSpec, Any]] = []
    for name in DEFAULT_ORDER:
        if name == USER_PASSES:
            plan.extend((resolve_pass(extra.name), extra.options) for extra in passes.extra if extra.enabled)
            continue
        options = getattr(passes, name)
        if options.enabled:
            plan.append((_REGISTRY[name], options))
    return plan


def run_pass(spec: PassSpec, gm: Any, options: Any, ctx: PassContext) -> PassResult:
    """Apply one pass; after a graph pass, lint and recompile. Any failure becomes a PassError naming the pass."""
    try:
        built = spec.build_options(options)
    except TypeError as exc:
        raise PassError(f"pass {spec.name!r}: bad options {options!r}: {exc}") from exc
    with raised_in_pass(f"pass {spec.name!r}"):
        result = spec.fn(gm, built, ctx)
    if result is None:
        result = PassResult()
    if not isinstance(result, PassResult):
        raise PassError(f"pass {spec.name!r} returned {type(result).__name__}; expected PassResult or None")
    if spec.stage is not Stage.graph:
        return result
    try:
        gm.graph.lint()
        if result.changed or not spec.reports_changes:
            gm.recompile()
    except Exception as exc:
        raise PassError(f"pass {spec.name!r} left a graph that does not lint: {exc}") from exc
    return result


def run_passes(
    target: Any, plan: Sequence[Tuple[PassSpec, Any]], ctx: PassContext, stage: Stage = Stage.graph
) -> List[Tuple[PassSpec, PassResult, float]]:
    """Apply the passes of ``plan`` at ``stage`` to ``target`` (the working module, or the GraphModule) in
    place; returns (pass, result, seconds) per pass."""
    out = []
    for spec, options in plan:
        if spec.stage is not stage:
            continue
        start = time.perf_counter()
        result = run_pass(spec, target, options, ctx)
        out.append((spec, result, time.perf_counter() - start))
    return out
