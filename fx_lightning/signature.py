"""How an artifact is called: one :class:`Signature` derived from calls that were observed, never guessed.

Every input and output leaf (a tensor, named by where it sits in the call) with its dtype and, per dimension,
what the calls showed: a **fixed** size, the **sample** axis, or a **variable** size. The sample axis is recorded
only where it is proven (:func:`derive_signature`):

1. it is consistent: the leaves on it have one size per call, and every output has a dimension of that size;
2. it follows the number of samples in the loader's batches, where the loader says how many (a graph batch's
   node count is not its number of graphs);
3. an experiment agrees: replacing the last rows of every input on the axis leaves the outputs of the first rows
   unchanged (rows do not interact), and the first rows alone give the same outputs (``any_size``).

Everything that needs to know how an artifact is called reads the signature: capture and ``dynamic_shapes``
(:mod:`fx_lightning.program`), the manifest's contract, ``load_fused``'s pieces and padding (only on a proven
sample axis), the server's batching, the Triton dims and ``bench``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from fx_lightning._json import dtype_name
from fx_lightning.calls import Call, Tree, path_text, tree_of, tree_of_call
from fx_lightning.parity.compare import compare_outputs

__all__ = [
    "DimKind",
    "DimSpec",
    "LeafSpec",
    "SampleAxis",
    "Signature",
    "Observed",
    "derive_signature",
    "shape_problem",
    "with_raw_input",
]


class DimKind(str, Enum):
    fixed = "fixed"
    sample = "sample"
    variable = "variable"


@dataclass(frozen=True)
class DimSpec:
    """One dimension of a leaf: its kind, the example's size, and the smallest and largest size observed."""

    kind: DimKind
    size: int
    low: int
    high: int

    def token(self, group: Optional[str] = None) -> Any:
        """How a manifest writes it: the size (fixed), ``"batch"`` (the sample axis), a name (variable)."""
        if self.kind is DimKind.fixed:
            return self.size
        return "batch" if self.kind is DimKind.sample else (group or "dynamic")


@dataclass(frozen=True)
class LeafSpec:
    """One tensor of the call (an input) or of its result (an output)."""

    name: str  # an identifier: what runtimes, the manifest and the server call it
    path: str  # where it sits, as people write it: "bmg.V", "x['continuous']", "output[0].loc"
    steps: Tuple[Tuple[str, Any], ...]  # the same place, as steps a process without the training code can follow
    dtype: str
    dims: Tuple[DimSpec, ...]
    stochastic: bool = False  # an output that changes from run to run (a sample drawn in forward)
    groups: Tuple[Optional[str], ...] = ()  # a name per variable dimension: equal names were equal in every call

    @property
    def sample_axis(self) -> Optional[int]:
        return next((i for i, d in enumerate(self.dims) if d.kind is DimKind.sample), None)

    @property
    def shape(self) -> List[Any]:
        groups = self.groups or (None,) * len(self.dims)
        return [d.token(g) for d, g in zip(self.dims, groups)]

    @property
    def example_shape(self) -> List[int]:
        return [d.size for d in self.dims]

    def to_dict(self) -> Dict[str, object]:
        out: Dict[str, object] = {"name": self.name, "path": self.path, "steps": [list(s) for s in self.steps],
                                  "dtype": self.dtype, "shape": self.shape, "example_shape": self.example_shape,
                                  "sizes_seen": [[d.low, d.high] for d in self.dims]}
        if self.stochastic:
            out["stochastic"] = True
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LeafSpec":
        shape, example = list(data["shape"]), [int(s) for s in data["example_shape"]]
        seen = data.get("sizes_seen") or [[s, s] for s in example]
        dims, groups = [], []
        for token, size, (low, high) in zip(shape, example, seen):
            kind = DimKind.fixed if isinstance(token, int) else DimKind.sample if token == "batch" else DimKind.variable
            dims.append(DimSpec(kind, size, int(low), int(high)))
            groups.append(token if kind is DimKind.variable else None)
        return cls(str(data["name"]), str(data.get("path", data["name"])),
                   tuple((str(k), v) for k, v in data.get("steps") or []), str(data["dtype"]), tuple(dims),
                   bool(data.get("stochastic", False)), tuple(groups))


@dataclass(frozen=True)
class SampleAxis:
    """Whether the calls prove a sample axis, and how (or why not). ``any_size``: the first rows alone gave the
    same outputs, so pieces of any size are exact; otherwise only padding to the sizes seen is."""

    proven: bool
    how: str
    any_size: bool = False


