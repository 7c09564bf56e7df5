"""Sizes a condition refuses, served by padding to one it takes and cropping the outputs back, where proven.

A model that pads its input to a multiple of its stride and crops its outputs back (torchaudio's ConvTasNet:
``if T % 8: pad``) is captured on one side of that branch, so its artifact carries the condition ``T % 8 == 0``
(:mod:`~fx_lightning.signature.conditions`) and refuses other lengths. Padding with zeros at the end of that
dimension to the next size the conditions take, running the artifact, and cropping every output dimension that
follows that size (the same group in every call) back to the size given is what the model does itself; it is taken
only where :func:`padding_proven` shows it on the observed call sliced to sizes the conditions refuse: the outputs
equal the model's on those sizes. Otherwise such sizes stay refused by name.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from fx_lightning.common.calls import Call, tree_of, tree_of_call
from fx_lightning.parity.compare import compare_outputs, structure_mismatch
from fx_lightning.signature.conditions import condition_holds, condition_sizes
from fx_lightning.signature.sample_axis import Runner
from fx_lightning.signature.signature import DimKind, Signature

__all__ = ["padding_proven", "padded_sizes", "pad_inputs", "crop_outputs"]

# How far past a refused size the next size the conditions take is looked for (a stride of up to 64).
_SEARCH = 64


def _group(signature: Signature, leaf: int, dim: int) -> Optional[str]:
    spec = signature.inputs[leaf]
    if dim >= len(spec.dims) or spec.dims[dim].kind is not DimKind.variable:
        return None
    return (spec.groups or (None,) * len(spec.dims))[dim]


def _members(signature: Signature, group: str) -> List[Tuple[int, int]]:
    """The input (leaf, dim) pairs of ``group``: they are padded together."""
    return [(i, d) for i, spec in enumerate(signature.inputs) for d, g in enumerate(spec.groups or ()) if g == group]


def padded_sizes(signature: Signature, tensors: Sequence[torch.Tensor]) -> Optional[List[Tuple[str, int, int]]]:
    """For a call that fails a condition: (group, size given, size to pad to), the smallest size that meets every
    condition, for the one proven group the failed conditions read; None where padding is not proven for it, the
    failed conditions read another size or two groups, or the group's sizes differ in this call."""
    if not signature.padded:
        return None
    shapes = [list(t.shape) for t in tensors]
    failed = [c for c in signature.conditions if not condition_holds(c, tensors)]
    groups = {_group(signature, leaf, dim) for c in failed for leaf, dim in condition_sizes(c)}
    if len(groups) != 1 or not groups <= set(signature.padded):
        return None
    group = groups.pop()
    members = _members(signature, group)
    if not members or any(len(shapes[i]) <= d for i, d in members) or \
            len({shapes[i][d] for i, d in members}) != 1:  # padded together, they must have one size
        return None
    given = shapes[members[0][0]][members[0][1]]
    for extra in range(1, _SEARCH + 1):
        trial = [list(s) for s in shapes]
        for i, d in members:
            trial[i][d] = given + extra
        sized = [types.SimpleNamespace(shape=s) for s in trial]  # the conditions read sizes only
        if all(condition_holds(c, sized) for c in signature.conditions):
            return [(group, given, given + extra)]
    return None


def pad_inputs(signature: Signature, tensors: Sequence[Any], sizes: Sequence[Tuple[str, int, int]]) -> List[Any]:
    """``tensors`` zero-padded at the end of each group's dimensions to the sizes ``sizes`` gives."""
    out = list(tensors)
    for group, given, target in sizes:
        for i, d in _members(signature, group):
            t = out[i]
            pad = [0, 0] * (t.dim() - 1 - d) + [0, target - given]
            out[i] = F.pad(t, pad)
    return out


def crop_outputs(signature: Signature, outputs: Any, sizes: Sequence[Tuple[str, int, int]]) -> Any:
    """``outputs`` with every dimension of a padded group cut back to the size given."""
    tree = tree_of(outputs)
    leaves = tree.leaves(outputs)
    cropped = []
    for spec, t in zip(signature.outputs, leaves):
        for d, g in enumerate(spec.groups or ()):
            for group, given, target in sizes:
                if g == group and d < t.dim() and t.shape[d] == target:
                    t = t.narrow(d, 0, given)
        cropped.append(t)
    return tree.rebuild(cropped)


def padding_proven(signature: Signature, call: Call, run: Runner,
                   artifact: Callable[[Signature], Callable[..., Any]]) -> Signature:
    """``signature`` with ``padded`` set to the groups (input sizes a condition reads, followed by an output) for which
    the artifact built with that padding (``artifact``) gives the model's outputs (``run``) on ``call`` sliced to two
    sizes the conditions refuse."""
    if not signature.conditions:
        return signature
    tree = tree_of_call(call)
    leaves = tree.leaves(call)
    groups = []
    for condition in signature.conditions:
        for leaf, dim in condition_sizes(condition):
            group = _group(signature, leaf, dim)
            if group is not None and group not in groups and \
                    any(group in (spec.groups or ()) for spec in signature.outputs):
                groups.append(group)
    proven = []
    for group in groups:
        trial = dataclasses.replace(signature, padded=[group])
        members = _members(signature, group)
        size = leaves[members[0][0]].shape[members[0][1]]
        refused = _refused_sizes(signature, leaves, members, size)
        if refused and all(_same(tree, leaves, members, s, run, artifact(trial)) for s in refused):
            proven.append(group)
    return dataclasses.replace(signature, padded=proven) if proven else signature


def _refused_sizes(signature: Signature, leaves: Sequence[torch.Tensor], members: Sequence[Tuple[int, int]],
                   size: int) -> List[int]:
    """Sizes below ``size`` the conditions refuse, to prove padding on: the two nearest (the smallest pads) and the
    one just above the next size they take (the largest pad)."""
    refused: List[int] = []
    for s in range(size - 1, max(size // 2, 1), -1):
        if all(condition_holds(c, _resized(leaves, members, s)) for c in signature.conditions):
            break  # a size they take: the one above it needs the largest pad
        refused.append(s)
    return sorted(set(refused[:2] + refused[-1:]), reverse=True)


def _resized(leaves: Sequence[torch.Tensor], members: Sequence[Tuple[int, int]], size: int) -> List[torch.Tensor]:
    out = list(leaves)
    for i, d in members:
        out[i] = out[i].narrow(d, 0, size)
    return out


def _same(tree: Any, leaves: Sequence[torch.Tensor], members: Sequence[Tuple[int, int]], size: int, run: Runner,
          artifact: Callable[..., Any]) -> bool:
    call = tree.rebuild(_resized(leaves, members, size))
    try:
        want = run(call)
        with torch.no_grad():
            got = call.run(artifact)
    except Exception:  # noqa: BLE001 - the model or the padded artifact refuses that size: not proven
        return False
    got_leaves, want_leaves = tree_of(got).leaves(got), tree_of(want).leaves(want)
    return bool(want_leaves) and structure_mismatch(got_leaves, want_leaves) is None and \
        compare_outputs(got_leaves, want_leaves).passed
