"""The sample axis: which dimension of a call's inputs and outputs counts independent samples, proven by
experiment on the observed calls or refused (:func:`find_sample_axis`), for :func:`fx_lightning.signature.signature.derive_signature`.

1. it is consistent: the leaves on it have one size per call, and every output has a dimension of that size;
2. it follows the number of samples in the loader's batches, where the loader says how many (a graph batch's
   node count is not its number of graphs);
3. an experiment agrees: replacing the last rows of every input on the axis leaves the outputs of the first rows
   unchanged (rows do not interact), and the first rows alone give the same outputs (``any_size``); if they alone
   raise or give outputs of another structure, only padding to the size seen is exact; other values: no axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from fx_lightning.common.calls import Call, Tree, tree_of
from fx_lightning.common.rows import concat_rows, take_rows, with_rows
from fx_lightning.parity.compare import compare_outputs, structure_mismatch

__all__ = ["SampleAxis", "Observed", "Runner", "find_sample_axis", "stochastic_outputs", "shapes_text", "SizeProbe",
           "probe_sizes"]


@dataclass(frozen=True)
class SampleAxis:
    """Whether the calls prove a sample axis, and how (or why not). ``any_size``: the first rows alone gave the
    same outputs, so pieces of any size are exact; otherwise only padding to the sizes seen is."""

    proven: bool
    how: str
    any_size: bool = False


@dataclass
class Observed:
    """One call of the target seen while the model ran: its arguments, and the number of samples in the batch it
    came from (None: the loader does not say)."""

    call: Call
    samples: Optional[int] = None


Runner = Callable[[Call], Any]  # runs the reference on a call (eval mode, no grad, a fixed RNG) -> its outputs


def shapes_text(leaves: Sequence[torch.Tensor]) -> str:
    return ", ".join(str(list(t.shape)) for t in leaves)


def stochastic_outputs(call: Observed, first: Sequence[torch.Tensor], rerun: Runner) -> set:
    """The outputs that change when the model runs again with another seed (a sample drawn in forward)."""
    again = rerun(call.call)
    other = tree_of(again).leaves(again)
    return {i for i, (a, b) in enumerate(zip(first, other))
            if a.shape != b.shape or not compare_outputs(b, a).passed}


def find_sample_axis(leaves: Sequence[Sequence[torch.Tensor]], outputs: Sequence[Optional[Sequence[torch.Tensor]]],
                 all_shapes: Sequence[Sequence[Tuple[int, ...]]], all_counts: Sequence[Optional[int]],
                 run: Runner, tree: Tree, stochastic: set) -> Tuple[SampleAxis, List[Optional[int]], List[Optional[int]]]:
    """Which input and output dimensions carry the samples, and the evidence (the outputs drawn at random in forward
    are left out of the experiments: their draws differ with the batch's shape)."""
    n_in = len(leaves[0])

    def refused(why: str) -> Tuple[SampleAxis, List[Optional[int]], List[Optional[int]]]:
        return SampleAxis(False, why), [None] * n_in, [None] * len(outputs[0] or [])

    known = [(shapes, n) for shapes, n in zip(all_shapes, all_counts) if n is not None]
    if known:
        in_axes = [_axis_following([(s[i], n) for s, n in known]) for i in range(n_in)]
        how = f"it follows the number of samples in {len(known)} loader batch(es)"
    else:
        first = next((t for t in leaves[0] if t.dim() > 0), None)
        if first is None:
            return refused("no input has a dimension")
        in_axes = [0 if all(len(s[i]) > 0 and s[i][0] == _first_dim0(s) for s in all_shapes) else None
                   for i in range(n_in)]
        how = "the loader does not say how many samples a batch holds, so dim 0 was tested"
    if all(a is None for a in in_axes):
        sizes = ", ".join(f"{n}" for _, n in known[:6])
        return refused(f"no input dimension follows the number of samples in the loader's batches ({sizes})"
                       if known else "no input has a dim 0 shared by the others")
    sizes_per_call = []
    for ls in leaves:
        sizes = {int(t.shape[a]) for t, a in zip(ls, in_axes) if a is not None}
        if len(sizes) != 1:
            return refused("the inputs on the candidate axis have different sizes in one call")
        sizes_per_call.append(sizes.pop())
    out_axes: List[Optional[int]] = []
    for i in range(len(outputs[0] or [])):
        axis = _axis_following([(tuple(o[i].shape), n) for o, n in zip(outputs, sizes_per_call)])  # type: ignore[index]
        if axis is None:
            return refused(f"output {i} ({[list(o[i].shape) for o in outputs[:3]]}) does not follow the number of "  # type: ignore[index]
                           f"samples ({sizes_per_call[:3]})")
        out_axes.append(axis)
    compared = [None if i in stochastic else a for i, a in enumerate(out_axes)]
    if all(a is None for a in compared):  # nothing to compare rows with: no evidence either way
        return refused(f"{how}, but every output on it is drawn at random, so no experiment can show the rows "
                       "independent")
    best = max(range(len(leaves)), key=lambda c: sizes_per_call[c])
    n = sizes_per_call[best]
    if n < 2:  # one sample: a second, made of the first's values in another order, is the probe
        verdict = _probe_second_row(leaves[best], outputs[best], in_axes, compared, run, tree)  # type: ignore[arg-type]
        if not verdict[0]:
            return refused(f"{how}; every call observed had one sample, and {verdict[1]}")
        return SampleAxis(True, f"{how}, and rows are independent ({verdict[1]})", True), in_axes, out_axes
    verdict = _rows_independent(leaves[best], outputs[best], in_axes, compared, n, run, tree,  # type: ignore[arg-type]
                                out_axes)
    if not verdict[0]:
        return refused(f"{how}, but the samples are not independent: {verdict[1]}")
    return SampleAxis(True, f"{how}, and rows are independent ({verdict[1]})", verdict[2]), in_axes, out_axes


def _first_dim0(shapes: Sequence[Tuple[int, ...]]) -> Optional[int]:
    return next((s[0] for s in shapes if len(s) > 0), None)


def _axis_following(pairs: Sequence[Tuple[Tuple[int, ...], int]]) -> Optional[int]:
    """The one dimension whose size is the sample count in every pair (None: none, or more than one)."""
    if not pairs:
        return None
    rank = len(pairs[0][0])
    if any(len(s) != rank for s, _ in pairs):
        return None
    matching = [d for d in range(rank) if all(s[d] == n for s, n in pairs)]
    if len(matching) > 1:  # the first is taken only when the others never varied apart from it
        varied = [d for d in matching if len({s[d] for s, _ in pairs}) > 1]
        matching = matching[:1] if not varied else varied[:1] if len(varied) == 1 else []
    return matching[0] if len(matching) == 1 else None


def _rows_independent(leaves: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                      in_axes: Sequence[Optional[int]], out_axes: Sequence[Optional[int]], n: int, run: Runner,
                      tree: Tree, all_out_axes: Sequence[Optional[int]]) -> Tuple[bool, str, bool]:
    """The experiment: (independent, what was seen, any_size). Rows ``k..n`` of every input on the axis replaced
    by copies of the first rows must leave the first ``k`` rows of every output unchanged; the first ``k`` rows
    alone must give them too (else only padding to a size seen is exact). ``out_axes``: the outputs compared
    (None: drawn at random, left out); ``all_out_axes``: every output's sample axis, for the structure check."""
    k = max(1, n // 2)
    replaced = with_rows(take_rows(leaves, in_axes, 0, k), in_axes, n)
    want = [o.narrow(a, 0, k) for o, a in zip(outputs, out_axes) if a is not None]
    try:
        got = run(tree.rebuild(replaced))
    except Exception as exc:  # noqa: BLE001 - the model refuses rows it did not get: not independent rows
        return False, f"with its last rows replaced by copies of the first the model raises {type(exc).__name__}", False
    got_leaves = tree_of(got).leaves(got)
    comparison = compare_outputs([g.narrow(a, 0, k) for g, a in zip(got_leaves, out_axes) if a is not None], want)
    if not comparison.passed:
        return False, f"replacing rows {k}..{n - 1} changed the outputs of rows 0..{k - 1}: {comparison.describe()}", \
            False
    alone = take_rows(leaves, in_axes, 0, k)
    seen = f"replacing rows {k}..{n - 1} of {n} left rows 0..{k - 1} unchanged"
    try:
        out = run(tree.rebuild(alone))
    except Exception as exc:  # noqa: BLE001 - a model fixed to its batch size: pieces padded to that size only
        return True, seen + f"; the first rows alone make it raise {type(exc).__name__}, so only padding to a " \
            "size seen is exact", False
    out_leaves = tree_of(out).leaves(out)
    if structure_mismatch(out_leaves, outputs) is None and compare_outputs(out_leaves, list(outputs)).passed:
        # The same outputs, all n rows of them, from k rows: they do not follow this axis (an input never read)
        return False, f"the first {k} rows alone gave the same outputs as all {n}: the outputs follow something " \
            "else than these inputs' rows (an input the model does not read, such as a batch's labels)", False
    # Not the batch's outputs with k rows on each sample axis (count, dtypes, shapes): as if it raised, pad only.
    if structure_mismatch(out_leaves, [o.narrow(a, 0, k) if a is not None else o
                                       for o, a in zip(outputs, all_out_axes)]) is not None:
        return True, seen + f"; the first rows alone give outputs of another structure ({shapes_text(out_leaves)}, " \
            f"not {shapes_text(outputs)} with {k} rows), so only padding to a size seen is exact", False
    first = compare_outputs([o.narrow(a, 0, k) for o, a in zip(out_leaves, out_axes) if a is not None], want)
    if not first.passed:  # the outputs depend on how many rows there are: neither pieces nor padding are exact
        return False, f"{seen}, but the first {k} rows alone gave other outputs than in the batch of {n} (the " \
            f"outputs depend on the batch size): {first.describe()}", False
    return True, seen + "; the first rows alone gave the same outputs", True


def _probe_second_row(leaves: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                      in_axes: Sequence[Optional[int]], out_axes: Sequence[Optional[int]], run: Runner,
                      tree: Tree) -> Tuple[bool, str]:
    """The experiment with one sample: a second row made of the first's own values in another order (same dtype,
    same values: valid indices stay valid); run together, each row must give what it gives alone."""
    g = torch.Generator().manual_seed(0)

    def scrambled(t: torch.Tensor, axis: int) -> torch.Tensor:
        row = t.narrow(axis, 0, 1)
        flat = row.reshape(-1)
        return flat[torch.randperm(flat.numel(), generator=g).to(flat.device)].reshape(row.shape)

    probe = [scrambled(t, a) if a is not None else t for t, a in zip(leaves, in_axes)]
    both = concat_rows([leaves, probe], in_axes)
    try:
        together, alone = run(tree.rebuild(both)), run(tree.rebuild(probe))
    except Exception as exc:  # noqa: BLE001
        return False, f"two rows (the second its values reordered) make the model raise {type(exc).__name__}"
    together_leaves, alone_leaves = tree_of(together).leaves(together), tree_of(alone).leaves(alone)
    first = compare_outputs([t.narrow(a, 0, 1) for t, a in zip(together_leaves, out_axes) if a is not None],
                            [o for o, a in zip(outputs, out_axes) if a is not None])
    second = compare_outputs([t.narrow(a, 1, 1) for t, a in zip(together_leaves, out_axes) if a is not None],
                             [o for o, a in zip(alone_leaves, out_axes) if a is not None])
    if not (first.passed and second.passed):
        return False, f"a second row changed the first's outputs: {(first if not first.passed else second).describe()}"
    return True, "a second row, the first's values reordered, ran beside it as each ran alone"


# ------------------------------------------------------------------------------------ sizes that can vary


@dataclass
class SizeProbe:
    """Input dimensions that were the same in every call observed but are shown to vary: the call with them
    resized runs and gives outputs of the same structure. ``inputs``: (leaf, dim) pairs, one group per size cut
    together; ``outputs``: the (output, dim) pairs whose size changed with them; ``call``: the shorter call (an
    example of other sizes every artifact is checked on)."""

    inputs: List[List[Tuple[int, int]]]
    outputs: List[Tuple[int, int]]
    call: Optional[Call] = None


def probe_sizes(leaves: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                candidates: Sequence[Tuple[int, int]], run: Runner, tree: Tree) -> SizeProbe:
    """Which of ``candidates`` ((leaf, dim) pairs of sizes that did not vary, the sample axis left out) can vary,
    by experiment: the dims of one size are resized together (to twice the size, else half, else one less), and
    each alone where that fails (an image's height and width, a sequence's length in its ids and its mask). Only a
    model that runs and keeps its output structure (count, ranks, dtypes) counts: a channel or feature axis makes
    it raise."""
    by_size: dict = {}
    for leaf, dim in candidates:
        by_size.setdefault(int(leaves[leaf].shape[dim]), []).append((leaf, dim))
    groups: List[List[Tuple[int, int]]] = []
    changed: set = set()
    current = list(leaves)
    for size, dims in sorted(by_size.items()):
        for group in [dims] + ([[d] for d in dims] if len(dims) > 1 else []):
            if any(d in {x for g in groups for x in g} for d in group):
                continue
            cut = _cut(current, group, size, outputs, run, tree)
            if cut is not None:
                current, moved = cut
                groups.append(group)
                changed |= moved
    if not groups:
        return SizeProbe([], [])
    return SizeProbe(groups, sorted(changed), tree.rebuild(current))


def _cut(leaves: Sequence[torch.Tensor], group: Sequence[Tuple[int, int]], size: int,
         outputs: Sequence[torch.Tensor], run: Runner, tree: Tree) -> Optional[Tuple[List[torch.Tensor], set]]:
    """``leaves`` with the dims of ``group`` resized, and the output dims whose size changed; None when the
    model refuses that (raises, or gives outputs of another count, rank or dtype)."""
    # Twice the size first: it keeps every divisibility the model may need (a U-Net's 32) and collapses no
    # intermediate size to 1 (which torch.export would specialise on); then shorter.
    for other in dict.fromkeys(s for s in (2 * size, size // 2, size - 1) if s >= 1 and s != size):
        cut = list(leaves)
        for leaf, dim in group:  # its first elements, or itself repeated (the same values: valid indices stay valid)
            cut[leaf] = with_rows([cut[leaf]], [dim], other)[0]
        try:
            got = run(tree.rebuild(cut))
        except Exception:  # noqa: BLE001 - the model refuses that size: the dims stay fixed
            continue
        got_leaves = tree_of(got).leaves(got)
        if len(got_leaves) != len(outputs) or any(
                not isinstance(g, torch.Tensor) or g.dim() != o.dim() or g.dtype != o.dtype
                for g, o in zip(got_leaves, outputs)):
            continue
        moved = {(i, d) for i, (g, o) in enumerate(zip(got_leaves, outputs)) for d in range(o.dim())
                 if g.shape[d] != o.shape[d]}
        return cut, moved
    return None