@dataclass(frozen=True)
class ConstSpec:
    """A constant of the observed calls (a flag, a count: the same in every call), baked into the graph: a caller
    who passes the original arguments must pass this value there, or leave it out."""

    path: str
    steps: Tuple[Tuple[str, Any], ...]
    value: Union[int, float, bool, str, None]

    def to_dict(self) -> Dict[str, object]:
        return {"path": self.path, "steps": [list(s) for s in self.steps], "value": self.value}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ConstSpec":
        return cls(str(data["path"]), tuple((str(k), v) for k, v in data.get("steps") or []), data.get("value"))


@dataclass
class Signature:
    """How the artifact is called. ``flat``: it takes one tensor per input leaf, by name, rebuilt into the
    original arguments inside (the call was not positional tensors); ``calls``: how many calls it rests on."""

    inputs: List[LeafSpec]
    outputs: List[LeafSpec]
    sample: SampleAxis
    calls: int = 1
    flat: bool = False
    notes: List[str] = field(default_factory=list)
    constants: List[ConstSpec] = field(default_factory=list)

    @property
    def batched(self) -> bool:
        """Whether there is a proven sample axis (pieces and padding are allowed along it)."""
        return self.sample.proven

    def input_axes(self) -> List[Optional[int]]:
        return [leaf.sample_axis for leaf in self.inputs]

    def output_axes(self) -> List[Optional[int]]:
        return [leaf.sample_axis for leaf in self.outputs]

    def describe(self) -> str:
        lines = [f"input {leaf.name} ({leaf.path}): {leaf.dtype} {leaf.shape}" for leaf in self.inputs]
        lines += [f"output {leaf.name} ({leaf.path}): {leaf.dtype} {leaf.shape}"
                  + (" (stochastic)" if leaf.stochastic else "") for leaf in self.outputs]
        lines.append(("sample axis: " if self.sample.proven else "no sample axis: ") + self.sample.how)
        return "\n".join(lines)

    def to_dict(self) -> Dict[str, object]:
        return {"inputs": [s.to_dict() for s in self.inputs], "outputs": [s.to_dict() for s in self.outputs],
                "sample_axis": dataclasses.asdict(self.sample), "calls": self.calls, "flat": self.flat,
                "notes": list(self.notes), "constants": [c.to_dict() for c in self.constants]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Signature":
        sample = data.get("sample_axis") or {}
        return cls([LeafSpec.from_dict(s) for s in data.get("inputs") or []],
                   [LeafSpec.from_dict(s) for s in data.get("outputs") or []],
                   SampleAxis(bool(sample.get("proven", False)), str(sample.get("how", "")),
                              bool(sample.get("any_size", False))),
                   int(data.get("calls", 1)), bool(data.get("flat", False)), [str(n) for n in data.get("notes") or []],
                   [ConstSpec.from_dict(c) for c in data.get("constants") or []])


@dataclass
class Observed:
    """One call of the target seen while the model ran: its arguments, and the number of samples in the batch it
    came from (None: the loader does not say)."""

    call: Call
    samples: Optional[int] = None


# ------------------------------------------------------------------------------------------ derivation


Runner = Callable[[Call], Any]  # runs the reference on a call (eval mode, no grad, a fixed RNG) -> its outputs


def derive_signature(calls: Sequence[Observed], run: Runner, *, extra_shapes: Sequence[Tuple[List[Tuple[int, ...]],
                     Optional[int]]] = (), root_names: Optional[Sequence[str]] = None, flat: bool = False,
                     rerun: Optional[Runner] = None) -> Signature:
    """The signature the calls show. ``run`` runs the reference on a call; ``rerun`` runs it again with another
    RNG seed (outputs that change are stochastic). ``extra_shapes``: the input leaves' shapes (and sample counts)
    of more calls whose values were not kept, as evidence of which sizes vary. ``flat``: the artifact takes one
    tensor per input leaf."""
    if not calls:
        raise ValueError("derive_signature() needs at least one call")
    tree = tree_of_call(calls[0].call)
    hidden = tree.hidden_paths()
    if hidden:  # taken for a constant, the first batch's tensors would be baked into the graph
        path, cls = hidden[0]
        raise ValueError(f"{path_text(path, root_names)} is a {cls.__module__}.{cls.__qualname__} that keeps its "
                         "tensors in private attributes, with no to_dict(): they cannot be read as its inputs. Give "
                         "the class public fields or a to_dict(), or set parity.input to a function returning "
                         "the tensors the target takes")
    same = [c for c in calls if tree_of_call(c.call).same_structure(tree)]
    notes = [] if len(same) == len(calls) else [
        f"{len(calls) - len(same)} of {len(calls)} calls had another structure (other arguments or flags) and were "
        "left out"]
    paths = tree.leaf_paths()
    names = tree.leaf_names(root_names)
    leaves = [tree.leaves(c.call) for c in same]
    outputs = [run(c.call) for c in same]
    out_tree = tree_of(outputs[0])
    out_leaves = [out_tree.leaves(o) if tree_of(o).same_structure(out_tree) else None for o in outputs]
    if any(o is None for o in out_leaves):
        raise ValueError("the model's outputs change structure from call to call; the calls: "
                         + "; ".join(_shapes_text(tree_of(o).leaves(o)) for o in outputs[:4]))
    shapes = [[tuple(t.shape) for t in ls] for ls in leaves] + [list(s) for s, _ in extra_shapes
                                                                if len(s) == len(paths)]
    counts = [c.samples for c in same] + [n for s, n in extra_shapes if len(s) == len(paths)]
    stochastic = _stochastic(same[0], out_leaves[0], rerun) if rerun is not None else set()
    sample = _sample_axis(same, leaves, out_leaves, shapes, counts, run, tree, stochastic)
    in_axes, out_axes = sample[1], sample[2]
    in_specs = [_leaf(names[i], path_text(paths[i], root_names), paths[i], leaves[0][i],
                      [s[i] for s in shapes], in_axes[i] if sample[0].proven else None)
                for i in range(len(paths))]
    out_paths = out_tree.leaf_paths()
    out_names = _output_names(out_tree)
    out_specs = [_leaf(out_names[i], "output" + path_text(out_paths[i]), out_paths[i], out_leaves[0][i], [tuple(o[i].shape) for o in out_leaves],  # type: ignore[index]
                       out_axes[i] if sample[0].proven else None, i in stochastic)
                 for i in range(len(out_paths))]
    keys = {}  # a variable dimension's sizes in the calls -> its name: equal sizes in every call, one name
    in_specs = _grouped(in_specs, [[s[i] for s in shapes[:len(same)]] for i in range(len(paths))], keys)
    out_specs = _grouped(out_specs, [[tuple(o[i].shape) for o in out_leaves] for i in range(len(out_paths))], keys)  # type: ignore[index]
    constants = [ConstSpec(path_text(path, root_names), tuple(path), value) for path, value in tree.constants()
                 if value is None or isinstance(value, (int, float, bool, str))]
    return Signature(in_specs, out_specs, sample[0], len(same), flat, notes, constants)


def _shapes_text(leaves: Sequence[torch.Tensor]) -> str:
    return ", ".join(str(list(t.shape)) for t in leaves)


def _leaf(name: str, path: str, steps: Sequence[Any], example: torch.Tensor, sizes: Sequence[Tuple[int, ...]],
          axis: Optional[int], stochastic: bool = False) -> LeafSpec:
    dims = []
    for d in range(example.dim()):
        seen = [s[d] for s in sizes if len(s) == example.dim()]
        if d == axis:
            kind = DimKind.sample
        elif len(set(seen)) > 1:
            kind = DimKind.variable
        else:
            kind = DimKind.fixed
        dims.append(DimSpec(kind, int(example.shape[d]), int(min(seen)), int(max(seen))))
    return LeafSpec(name, path, tuple((str(k), v) for k, v in steps), dtype_name(example.dtype), tuple(dims),
                    stochastic)


def _grouped(specs: List[LeafSpec], sizes: Sequence[Sequence[Tuple[int, ...]]],
             keys: Dict[Tuple[int, ...], str]) -> List[LeafSpec]:
    """Variable dimensions named ``n0``, ``n1``...: one name for dimensions whose sizes were equal in every call
    (``sizes``: each leaf's shape in each call)."""
    out = []
    for spec, shapes in zip(specs, sizes):
        groups: List[Optional[str]] = []
        for d, dim in enumerate(spec.dims):
            if dim.kind is not DimKind.variable:
                groups.append(None)
                continue
            key = tuple(s[d] for s in shapes if len(s) > d)
            groups.append(keys.setdefault(key, f"n{len(keys)}"))
        out.append(dataclasses.replace(spec, groups=tuple(groups)))
    return out


def _output_names(tree: Tree) -> List[str]:
    """Output names as manifests have always written them: a lone tensor ``output_0``; a sequence's items
    ``output_0``, ``output_1``; a named tuple's, mapping's, object's or distribution's fields by name; nested ones
    joined by dots."""
    if tree.kind == "tensor":
        return ["output_0"]
    names: List[str] = []

    def walk(node: Tree, prefix: str, top: bool) -> None:
        if node.kind == "tensor":
            names.append(prefix)
            return
        fields = getattr(node.cls, "_fields", None) if node.kind == "seq" else None
        for (kind, key), child in node.children:
            part = fields[key] if fields is not None and kind == "index" else \
                f"output_{key}" if kind == "index" and top else str(key)
            walk(child, f"{prefix}.{part}" if prefix else part, False)

    walk(tree, "", True)
    return names


def _stochastic(call: Observed, first: Sequence[torch.Tensor], rerun: Runner) -> set:
    """The outputs that change when the model runs again with another seed (a sample drawn in forward)."""
    again = rerun(call.call)
    other = tree_of(again).leaves(again)
    return {i for i, (a, b) in enumerate(zip(first, other))
            if a.shape != b.shape or not compare_outputs(b, a).passed}


def _sample_axis(calls: Sequence[Observed], leaves: Sequence[Sequence[torch.Tensor]],
                 outputs: Sequence[Optional[Sequence[torch.Tensor]]],
                 all_shapes: Sequence[Sequence[Tuple[int, ...]]], all_counts: Sequence[Optional[int]],
                 run: Runner, tree: Tree, stochastic: set) -> Tuple[SampleAxis, List[Optional[int]], List[Optional[int]]]:
    """Which input and output dimensions carry the samples, and the evidence (the outputs drawn at random in forward
    are left out of the experiments: their draws differ with the batch's shape)."""
    n_in = len(leaves[0])
    none_in: List[Optional[int]] = [None] * n_in
    none_out: List[Optional[int]] = [None] * len(outputs[0] or [])

    def refused(why: str) -> Tuple[SampleAxis, List[Optional[int]], List[Optional[int]]]:
        return SampleAxis(False, why), none_in, none_out

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
    best = max(range(len(calls)), key=lambda c: sizes_per_call[c])
    n = sizes_per_call[best]
    if n < 2:  # one sample: a second, made of the first's values in another order, is the probe
        verdict = _probe_second_row(calls[best].call, leaves[best], outputs[best], in_axes, compared, run, tree)  # type: ignore[arg-type]
        if not verdict[0]:
            return refused(f"{how}; every call observed had one sample, and {verdict[1]}")
        return SampleAxis(True, f"{how}, and rows are independent ({verdict[1]})", True), in_axes, out_axes
    verdict = _rows_independent(calls[best].call, leaves[best], outputs[best], in_axes, compared, n, run, tree,  # type: ignore[arg-type]
                                out_axes)
    if verdict is not None and not verdict[0]:
        return refused(f"{how}, but the samples are not independent: {verdict[1]}")
    assert verdict is not None
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


def _rows_independent(call: Call, leaves: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                      in_axes: Sequence[Optional[int]], out_axes: Sequence[Optional[int]], n: int, run: Runner,
                      tree: Tree, all_out_axes: Sequence[Optional[int]]) -> Optional[Tuple[bool, str, bool]]:
    """The experiment: (independent, what was seen, any_size). Rows ``k..n`` of every input on the axis replaced
    by copies of the first rows must leave the first ``k`` rows of every output unchanged; the first ``k`` rows
    alone must give them too (else only padding to a size seen is exact). ``out_axes``: the outputs compared
    (None: drawn at random, left out); ``all_out_axes``: every output's sample axis, for the structure check."""
    k = max(1, n // 2)
    index = torch.arange(n) % k
    replaced = [t.index_select(a, index.to(t.device)) if a is not None else t for t, a in zip(leaves, in_axes)]
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
    alone = [t.narrow(a, 0, k) if a is not None else t for t, a in zip(leaves, in_axes)]
    seen = f"replacing rows {k}..{n - 1} of {n} left rows 0..{k - 1} unchanged"
    try:
        out = run(tree.rebuild(alone))
    except Exception as exc:  # noqa: BLE001 - a model fixed to its batch size: pieces padded to that size only
        return True, seen + f"; the first rows alone make it raise {type(exc).__name__}, so only padding to a " \
            "size seen is exact", False
    out_leaves = tree_of(out).leaves(out)
    if not _same_structure(out_leaves, outputs, all_out_axes, k):  # malformed at k rows, as if it raised: pad only
        return True, seen + f"; the first rows alone give outputs of another structure ({_shapes_text(out_leaves)}, " \
            f"not {_shapes_text(outputs)} with {k} rows), so only padding to a size seen is exact", False
    first = compare_outputs([o.narrow(a, 0, k) for o, a in zip(out_leaves, out_axes) if a is not None], want)
    if not first.passed:  # the outputs depend on how many rows there are: neither pieces nor padding are exact
        return False, f"{seen}, but the first {k} rows alone gave other outputs than in the batch of {n} (the " \
            f"outputs depend on the batch size): {first.describe()}", False
    return True, seen + "; the first rows alone gave the same outputs", True


def _same_structure(got: Sequence[Any], outputs: Sequence[torch.Tensor], out_axes: Sequence[Optional[int]],
                    k: int) -> bool:
    """Whether ``got`` (the outputs of ``k`` rows) has the batch's outputs' count, dtypes and shapes, ``k`` rows
    on each sample axis."""
    if len(got) != len(outputs):
        return False
    for g, o, a in zip(got, outputs, out_axes):
        want = list(o.shape)
        if a is not None:
            want[a] = k
        if not isinstance(g, torch.Tensor) or g.dtype != o.dtype or list(g.shape) != want:
            return False
    return True


def _probe_second_row(call: Call, leaves: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
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
    both = [torch.cat([t, p], dim=a) if a is not None else t for t, p, a in zip(leaves, probe, in_axes)]
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


def shape_problem(specs: Sequence[LeafSpec], leaves: Sequence[Any], built: Optional[Sequence[Sequence[int]]] = None
                  ) -> Optional[str]:
    """Why flat ``leaves`` do not fit ``specs`` (None: they do): the leaf, the dimension, its kind and what came.
    ``built``: the shapes a static artifact was built for (its fixed dimensions beyond the signature's)."""
    if len(leaves) != len(specs):
        return f"{len(leaves)} input tensors given, the artifact takes {len(specs)} ({', '.join(s.name for s in specs)})"
    for i, (spec, t) in enumerate(zip(specs, leaves)):
        if not isinstance(t, torch.Tensor):
            return f"input {spec.name} ({spec.path}) is a {type(t).__name__}, not a tensor"
        if t.dim() != len(spec.dims):
            return f"input {spec.name} ({spec.path}) has {t.dim()} dimensions ({list(t.shape)}), the artifact takes " \
                   f"{len(spec.dims)} ({spec.shape})"
        for d, dim in enumerate(spec.dims):
            size = int(t.shape[d])
            static = built[i][d] if built is not None else (dim.size if dim.kind is DimKind.fixed else None)
            if static is not None and size != static:
                what = {DimKind.fixed: "a fixed size", DimKind.sample: "the sample axis",
                        DimKind.variable: f"a size that varied ({dim.low}..{dim.high} seen)"}[dim.kind]
                return (f"input {spec.name} ({spec.path}) dim {d} is {size}; the artifact was built for {static} "
                        f"there ({what}{', exported for that size only' if dim.kind is not DimKind.fixed else ''})")
    rows = {f"{spec.name} dim {spec.sample_axis}": int(t.shape[spec.sample_axis])
            for spec, t in zip(specs, leaves) if spec.sample_axis is not None}
    if len(set(rows.values())) > 1:  # one number of samples per call: pieces of one would cut the others wrong
        return "the inputs on the sample axis hold different numbers of samples (" + \
            ", ".join(f"{where}: {n}" for where, n in rows.items()) + "); every input takes the same number"
    return None


def with_raw_input(signature: Signature, raw: torch.Tensor, channels_last: bool) -> Signature:
    """The signature of a model behind the raw-input prologue (``export.preprocess``): its first input is the raw
    image, in ``raw``'s dtype and, for ``channels_last``, with the channels moved last."""
    first = signature.inputs[0]
    order = [0, 2, 3, 1] if channels_last and len(first.dims) == 4 else list(range(len(first.dims)))
    groups = first.groups or (None,) * len(first.dims)
    raw_leaf = dataclasses.replace(first, dtype=dtype_name(raw.dtype), dims=tuple(first.dims[i] for i in order),
                                   groups=tuple(groups[i] for i in order))
    return dataclasses.replace(signature, inputs=[raw_leaf, *signature.inputs[1:]])
