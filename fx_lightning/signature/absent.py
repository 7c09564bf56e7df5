"""What stands in for an input a caller leaves out or gives as one value, sized from the inputs given, and proven by
experiment.

Every call the steps made passed an ``attention_mask`` whose default is None (Wav2Vec2, BERT), and a served call
leaves it out. The artifact was built with it, so something must stand in: :func:`absent_fills` tries, on every
observed call, the model with the argument left out against the model with a constant tensor in its place (ones:
nothing masked; then zeros: one token type). Only a constant that gives the same outputs as leaving it out on every
call is recorded (``LeafSpec.absent_fill``); the artifact then puts it in place of the missing argument
(:func:`stand_in`, the same sizing the experiment used). Otherwise the argument stays required and a call leaving it
out is refused by name.

A per-sample input given as one value for every sample (a diffusion model's timestep, ``(B,)`` in training, an int
or a 0-d tensor in the sampling loop) is taken where :func:`one_value_for_all` shows, on the observed calls, that the
model gives the same outputs with that value alone as with it repeated for every sample (``LeafSpec.one_for_all``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Collection, Dict, List, MutableMapping, Optional, Sequence, Tuple, Union

import torch

from fx_lightning.common.calls import Call, tree_of, value_at
from fx_lightning.parity.compare import compare_outputs, structure_mismatch
from fx_lightning.signature.sample_axis import Runner
from fx_lightning.signature.signature import ConstSpec, DimKind, LeafSpec, Signature

__all__ = ["stand_in", "absent_fills", "leaf_steps", "one_value_for_all", "repeated_for_all", "with_none_at"]

# Tried in order: a mask with nothing masked, then one token type (BERT's token_type_ids).
_FILLS = (1.0, 0.0)


def stand_in(inputs: Sequence[LeafSpec], leaf: LeafSpec, values: Sequence[Any]) -> torch.Tensor:
    """What stands in for ``leaf`` on a call whose inputs are ``values`` (aligned with ``inputs``, the signature's;
    None where missing; tensors or arrays): its ``absent_fill`` (zeros for an unread input), or the size of the group
    ``absent_size_of`` names, in the shape it takes there: the sample axis and the sizes that varied with those
    inputs from them, the other sizes the example's; on the device of the tensors given."""
    given = {g: t.shape[d] for spec, t in zip(inputs, values) if t is not None and hasattr(t, "shape")
             for d, g in enumerate(spec.groups or ()) if g is not None and d < len(t.shape)}
    rows = next((t.shape[spec.sample_axis] for spec, t in zip(inputs, values)
                 if t is not None and hasattr(t, "shape") and spec.sample_axis is not None
                 and spec.sample_axis < len(t.shape)), None)
    shape = [rows if dim.kind is DimKind.sample and rows is not None else given.get(group, dim.size)
             for dim, group in zip(leaf.dims, leaf.groups or (None,) * len(leaf.dims))]
    fill = given.get(leaf.absent_size_of, 0) if leaf.absent_size_of is not None else leaf.absent_fill or 0.0
    device = next((t.device for t in values if isinstance(t, torch.Tensor)), None)  # beside the inputs given
    return torch.full(shape, fill, dtype=getattr(torch, leaf.dtype), device=device)


def absent_fills(signature: Signature, calls: Sequence[Call], run: Runner, optional: Collection[str]) -> Signature:
    """``signature`` with ``absent_fill`` set on each input that is a whole argument of forward with the default None
    (``optional``: those arguments' names) and for which a constant stand-in gave, on every call in ``calls``, the
    outputs the model gives with the argument left out."""
    if not calls:
        return signature
    fills: Dict[str, float] = {}
    for index, leaf in enumerate(signature.inputs):
        name = signature.argument_name(leaf.steps[0]) if len(leaf.steps) == 1 else None  # a whole argument
        if name is None or name not in optional or leaf.unread:
            continue
        trials = [dataclasses.replace(leaf, absent_fill=f) for f in _FILLS]
        trials += [dataclasses.replace(leaf, absent_size_of=g) for g in _sizes_of_others(signature, index)]
        for trial in trials:
            drops = [_same_without(signature, trial, index, call, run) for call in calls]
            if all(d is not None for d in drops) and len(set(drops)) == 1:  # the same outputs left None in each
                fills[leaf.name] = dataclasses.replace(trial, absent_drops=drops[0])
                break
    if not fills:
        return signature
    return dataclasses.replace(signature, inputs=[fills.get(leaf.name, leaf) for leaf in signature.inputs])


def _sizes_of_others(signature: Signature, index: int) -> List[str]:
    """The groups of the other inputs' variable dimensions (a waveform's length): candidates for the value every
    sample of a one-dimensional per-sample input takes when none is padded (lengths)."""
    leaf = signature.inputs[index]
    if len(leaf.dims) != 1 or leaf.sample_axis != 0 or getattr(torch, leaf.dtype).is_floating_point:
        return []
    return list(dict.fromkeys(g for i, spec in enumerate(signature.inputs) if i != index
                              for d, g in zip(spec.dims, spec.groups or ()) if g is not None
                              and d.kind is DimKind.variable))


