"""Is a capture faithful? The captured graph is run against the eager module on the same inputs (eval mode, no
grad, a fixed RNG); where it raises or gives other numbers, the error says where it first goes wrong and what to
change. Used by :mod:`fx_lightning.capture.graph` on every graph it returns."""

from __future__ import annotations

import functools
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch import nn

from fx_lightning.common.batches import describe_call, flat_tensors
from fx_lightning.common.calls import Call, run_seeded
from fx_lightning.errors import TraceError, first_line
from fx_lightning.parity.compare import compare_outputs


def raise_if_unfaithful(graph_module: fx.GraphModule, mode: str, working: nn.Module, call: Optional[Call],
                        check: Sequence[Call] = ()) -> None:
    """Run the graph captured by ``mode`` ("fx" or "export") against the eager module on the example (and on the
    ``check`` calls, other sizes it must take); raise a TraceError saying where it goes wrong when it raises or
    gives other numbers."""
    if call is None:
        return
    for index, inputs in enumerate([call, *check]):
        expected = run_seeded(working, inputs)
        try:
            got = run_seeded(graph_module, inputs)
        except Exception as exc:  # noqa: BLE001 - a graph that raises is the clearest sign of a wrong trace
            problem = f"the captured graph raises {first_line(exc, with_type=True)}"
        else:
            problem = difference_from_model(got, expected)
        if problem is None:
            continue
        where, module = _first_divergence(graph_module, working, inputs) if mode == "fx" else (None, None)
        which = "on the example inputs" if index == 0 else \
            f"on observed call {index + 1} ({describe_call(inputs)})"
        raise TraceError(
            f"the {mode} capture of {type(working).__qualname__} is unfaithful: {which} {problem}"
            + (f"\n  first difference at {where}" if where else "")
            + (_fx_fixes(working, module) if mode == "fx" else _EXPORT_UNFAITHFUL_FIXES)
        )


_EXPORT_UNFAITHFUL_FIXES = (
    "\n  torch.export specialised the graph to something the example inputs do not meet. Fixes:"
    "\n  - trace.mode: fx, with the module that differs kept opaque: trace.leaf_modules: ['<its class as "
    "package.module:Class>']"
    "\n  - export.dynamic_batch: false, when the model fixes its batch size"
)


def _fx_fixes(working: nn.Module, module: Optional[str]) -> str:
    """The fixes of an unfaithful symbolic trace: the export route, and keeping opaque the module where the outputs
    first differ, named by its importable class path where it has one."""
    keep = "\n  - keep the module that differs opaque: trace.leaf_modules: ['<its class as package.module:Class>']"
    cls = _submodule_class(working, module)
    if cls is not None and "<locals>" not in cls.__qualname__:  # a class made in a function has no import path
        keep = (f"\n  - keep '{module}' opaque (the outputs first differ in its code): "
                f"trace.leaf_modules: ['{cls.__module__}:{cls.__qualname__}']")
    return ("\n  Python code that depends on shapes or types can be recorded wrongly by symbolic tracing. Fixes:"
            "\n  - trace.mode: export (or auto, the default, which falls back to it)" + keep)


def difference_from_model(got: Any, expected: Any) -> Optional[str]:
    """How the captured graph's outputs differ from the model's (None: within float rounding, the same kernels
    having run; structure included: count, nesting, shapes, dtypes)."""
    comparison = compare_outputs(got, expected)
    return None if comparison.passed else comparison.describe().replace("the reference", "the model")


def _submodule_class(working: nn.Module, module: Optional[str]) -> Optional[type]:
    try:
        return type(working.get_submodule(module)) if module else None
    except AttributeError:  # a scope name that is not a submodule's path: no class to name
        return None


def _first_divergence(gm: fx.GraphModule, working: nn.Module,
                      inputs: Call) -> Tuple[Optional[str], Optional[str]]:
    """Where the graph first goes wrong: the first module whose output differs from the eager module's, and the
    module whose code was recorded wrongly there (:func:`_recorded_around`); or the first node that raises (no
    module); (None, None) when neither is found. A module traced through is compared at its scope's last node (the
    one its forward returned, where that is one value)."""
    outputs = _module_outputs(gm)
    targets = {m for ends in outputs.values() for m in ends}
    eager: Dict[str, List[torch.Tensor]] = {}
    calls: Dict[str, int] = {}
    def record(name: str, _m: nn.Module, _args: Any, out: Any) -> None:  # returns None: the output stays the module's
        calls[name] = calls.get(name, 0) + 1
        eager.setdefault(name, [t.detach().clone() for t in flat_tensors(out)])  # in-place ops come later

    handles = [sub.register_forward_hook(functools.partial(record, name)) for name, sub in working.named_modules()
               if name in targets]
    try:
        run_seeded(working, inputs)
    finally:
        for h in handles:
            h.remove()
    for name in [n for n, count in calls.items() if count > 1]:  # called at several sites: which output is which?
        del eager[name]
    found: List[Tuple[str, Optional[str]]] = []

    class Watch(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            try:
                out = super().run_node(n)
            except Exception as exc:
                found.append((f"node {n.name} ({n.op} {n.target}): it raises {first_line(exc, with_type=True)}",
                              None))
                raise
            module = next((m for m in outputs.get(n.name, ()) if m in eager), None)
            if module is not None and not found and len(flat_tensors(out)) == len(eager[module]):
                problem = difference_from_model(flat_tensors(out), eager[module])
                if problem is not None:
                    found.append((f"module '{module}' ({n.name}): {problem.replace('the captured graph', 'it')}",
                                  _recorded_around(n)))
            return out

    try:
        run_seeded(lambda *args, **kwargs: Watch(gm).run(*args, **kwargs), inputs)
    except Exception:  # noqa: BLE001 - recorded in `found`
        pass
    return found[0] if found else (None, None)


def _module_outputs(gm: fx.GraphModule) -> Dict[str, List[str]]:
    """node name -> the modules whose output it is, innermost first: each call_module node, and the last node of
    each module traced through (its ``nn_module_stack`` scope). A later call's scope (``name@1``) names no module,
    so nothing is hooked for it; a module called at several sites is left out by its eager call count."""
    last: Dict[str, str] = {}
    for n in gm.graph.nodes:
        for scope in [*(n.meta.get("nn_module_stack") or {}), *([str(n.target)] if n.op == "call_module" else [])]:
            last[scope] = n.name
    ends: Dict[str, List[str]] = {}
    for module, node in sorted(last.items(), key=lambda item: -len(item[0])):  # inner first
        ends.setdefault(node, []).append(module)
    return ends


def _scope_module(scope: str) -> str:
    """The module path of an ``nn_module_stack`` key (``block.relu@1``: the second call of ``block.relu``)."""
    return re.sub(r"@\d+$", "", scope)


def _recorded_around(node: fx.Node) -> Optional[str]:
    """The innermost module traced through whose code computed ``node``: a module called whole (call_module) runs
    its own code, so where its output differs its inputs did, and the code recorded wrongly is around it. None at
    the top level (the root's own forward)."""
    scopes = [_scope_module(s) for s in (node.meta.get("nn_module_stack") or {}) if s]
    if node.op == "call_module":
        scopes = [s for s in scopes if s != str(node.target)]
    return scopes[-1] if scopes else None
