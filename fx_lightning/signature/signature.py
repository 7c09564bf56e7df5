"""How an artifact is called: one :class:`Signature` derived from calls that were observed, never guessed.

Every input and output leaf (a tensor, named by where it sits in the call) with its dtype and, per dimension,
what the calls showed: a **fixed** size, the **sample** axis, or a **variable** size. The sample axis is recorded
only where it is proven, by the experiment in :mod:`fx_lightning.signature.sample_axis` (it follows the loader's sample
counts, and rows replaced or run alone leave the others' outputs unchanged), else refused with the reason.

Everything that needs to know how an artifact is called reads the signature: capture and ``dynamic_shapes``
(:mod:`fx_lightning.signature.program`), the manifest's contract, ``load_fused``'s pieces and padding (only on a proven
sample axis), the server's batching, the Triton dims and ``bench``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Collection, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from fx_lightning.common.json_views import JsonObject, dtype_name
from fx_lightning.common.calls import Call, Tree, path_text, tree_of, tree_of_call
from fx_lightning.parity.compare import compare_outputs
from fx_lightning.signature.constants import unread_constant
from fx_lightning.signature.forms import CallForm
from fx_lightning.signature.item_list import ItemList, find_item_list
from fx_lightning.signature.outputs import (UnreturnableOutput, class_at, describe_outputs, rebuild_outputs,
                                            unreturnable_output)
from fx_lightning.signature.sample_axis import (Observed, Runner, SampleAxis, find_sample_axis, probe_sizes,
                                               shapes_text, stochastic_outputs)

__all__ = ["DimKind", "DimSpec", "LeafSpec", "ConstSpec", "SampleAxis", "Signature", "Observed", "derive_signature",
           "shape_problem", "static_sizes", "with_raw_input", "describe_outputs", "rebuild_outputs", "class_at",
           "unreturnable_output", "UnreturnableOutput", "StateBetweenCalls"]


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
    unread: bool = False  # an input the captured graph never reads: a caller may leave it out (zeros stand in)
    # What stands in for an argument a caller leaves out (forward's default None), proven by experiment to give what
    # the model computes without it: a mask of ones (:mod:`~fx_lightning.signature.absent`). None: it must be given.
    absent_fill: Optional[float] = None
    # Or the size of this variable dimension of the inputs given (a group of ``groups``) stands in for every value: the
    # lengths of a batch without padding (torchaudio's wav2vec2 ``lengths``, None meaning every sample is whole).
    absent_size_of: Optional[str] = None
    # The outputs (indices into the signature's outputs) the model gives as None when this input is left out
    # (torchaudio's wav2vec2 returns ``(x, None)`` without lengths): None in a call that leaves it out.
    absent_drops: Tuple[int, ...] = ()
    # A per-sample input (its one dimension the sample axis) that a caller may give as one value for every sample (a
    # diffusion model's timestep: an int or a 0-d tensor in the sampling loop), proven by experiment to mean that.
    one_for_all: bool = False

    @property
    def optional(self) -> bool:
        """Whether a caller may leave this input out: a stand-in was proven (:mod:`~fx_lightning.signature.absent`)."""
        return self.absent_fill is not None or self.absent_size_of is not None

    @property
    def sample_axis(self) -> Optional[int]:
        return next((i for i, d in enumerate(self.dims) if d.kind is DimKind.sample), None)

    @property
    def shape(self) -> List[Any]:
        """Each dimension as written: the size (fixed), ``"batch"`` (the sample axis), a name (variable)."""
        groups = self.groups or (None,) * len(self.dims)
        return [d.size if d.kind is DimKind.fixed else "batch" if d.kind is DimKind.sample else (g or "dynamic")
                for d, g in zip(self.dims, groups)]

    @property
    def example_shape(self) -> List[int]:
        return [d.size for d in self.dims]

    def sizes(self, any_samples: bool = True) -> List[Optional[int]]:
        """The size a caller sends per dimension, None where any goes (the sample axis too with ``any_samples``)."""
        return [None if d.kind is DimKind.variable or (d.kind is DimKind.sample and any_samples) else d.size
                for d in self.dims]

    def written_shape(self, any_samples: bool = True) -> List[Any]:
        """The shape as a manifest's ``inputs`` and ``outputs`` (and the server's ``/info``) write it: ``"batch"`` on
        a sample axis of any size (else its size), a name where a size varies."""
        return [token if size is None else size for token, size in zip(self.shape, self.sizes(any_samples))]

    def to_dict(self) -> Dict[str, object]:
        flags = {"stochastic": self.stochastic, "unread": self.unread}  # written only when set
        return {"name": self.name, "path": self.path, "steps": [list(s) for s in self.steps], "dtype": self.dtype,
                "shape": self.shape, "example_shape": self.example_shape,
                "sizes_seen": [[d.low, d.high] for d in self.dims], **{key: True for key, on in flags.items() if on},
                **({"absent_fill": self.absent_fill} if self.absent_fill is not None else {}),
                **({"absent_size_of": self.absent_size_of} if self.absent_size_of is not None else {}),
                **({"absent_drops": list(self.absent_drops)} if self.absent_drops else {}),
                **({"one_for_all": True} if self.one_for_all else {})}

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
                   steps_from_json(data.get("steps")), str(data["dtype"]), tuple(dims),
                   bool(data.get("stochastic", False)), tuple(groups), bool(data.get("unread", False)),
                   absent_fill=float(data["absent_fill"]) if data.get("absent_fill") is not None else None,
                   absent_size_of=str(data["absent_size_of"]) if data.get("absent_size_of") is not None else None,
                   absent_drops=tuple(int(i) for i in data.get("absent_drops") or ()),
                   one_for_all=bool(data.get("one_for_all", False)))


def steps_from_json(steps: Optional[Sequence[Sequence[Any]]]) -> Tuple[Tuple[str, Any], ...]:
    """Steps as JSON gave them back: a key JSON wrote as a list was a tuple (a dict key is never a list: a
    heterogeneous graph's edge types, ``("user", "rates", "item")``)."""
    return tuple((str(kind), _hashable(key)) for kind, key in steps or [])


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


@dataclass(frozen=True)
class ConstSpec:
    """A constant of the observed calls (a flag, a count: the same in every call), baked into the graph: a caller
    who passes the original arguments must pass this value there, or leave it out."""

    path: str
    steps: Tuple[Tuple[str, Any], ...]
    value: Union[int, float, bool, str, None]
    # A value JSON cannot hold as it is (an enum, a tuple, a torch.dtype): its repr, which a given value must match.
    text: Optional[str] = None
    # Shown by experiment not to change the outputs (:func:`unread_constant`: the values tried): any value is taken.
    unread: Optional[str] = None
    # forward's default for it (repr) where that is another value: a call leaving it out means that one, refused.
    default: Optional[str] = None

    @classmethod
    def of(cls, path: str, steps: Tuple[Tuple[str, Any], ...], value: Any, unread: Optional[str] = None
           ) -> "ConstSpec":
        if value is None or (type(value) in (int, float, bool, str)):
            return cls(path, steps, value, None, unread)
        return cls(path, steps, None, repr(value), unread)

    def matches(self, given: Any) -> bool:
        """Whether ``given`` is the value the artifact was built with (by value: an enum as the same member), or any
        value where the constant was shown not to change the outputs."""
        if self.unread is not None:
            return True
        if self.text is not None:
            return repr(given) == self.text
        return type(given) is type(self.value) and given == self.value

    def to_dict(self) -> Dict[str, object]:
        given = {"repr": self.text, "unread": self.unread, "default": self.default}
        return {"path": self.path, "steps": [list(s) for s in self.steps], "value": self.value,
                **{key: value for key, value in given.items() if value is not None}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ConstSpec":
        text, unread, default = (None if data.get(k) is None else str(data[k]) for k in ("repr", "unread", "default"))
        return cls(str(data["path"]), steps_from_json(data.get("steps")), data.get("value"),
                   text, unread, default)


SHOWN_TO_VARY = "sizes that did not vary shown to vary by a call with them resized: "
FIXED_AGAIN = "sizes shown to vary by a call with them resized, fixed again (no capture kept them dynamic): "


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
    # The outputs' containers (:func:`describe_outputs`): named tuples and dataclasses come back as such on load.
    output_tree: Optional[JsonObject] = None
    # Calls of other sizes made by the experiments (:func:`~fx_lightning.signature.sample_axis.probe_sizes`): every artifact is
    # checked on them too. Not written to the manifest.
    examples: List[Call] = field(default_factory=list)
    # Output constants that counted the call's samples in every call (paths into the outputs, not written to the
    # manifest: ``samples`` in ``output_tree`` says it), and the (input leaf, dim) whose size they are.
    sample_count_outputs: List[Tuple[Any, ...]] = field(default_factory=list)
    count_dim: Optional[Tuple[int, int]] = None
    # Keyword arguments every call carried that the artifact's call leaves out, proven by experiment (labels for a
    # loss computed in forward: :func:`~fx_lightning.pipeline.inputs.without_labels`).
    left_out: List[str] = field(default_factory=list)
    # forward's arguments that can be given by position or by name, in order ("" for one taken by position only):
    # a call may write each either way, whichever way the observed calls wrote it.
    arguments: List[str] = field(default_factory=list)
    # A list argument whose items are samples, proven by experiment (:mod:`~fx_lightning.signature.item_list`): a list
    # of another length runs as pieces of the length the artifact takes.
    items: Optional[ItemList] = None
    # Conditions on the input leaves' sizes (torch.export's guards on a branch the model takes on a size:
    # :mod:`~fx_lightning.signature.conditions`): a call that fails one is refused by name.
    conditions: List[str] = field(default_factory=list)
    # Groups of input sizes (``LeafSpec.groups``) a call failing a condition may be zero-padded along, its outputs
    # cropped back, proven by experiment (:mod:`~fx_lightning.signature.padding`: ConvTasNet's lengths).
    padded: List[str] = field(default_factory=list)
    # The argument (a step: ("arg", 0), ("kwarg", "features")) the model returns, updated in place (sentence-transformers
    # adds its embeddings to the features mapping it is given): the caller's own mapping is updated and returned.
    returns_argument: Optional[Tuple[str, Any]] = None
    # Other forms of the call, each exported beside the artifact as one of its own (:mod:`.forms`: ``rev=True``).
    forms: List[CallForm] = field(default_factory=list)
    # The model's branches on tensor values every observed call took one way (:mod:`.value_guards`): the export's guard
    # program (``value_guards.pt2``) refuses a call taking another way before any runtime runs.
    value_guards: List[str] = field(default_factory=list)

    def argument_name(self, step: Tuple[str, Any]) -> Optional[str]:
        """The name of forward's argument a call's first step is (by name, or by position through ``arguments``);
        None for one taken by position only or not known."""
        kind, key = step
        if kind == "kwarg":
            return str(key)
        if kind == "arg" and isinstance(key, int) and key < len(self.arguments):
            return self.arguments[key] or None
        return None

    def samples_in(self, leaves: Sequence[Any]) -> Optional[int]:
        """The number of samples of a call with these input leaves, for the outputs that count them."""
        if self.count_dim is None or len(leaves) <= self.count_dim[0]:
            return None
        return int(leaves[self.count_dim[0]].shape[self.count_dim[1]])

    def with_unread(self, names: Collection[str]) -> "Signature":
        """This signature with the inputs ``names`` marked as never read by the captured graph."""
        return dataclasses.replace(self, inputs=[dataclasses.replace(leaf, unread=leaf.name in names)
                                                 for leaf in self.inputs])

    def fixing_probed(self) -> "Signature":
        """This signature with the sizes only shown to vary by experiment (one size observed) fixed again: for a
        capture that cannot keep them dynamic."""
        def fixed(leaf: LeafSpec) -> LeafSpec:
            dims = tuple(DimSpec(DimKind.fixed, d.size, d.low, d.high) if d.kind is DimKind.variable and
                         d.low == d.high else d for d in leaf.dims)
            groups = tuple(None if d.kind is DimKind.fixed else g for d, g in
                           zip(dims, leaf.groups or (None,) * len(dims)))
            return dataclasses.replace(leaf, dims=dims, groups=groups)

        notes = [n.replace(SHOWN_TO_VARY, FIXED_AGAIN) for n in self.notes]
        return dataclasses.replace(self, inputs=[fixed(x) for x in self.inputs], outputs=[fixed(x) for x in self.outputs],
                                   examples=[], notes=notes)

    @property
    def probed(self) -> bool:
        """Whether a size is variable only by experiment (one size observed)."""
        return bool(self.probed_dims())

    def probed_dims(self) -> str:
        """The sizes variable only by experiment, in words (``input_ids dim 1 (16)``); "" when there are none."""
        return ", ".join(f"{leaf.name} dim {i} ({d.size})" for leaf in self.inputs for i, d in enumerate(leaf.dims)
                         if d.kind is DimKind.variable and d.low == d.high)

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
                "notes": list(self.notes), "constants": [c.to_dict() for c in self.constants],
                **({"output_tree": self.output_tree} if self.output_tree is not None else {}),
                **({"count_dim": list(self.count_dim)} if self.count_dim is not None else {}),
                **({"left_out": list(self.left_out)} if self.left_out else {}),
                **({"arguments": list(self.arguments)} if self.arguments else {}),
                **({"item_list": dict(self.items.to_dict())} if self.items is not None else {}),
                **({"conditions": list(self.conditions)} if self.conditions else {}),
                **({"padded": list(self.padded)} if self.padded else {}),
                **({"returns_argument": list(self.returns_argument)} if self.returns_argument else {}),
                **({"forms": [f.to_dict() for f in self.forms]} if self.forms else {}),
                **({"value_guards": list(self.value_guards)} if self.value_guards else {})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Signature":
        sample = data.get("sample_axis") or {}
        return cls([LeafSpec.from_dict(s) for s in data.get("inputs") or []],
                   [LeafSpec.from_dict(s) for s in data.get("outputs") or []],
                   SampleAxis(bool(sample.get("proven", False)), str(sample.get("how", "")),
                              bool(sample.get("any_size", False))),
                   int(data.get("calls", 1)), bool(data.get("flat", False)), [str(n) for n in data.get("notes") or []],
                   [ConstSpec.from_dict(c) for c in data.get("constants") or []],
                   dict(data["output_tree"]) if isinstance(data.get("output_tree"), Mapping) else None,
                   count_dim=(int(data["count_dim"][0]), int(data["count_dim"][1])) if data.get("count_dim") else None,
                   left_out=[str(n) for n in data.get("left_out") or []],
                   arguments=[str(n) for n in data.get("arguments") or []],
                   items=ItemList.from_dict(data["item_list"]) if data.get("item_list") else None,
                   conditions=[str(c) for c in data.get("conditions") or []],
                   padded=[str(g) for g in data.get("padded") or []],
                   returns_argument=(str(data["returns_argument"][0]), data["returns_argument"][1])
                   if data.get("returns_argument") else None,
                   forms=[CallForm.from_dict(f) for f in data.get("forms") or []],
                   value_guards=[str(g) for g in data.get("value_guards") or []])


# ------------------------------------------------------------------------------------------ derivation


class StateBetweenCalls(ValueError):
    """The model's outputs depend on its earlier calls (state it keeps and updates, a spiking neuron's membrane, a
    cache): an artifact runs each call alone, so it cannot answer as the model does. Where the calls replace a
    buffer the model's code decides it, whatever the weights; written in place, a flag may (an observer)."""


def _refuse_state_between_calls(first: Observed, output: Any, run: Runner) -> None:
    """Run the first call again, with the same seed, after the others ran: other outputs mean the model answers
    from state its calls left (or from randomness no seed governs); raise :class:`StateBetweenCalls`."""
    again = run(first.call)
    tree, again_tree = tree_of(output), tree_of(again)
    other = again_tree.leaves(again) if again_tree.same_structure(tree) else None
    differs = [i for i, (a, b) in enumerate(zip(tree.leaves(output), other or [])) if not compare_outputs(b, a).passed]
    if other is None or differs:
        raise StateBetweenCalls(
            "the same call, run again with the same seed after the others, gave other outputs ("
            + (f"output {differs[0]}" if differs else "another structure") + "): the model answers from state its "
            "earlier calls left (or from randomness no seed governs), which an artifact running each call alone "
            "cannot keep")


def derive_signature(calls: Sequence[Observed], run: Runner, *, extra_shapes: Sequence[Tuple[List[Tuple[int, ...]],
                     Optional[int]]] = (), root_names: Optional[Sequence[str]] = None, flat: bool = False,
                     rerun: Optional[Runner] = None, probe: bool = False) -> Signature:
    """The signature the calls show. ``run`` runs the reference on a call; ``rerun`` runs it again with another
    RNG seed (outputs that change are stochastic). ``extra_shapes``: the input leaves' shapes (and sample counts)
    of more calls whose values were not kept, as evidence of which sizes vary. ``flat``: the artifact takes one
    tensor per input leaf. ``probe``: sizes that did not vary are resized once in an experiment (:func:`probe_sizes`),
    and stay dynamic where the model takes the other size."""
    if not calls:
        raise ValueError("derive_signature() needs at least one call")
    tree = tree_of_call(calls[0].call)
    hidden = tree.hidden_paths()
    if hidden:  # taken for a constant, the first batch's tensors would be baked into the graph
        path, cls = hidden[0]
        raise ValueError(f"{path_text(path, root_names)} is a {cls.__module__}.{cls.__qualname__} that keeps its "
                         "tensors in private attributes, with no to_dict(): they cannot be read as its inputs. Give "
                         "the class public fields or a to_dict(), or set parity.input to a function returning "
                         "the target's input with its tensors readable (an object with public fields or a to_dict())")
    same = [c for c in calls if tree_of_call(c.call).same_structure(tree)]
    notes = [] if len(same) == len(calls) else [
        f"{len(calls) - len(same)} of {len(calls)} calls had another structure (other arguments or flags) and were "
        "left out"]
    paths = tree.leaf_paths()
    names = tree.leaf_names(root_names)
    leaves = [tree.leaves(c.call) for c in same]
    outputs = [run(c.call) for c in same]
    # An int output that differs from call to call is part of the structure (an artifact would return the first
    # call's value: scvi-tools' LossOutput, measured wrong), unless it was the call's number of samples every time.
    counted, count_dim = _sample_counts([tree_of(o) for o in outputs], [[tuple(t.shape) for t in ls] for ls in leaves])
    out_tree = tree_of(outputs[0]).counting_samples(counted)
    _refuse_unreturnable(out_tree)
    out_leaves = [out_tree.leaves(o) if tree_of(o).counting_samples(counted).same_structure(out_tree) else None
                  for o in outputs]
    if any(o is None for o in out_leaves):
        raise ValueError("the model's outputs change structure from call to call; the calls: "
                         + "; ".join(shapes_text(tree_of(o).leaves(o)) for o in outputs[:4]))
    shapes = [[tuple(t.shape) for t in ls] for ls in leaves] + [list(s) for s, _ in extra_shapes
                                                                if len(s) == len(paths)]
    counts = [c.samples for c in same] + [n for s, n in extra_shapes if len(s) == len(paths)]
    _refuse_state_between_calls(same[0], outputs[0], run)
    stochastic = stochastic_outputs(same[0], out_leaves[0], rerun) if rerun is not None else set()
    sample, in_axes, out_axes = find_sample_axis(leaves, out_leaves, shapes, counts, run, tree, stochastic)
    proven = sample.proven
    # Sizes that did not vary are fixed only when the model cannot be shown to take others (probe_sizes).
    candidates = [(i, d) for i, t in enumerate(leaves[0]) for d in range(t.dim())
                  if not (proven and d == in_axes[i]) and len({s[i][d] for s in shapes if len(s[i]) > d}) == 1
                  and t.shape[d] > 1] if probe else []
    probe = probe_sizes(leaves[0], out_leaves[0], candidates, run, tree)  # type: ignore[arg-type]
    probed_in = {pair for group in probe.inputs for pair in group}
    in_specs = [_leaf(names[i], path_text(paths[i], root_names), paths[i], leaves[0][i],
                      [s[i] for s in shapes], in_axes[i] if proven else None,
                      probed={d for j, d in probed_in if j == i})
                for i in range(len(paths))]
    out_paths = out_tree.leaf_paths()
    out_names = _output_names(out_tree)
    out_specs = [_leaf(out_names[i], "output" + path_text(out_paths[i]), out_paths[i], out_leaves[0][i], [tuple(o[i].shape) for o in out_leaves],  # type: ignore[index]
                       out_axes[i] if proven else None, i in stochastic,
                       probed={d for j, d in probe.outputs if j == i})
                 for i in range(len(out_paths))]
    keys = {}  # a variable dimension's sizes in the calls -> its name: equal sizes in every call, one name
    in_specs = _grouped(in_specs, [[s[i] for s in shapes[:len(same)]] for i in range(len(paths))], keys)
    out_specs = _grouped(out_specs, [[tuple(o[i].shape) for o in out_leaves] for i in range(len(out_paths))], keys)  # type: ignore[index]
    # Every constant, whatever its type: one the artifact cannot check would be ignored when another is passed.
    constants = [ConstSpec.of(path_text(path, root_names), tuple(path), value,
                              unread_constant(tree, leaves[0], out_leaves[0], path, value, same[0].samples, run,
                                              tree_of(outputs[0])))  # type: ignore[arg-type]
                 for path, value in tree.constants()]
    if probe.inputs:
        notes.append(SHOWN_TO_VARY + ", ".join(
            f"{in_specs[i].name} dim {d}" for group in probe.inputs for i, d in group))
    items, why_not = find_item_list(same[0].call, outputs[0], run)
    if items is not None or why_not is not None:
        notes.append(f"a list whose items are samples: {items.how}" if items is not None else
                     f"no list whose items are samples: {why_not}; a list of another length is refused")
    if counted:
        leaf, dim = count_dim  # type: ignore[misc]
        notes.append(f"{len(counted)} int output(s) equal to {in_specs[leaf].name} dim {dim} in each of {len(same)} "
                     "calls (a row count): the artifact gives the size of the call at hand")
    return Signature(in_specs, out_specs, sample, len(same), flat, notes, constants, describe_outputs(out_tree),
                     [probe.call] if probe.call is not None else [], counted, count_dim, items=items)


def _refuse_unreturnable(tree: Tree) -> None:
    """Raise :class:`UnreturnableOutput` for an output that would come back as a dict of its fields: a changed
    structure, never given silently."""
    problem = unreturnable_output(tree)
    if problem is not None:
        raise UnreturnableOutput(problem)


def _sample_counts(trees: Sequence[Tree], shapes: Sequence[Sequence[Tuple[int, ...]]]
                   ) -> Tuple[List[Tuple[Any, ...]], Optional[Tuple[int, int]]]:
    """The int constants of the outputs that differ from call to call, each call's equal to the size of one input
    dimension (the number of rows a loss record counts), and that (leaf, dim): an int that follows an input's size
    in every call is that size. ``[], None`` when there is none, or no one dimension matches them all."""
    consts = [t.constants() for t in trees]
    if len(trees) < 2 or any([p for p, _ in c] != [p for p, _ in consts[0]] for c in consts):
        return [], None
    varying = [i for i in range(len(consts[0])) if len({repr(c[i][1]) for c in consts}) > 1
               and all(type(c[i][1]) is int for c in consts)]
    for leaf in range(len(shapes[0]) if varying else 0):
        for dim in range(len(shapes[0][leaf])):
            if all(len(s[leaf]) > dim and s[leaf][dim] == c[i][1] for s, c in zip(shapes, consts) for i in varying):
                return [consts[0][i][0] for i in varying], (leaf, dim)
    return [], None


def _leaf(name: str, path: str, steps: Sequence[Any], example: torch.Tensor, sizes: Sequence[Tuple[int, ...]],
          axis: Optional[int], stochastic: bool = False, probed: Collection[int] = ()) -> LeafSpec:
    """A leaf's spec; ``probed``: dimensions shown to vary by experiment (variable, though one size was seen)."""
    dims = []
    for d in range(example.dim()):
        seen = [s[d] for s in sizes if len(s) == example.dim()]
        if d == axis:
            kind = DimKind.sample
        elif len(set(seen)) > 1 or d in probed:
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
        groups = [keys.setdefault(tuple(s[d] for s in shapes if len(s) > d), f"n{len(keys)}")
                  if dim.kind is DimKind.variable else None for d, dim in enumerate(spec.dims)]
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


def static_sizes(spec: LeafSpec, built: Optional[Sequence[Optional[int]]] = None) -> List[Optional[int]]:
    """The one size each dimension of ``spec`` takes (None: any): ``built``, the shape a static artifact was built
    for, else the signature's fixed sizes."""
    return list(built) if built is not None else [d.size if d.kind is DimKind.fixed else None for d in spec.dims]


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
        for d, (dim, static) in enumerate(zip(spec.dims, static_sizes(spec, built[i] if built is not None else None))):
            size = int(t.shape[d])
            if static is not None and size != static:
                what = {DimKind.fixed: "a fixed size", DimKind.sample: "the sample axis",
                        DimKind.variable: f"a size that varied ({dim.low}..{dim.high} seen)" if dim.low != dim.high
                        else f"a size shown to vary by a call resized, only {dim.low} seen"}[dim.kind]
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