def one_value_for_all(signature: Signature, calls: Sequence[Call], run: Runner) -> Signature:
    """``signature`` with ``one_for_all`` set on each whole-argument input whose one dimension is the sample axis and
    for which, on every call in ``calls``, the model gives the same outputs when its first value is passed alone (a
    0-d tensor, and a Python number) as when that value is repeated for every sample."""
    if not signature.batched or not calls:
        return signature
    found = {leaf.name for leaf in signature.inputs if len(leaf.dims) == 1 and leaf.sample_axis == 0
             and len(leaf.steps) == 1 and all(_alone_as_repeated(leaf, call, run) for call in calls)}
    if not found:
        return signature
    return dataclasses.replace(signature, inputs=[dataclasses.replace(leaf, one_for_all=leaf.name in found)
                                                  for leaf in signature.inputs])


def repeated_for_all(leaf: LeafSpec, value: Any, rows: Optional[int], device: Optional[torch.device] = None) -> Any:
    """``value`` repeated for ``rows`` samples where ``leaf`` takes one value for all and ``value`` is one (a number,
    a 0-d tensor), on ``device`` (the other inputs'); else ``value`` as it is."""
    if not leaf.one_for_all or rows is None or not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                                    or isinstance(value, torch.Tensor) and value.dim() == 0):
        return value
    dtype = getattr(torch, leaf.dtype)
    number = value.item() if isinstance(value, torch.Tensor) else value
    if not dtype.is_floating_point and float(number) != int(number):
        return value  # a fraction for an integer input: refused by the checks that follow, not rounded
    return torch.full((rows,), number, dtype=dtype, device=device)


def _alone_as_repeated(leaf: LeafSpec, call: Call, run: Runner) -> bool:
    try:
        given = value_at(call, leaf_steps(leaf))
    except (KeyError, IndexError, AttributeError, TypeError):
        return False
    if not isinstance(given, torch.Tensor) or given.dim() != 1 or given.shape[0] < 2:
        return False
    first = given[0]
    repeated = first.expand(given.shape[0]).clone()
    try:
        want = run(_replaced(call, leaf, repeated))
        alone = [run(_replaced(call, leaf, first.clone())), run(_replaced(call, leaf, first.item()))]
    except Exception:  # noqa: BLE001 - the model takes one value per sample only
        return False
    want_leaves = tree_of(want).leaves(want)
    return bool(want_leaves) and all(structure_mismatch(tree_of(a).leaves(a), want_leaves) is None and
                                     compare_outputs(tree_of(a).leaves(a), want_leaves).passed for a in alone)


def _same_without(signature: Signature, leaf: LeafSpec, index: int, call: Call,
                  run: Runner) -> Optional[Tuple[int, ...]]:
    """Whether ``run`` gives the same outputs on ``call`` with input ``index`` left out as with ``leaf``'s stand-in
    (:func:`stand_in`) in its place: None where not; else the outputs (by leaf index) that are None without it and a
    tensor with it (the lengths a speech model returns only when given lengths), every other one equal."""
    try:
        values: List[Any] = [value_at(call, leaf_steps(spec)) for spec in signature.inputs]
    except (KeyError, IndexError, AttributeError, TypeError):
        return None
    given, values[index] = values[index], None
    filled = stand_in(signature.inputs, leaf, values)
    if not isinstance(given, torch.Tensor) or filled.shape != given.shape:
        return None  # the stand-in would not have the size this call's argument had
    filled = filled.to(given.device)
    try:
        without, with_fill = run(_replaced(call, leaf, None)), run(_replaced(call, leaf, filled))
    except Exception:  # noqa: BLE001 - the model needs it (or a value of another kind): it stays required
        return None
    paths, got = tree_of(with_fill).leaf_paths(), tree_of(with_fill).leaves(with_fill)
    kept, drops, want = [], [], []
    for i, path in enumerate(paths):
        try:
            other = value_at(without, path)
        except (KeyError, IndexError, AttributeError, TypeError):
            return None
        if other is None:
            drops.append(i)
        elif isinstance(other, torch.Tensor):
            kept.append(got[i])
            want.append(other)
        else:
            return None
    if not want or len(tree_of(without).leaf_paths()) != len(want):  # nothing compared, or more without it
        return None
    if structure_mismatch(kept, want) is not None or not compare_outputs(kept, want).passed:
        return None
    return tuple(drops)


def with_none_at(value: Any, paths: Sequence[Tuple[Tuple[str, Any], ...]]) -> Any:
    """``value`` (outputs in their containers) with None at each of ``paths``: what the model returns without an
    input whose stand-in gave those outputs (:attr:`LeafSpec.absent_drops`)."""
    for path in paths:
        value = _set_at(value, list(path))
    return value


def _set_at(value: Any, path: List[Tuple[str, Any]]) -> Any:
    if not path:
        return None
    (kind, key), rest = path[0], path[1:]
    if isinstance(value, tuple):
        items = list(value)
        items[key] = _set_at(items[key], rest)
        return value._make(items) if hasattr(value, "_make") else tuple(items)
    if isinstance(value, list):
        return [_set_at(v, rest) if i == key else v for i, v in enumerate(value)]
    if kind == "key" and isinstance(value, MutableMapping):
        out = copy.copy(value)
        out[key] = _set_at(value[key], rest)
        return out
    out = copy.copy(value)  # an object's field (a dataclass, a ModelOutput)
    object.__setattr__(out, key, _set_at(getattr(value, key), rest))
    return out


def leaf_steps(leaf: Union[LeafSpec, ConstSpec]) -> Tuple[Tuple[str, Any], ...]:
    """Where ``leaf`` sits in a call, as steps :func:`~fx_lightning.common.calls.value_at` follows."""
    return tuple((str(kind), key) for kind, key in leaf.steps)


def _replaced(call: Call, leaf: LeafSpec, value: Any) -> Call:
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
