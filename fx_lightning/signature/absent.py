"""An input a caller leaves out: what stands in for it, sized from the inputs given, and proven by experiment.

Every call the steps made passed an ``attention_mask`` whose default is None (Wav2Vec2, BERT), and a served call
leaves it out. The artifact was built with it, so something must stand in: :func:`absent_fills` tries, on every
observed call, the model with the argument left out against the model with a constant tensor in its place (ones:
nothing masked; then zeros: one token type). Only a constant that gives the same outputs as leaving it out on every
call is recorded (``LeafSpec.absent_fill``); the artifact then puts it in place of the missing argument
(:func:`stand_in`, the same sizing the experiment used). Otherwise the argument stays required and a call leaving it
out is refused by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Collection, Dict, List, Optional, Sequence, Tuple, Union

import torch

from fx_lightning.common.calls import Call, tree_of, value_at
from fx_lightning.parity.compare import compare_outputs, structure_mismatch
from fx_lightning.signature.sample_axis import Runner
from fx_lightning.signature.signature import ConstSpec, DimKind, LeafSpec, Signature

__all__ = ["stand_in", "absent_fills", "leaf_steps"]

# Tried in order: a mask with nothing masked, then one token type (BERT's token_type_ids).
_FILLS = (1.0, 0.0)


def stand_in(signature: Signature, leaf: LeafSpec, values: Sequence[Any], fill: float = 0.0) -> torch.Tensor:
    """``fill`` in the shape ``leaf`` takes on a call whose other inputs are ``values`` (aligned with
    ``signature.inputs``, None where missing): the sample axis and the sizes that varied with those inputs from them,
    the other sizes the example's."""
    given = {g: t.shape[d] for spec, t in zip(signature.inputs, values) if isinstance(t, torch.Tensor)
             for d, g in enumerate(spec.groups or ()) if g is not None}
    rows = next((t.shape[spec.sample_axis] for spec, t in zip(signature.inputs, values)
                 if isinstance(t, torch.Tensor) and spec.sample_axis is not None), None)
    shape = [rows if dim.kind is DimKind.sample and rows is not None else given.get(group, dim.size)
             for dim, group in zip(leaf.dims, leaf.groups or (None,) * len(leaf.dims))]
    return torch.full(shape, fill, dtype=getattr(torch, leaf.dtype))


def absent_fills(signature: Signature, calls: Sequence[Call], run: Runner, optional: Collection[str]) -> Signature:
    """``signature`` with ``absent_fill`` set on each input that is a whole argument of forward with the default None
    (``optional``: those arguments' names) and for which a constant stand-in gave, on every call in ``calls``, the
    outputs the model gives with the argument left out."""
    if not calls:
        return signature
    fills: Dict[str, float] = {}
    for index, leaf in enumerate(signature.inputs):
        name = _argument_name(signature, leaf)
        if name is None or name not in optional or leaf.unread:
            continue
        fill = next((f for f in _FILLS if all(_same_without(signature, index, call, run, f) for call in calls)), None)
        if fill is not None:
            fills[leaf.name] = fill
    if not fills:
        return signature
    return dataclasses.replace(signature, inputs=[dataclasses.replace(leaf, absent_fill=fills.get(leaf.name))
                                                  for leaf in signature.inputs])


def _argument_name(signature: Signature, leaf: LeafSpec) -> Optional[str]:
    """The name of forward's argument ``leaf`` is, when it is a whole argument (not a field or item of one)."""
    if len(leaf.steps) != 1:
        return None
    kind, key = leaf.steps[0]
    if kind == "kwarg":
        return str(key)
    if kind == "arg" and isinstance(key, int) and key < len(signature.arguments):
        return signature.arguments[key] or None
    return None


def _same_without(signature: Signature, index: int, call: Call, run: Runner, fill: float) -> bool:
    """Whether ``run`` gives the same outputs on ``call`` with input ``index`` left out as with ``fill`` in its
    place, sized by :func:`stand_in`."""
    leaf = signature.inputs[index]
    try:
        values: List[Any] = [value_at(call, leaf_steps(spec)) for spec in signature.inputs]
    except (KeyError, IndexError, AttributeError, TypeError):
        return False
    given, values[index] = values[index], None
    filled = stand_in(signature, leaf, values, fill)
    if not isinstance(given, torch.Tensor) or filled.shape != given.shape:
        return False  # the stand-in would not have the size this call's argument had
    filled = filled.to(given.device)
    try:
        without, with_fill = run(_replaced(call, leaf, None)), run(_replaced(call, leaf, filled))
    except Exception:  # noqa: BLE001 - the model needs it (or a value of another kind): it stays required
        return False
    got, want = tree_of(with_fill).leaves(with_fill), tree_of(without).leaves(without)
    return bool(want) and structure_mismatch(got, want) is None and compare_outputs(got, want).passed


def leaf_steps(leaf: Union[LeafSpec, ConstSpec]) -> Tuple[Tuple[str, Any], ...]:
    """Where ``leaf`` sits in a call, as steps :func:`~fx_lightning.common.calls.value_at` follows."""
    return tuple((str(kind), key) for kind, key in leaf.steps)


def _replaced(call: Call, leaf: LeafSpec, value: Optional[torch.Tensor]) -> Call:
    """``call`` with ``leaf``'s argument set to ``value``; None leaves a keyword argument out (and passes forward's
    default, None, by position)."""
    kind, key = leaf_steps(leaf)[0]
    if kind == "kwarg":
        kwargs = {k: v for k, v in call.kwargs.items() if k != key}
        if value is not None:
            kwargs[key] = value
        return Call(call.args, kwargs)
    args = list(call.args)
    args[key] = value
    return Call(tuple(args), dict(call.kwargs))
