"""What a pass is, the registry, and the runner that applies a configured sequence of passes.

A pass is a function ``(gm, options, ctx) -> PassResult | None`` over a GraphModule, registered under a
name with its options dataclass and whether it preserves computation (like optimum's transformations). The
runner lints and recompiles after every pass and turns any failure into a :class:`PassError` naming it.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch.fx as fx

from fx_lightning.errors import PassError

__all__ = [
    "PassContext",
    "PassResult",
    "PassSpec",
    "register_pass",
    "get_pass",
    "resolve_pass",
    "registered_passes",
    "run_pass",
]


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
        import torch
        from torch.fx.passes.shape_prop import ShapeProp

        with torch.no_grad():
            ShapeProp(gm).propagate(*self.example_inputs)
        self.shapes_known = True
        return True


@dataclass
class PassResult:
    """What a pass did: ``changed`` entries and ``skipped`` candidates with a reason each."""

    changed: List[Dict[str, Any]] = field(default_factory=list)
    skipped: List[Dict[str, Any]] = field(default_factory=list)

    def change(self, node: str, what: str, **detail: Any) -> None:
        self.changed.append({"node": node, "what": what, **detail})

    def skip(self, node: str, reason: str, **detail: Any) -> None:
        self.skipped.append({"node": node, "reason": reason, **detail})


PassFn = Callable[..., Optional[PassResult]]


@dataclass(frozen=True)
class PassSpec:
    name: str
    fn: PassFn
    options_type: Optional[type] = None
    preserves_computation: bool = True
    description: str = ""
    # The pass records every graph edit in its PassResult: an empty result means an unchanged graph,
    # and the runner skips the recompile (it is the costliest step of a no-op pass on a large graph).
    reports_changes: bool = False

    def build_options(self, options: Any) -> Any:
        if self.options_type is None:
            return dict(options or {})
        if isinstance(options, self.options_type):
            return options
        if dataclasses.is_dataclass(options):
            options = dataclasses.asdict(options)
        return self.options_type(**dict(options or {}))


_REGISTRY: Dict[str, PassSpec] = {}


def register_pass(
    name: str,
    *,
    options: Optional[type] = None,
    preserves_computation: bool = True,
    replace: bool = False,
    reports_changes: bool = False,
) -> Callable[[PassFn], PassFn]:
    """Register ``fn(gm, options, ctx) -> PassResult | None`` under ``name``.

    Example::

        @register_pass("swap_relu_for_gelu", preserves_computation=False)
        def swap(gm, options, ctx):
            ...

    Then ``FuseConfig(passes={"extra": ["swap_relu_for_gelu"]})`` runs it after the built-ins.
    """

    def decorator(fn: PassFn) -> PassFn:
        if name in _REGISTRY and not replace and _REGISTRY[name].fn is not fn:
            raise ValueError(f"a pass named {name!r} is already registered; pass replace=True to override it")
        _REGISTRY[name] = PassSpec(
            name=name,
            fn=fn,
            options_type=options,
            preserves_computation=preserves_computation,
            description=(inspect.getdoc(fn) or "").split("\n")[0],
            reports_changes=reports_changes,
        )
        return fn

    return decorator


def get_pass(name: str) -> PassSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown pass {name!r}; registered passes: {', '.join(sorted(_REGISTRY))} "
            "(or give an import path 'pkg.module:function')"
        ) from None


def resolve_pass(name: str) -> PassSpec:
    """A registered name, or an import path ``pkg.module:function`` (registered on first use)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" not in name:
        get_pass(name)  # raises with the list of names
    from fx_lightning.config import import_object

    obj = import_object(name)
    if name in _REGISTRY:  # importing the module may have registered it
        return _REGISTRY[name]
    if isinstance(obj, PassSpec):
        return obj
    if not callable(obj):
        raise ValueError(f"{name!r} is not callable")
    return PassSpec(name=name, fn=obj, description=(inspect.getdoc(obj) or "").split("\n")[0])


def registered_passes() -> List[str]:
    return sorted(_REGISTRY)


def run_pass(spec: PassSpec, gm: fx.GraphModule, options: Any, ctx: PassContext) -> PassResult:
    """Apply one pass, then lint and recompile. Any failure becomes a PassError naming the pass."""
    try:
        built = spec.build_options(options)
    except TypeError as exc:
        raise PassError(f"pass {spec.name!r}: bad options {options!r}: {exc}") from exc
    try:
        result = spec.fn(gm, built, ctx)
    except PassError:
        raise
    except Exception as exc:
        raise PassError(f"pass {spec.name!r} raised {type(exc).__name__}: {exc}") from exc
    if result is None:
        result = PassResult()
    if not isinstance(result, PassResult):
        raise PassError(f"pass {spec.name!r} returned {type(result).__name__}; expected PassResult or None")
    try:
        gm.graph.lint()
        if result.changed or not spec.reports_changes:
            gm.recompile()
    except Exception as exc:
        raise PassError(f"pass {spec.name!r} left a graph that does not lint: {exc}") from exc
    return result

