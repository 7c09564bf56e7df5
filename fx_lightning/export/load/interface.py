"""An artifact behind the interface its :class:`~fx_lightning.signature.signature.Signature` describes, for ``load_fused``.

- **Inputs.** A flat artifact (one tensor per input leaf) is called with its leaves in order, by name
  (``model(bmg_V=..., bmg_E=...)``), or with the original arguments (any object with the recorded fields, a dict
  with the recorded keys): they are flattened by the recorded paths, so no training code is needed.
- **Sizes.** Each input is checked against the signature before the runtime sees it: a fixed dimension must have
  its size, and an artifact built for the example's sizes only (its sizes could not stay dynamic) takes those sizes
  only. The error names the input, the dimension and what was observed, instead of a runtime's guard message.
- **Outputs.** A runtime that returns its outputs flat (ONNX Runtime, OpenVINO) gets them nested again as the
  signature records them (``{'logits': ..., 'backbone_features': ...}``, ``(qz: {loc, scale}, z)``).
"""

from __future__ import annotations

import types
from typing import Any, Dict, List, Mapping, MutableMapping, Optional, Sequence, Tuple

import torch
from torch import nn

from fx_lightning.capture.working_copy import set_eval
from fx_lightning.common.batches import flat_tensors
from fx_lightning.common.calls import Call, Step, path_text, tree_of_call, value_at
from fx_lightning.errors import ExportError
from fx_lightning.formats.batching import BatchPieces
from fx_lightning.signature.absent import leaf_steps, repeated_for_all, stand_in, with_none_at
from fx_lightning.signature.conditions import condition_holds, failed_condition
from fx_lightning.signature.item_list import given_length, run_in_pieces
from fx_lightning.signature.padding import crop_outputs, pad_inputs, padded_sizes
from fx_lightning.signature.signature import LeafSpec, Signature, rebuild_outputs, shape_problem, static_sizes
from fx_lightning.signature.value_guards import refusal

__all__ = ["ArtifactInterface", "FromLeaves", "nest_outputs", "for_sizes"]


class ArtifactInterface(nn.Module):
    """``module`` (a loaded artifact) called as ``signature`` says. ``built``: the input shapes a static artifact is
    built for (None: it takes the sizes the signature marks as varying). ``as_the_module``: called by a person as the
    model was (``load_fused``), so its tensors alone leave out the arguments built in, which means forward's defaults
    (refused where the artifact was built with another value); else by the package with the artifact's own inputs
    (its check, the selection's timing, a server)."""

    def __init__(self, module: nn.Module, signature: Signature, built: Optional[List[List[int]]] = None,
                 what: str = "artifact", as_the_module: bool = False, guards: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.module = module
        self.guards = guards  # the value guards' program (signature.value_guards), run on every call first
        self.signature = signature
        self.built = built
        self.what = what
        self.names = [leaf.name for leaf in signature.inputs]
        # Its own inputs alone, by position or name, are taken as its call unless they could be the model's call
        # too (each input is an argument of forward) leaving out a built-in value whose default is another one.
        self.inputs_alone = not (as_the_module and any(c.default is not None for c in signature.constants)
                                 and all(len(leaf.steps) == 1 for leaf in signature.inputs))
        # What every call's tensors must fit, worked out once: at 1-3 ms a call, the Python run per call is part of
        # the latency (after an idle gap, cold caches make it several times its hot cost).
        self._fits = [(len(leaf.dims), [(d, size) for d, size in enumerate(static_sizes(leaf, built[i] if built is not None else None))
                                        if size is not None], leaf.sample_axis)
                      for i, leaf in enumerate(signature.inputs)]
        self._one_for_all = any(leaf.one_for_all for leaf in signature.inputs)
        self._drops = any(leaf.absent_drops for leaf in signature.inputs)
        self._one_tensor_out = (signature.output_tree or {}).get("kind") == "tensor"
        set_eval(self)  # not .eval(): torch.export's unlifted module refuses it

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # the runtime's own attributes (a session, a compiled model) through the interface
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None:
                raise
            return getattr(inner, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        items = self.signature.items
        if items is not None and (args or kwargs):
            call = self._as_observed(Call(args, kwargs))
            given = given_length(items, call)
            if given is not None and given != items.length:
                if given == 0:
                    raise ExportError(f"{self.what}: the list {path_text((items.argument,))} is empty; it takes one "
                                      "or more items")
                return run_in_pieces(items, call, lambda piece: self.forward(*piece.args, **piece.kwargs))
        call_args = self._arguments(args, kwargs)
        if self._one_for_all:
            call_args = self._repeated(call_args)
        tensors = [a for a in call_args if isinstance(a, torch.Tensor)]
        if self.guards is not None:
            try:
                self.guards(*call_args)
            except Exception as exc:  # noqa: BLE001 - a call the guards cannot even read is refused too
                raise refusal(self.what, self.signature.value_guards, exc) from None
        if not self._fit(tensors):
            sizes = padded_sizes(self.signature, tensors) if self.signature.padded and self.built is None and \
                shape_problem(self.signature.inputs, tensors, self.built) is None else None
            if sizes is not None:  # padded to a size the conditions take, as the model pads, and cropped back
                padded = pad_inputs(self.signature, list(call_args), sizes) if len(tensors) == len(call_args) else None
                if padded is not None:
                    return crop_outputs(self.signature, self._run(padded, self.signature.samples_in(padded)), sizes)
            problem = shape_problem(self.signature.inputs, tensors, self.built) or failed_condition(
                self.signature.conditions, tensors, self.names)
            if problem is not None:
                raise ExportError(f"{self.what}: {problem}")
        out = self._run(call_args, self.signature.samples_in(tensors))
        if self._drops:  # the outputs the model gives as None without an input left out
            paths = self._dropped(args, kwargs)
            out = with_none_at(out, paths) if paths else out
        returned = self.signature.returns_argument
        if returned is not None and isinstance(out, Mapping):  # as the model: the caller's mapping, updated
            try:
                given = value_at(self._as_observed(Call(args, kwargs)), (returned,))
            except (KeyError, IndexError, AttributeError, TypeError):
                return out
            if isinstance(given, MutableMapping):
                given.update(out)
                return given
        return out

    def _run(self, call_args: Sequence[Any], samples: Optional[int]) -> Any:
        """The runtime on ``call_args`` (which fit), its outputs nested as the signature records them."""
        out = self.module(*call_args)
        if self._one_tensor_out and isinstance(out, torch.Tensor):
            return out
        tree = self.signature.output_tree
        if tree is not None:
            leaves = flat_tensors(out)
            if len(leaves) == len(self.signature.outputs):  # the containers as recorded (named tuples included)
                return rebuild_outputs(tree, leaves, samples)
        return nest_outputs(out, self.signature.outputs)

    def _dropped(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[Tuple[Tuple[str, Any], ...]]:
        """The paths of the outputs that are None in this call: those of each input it leaves out whose absence the
        model answers with None there (:attr:`~fx_lightning.signature.signature.LeafSpec.absent_drops`)."""
        call = self._as_observed(Call(args, kwargs))
        paths = []
        for leaf in self.signature.inputs:
            if not leaf.absent_drops:
                continue
            try:
                given = value_at(call, leaf_steps(leaf))
            except (KeyError, IndexError, AttributeError, TypeError):
                given = None
            if given is None:
                paths += [leaf_steps(self.signature.outputs[i]) for i in leaf.absent_drops]
        return paths

    def _repeated(self, values: Tuple[Any, ...]) -> Tuple[Any, ...]:
        """``values`` with one value given for every sample (a timestep) repeated for the call's samples."""
        rows = next((t.shape[spec.sample_axis] for spec, t in zip(self.signature.inputs, values)
                     if isinstance(t, torch.Tensor) and spec.sample_axis is not None and t.dim() > spec.sample_axis),
                    None)
        device = next((t.device for t in values if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        return tuple(repeated_for_all(leaf, value, rows, device) for leaf, value in zip(self.signature.inputs, values))

    def _fit(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` fit the signature (:func:`shape_problem` says why not, more slowly)."""
        if len(tensors) != len(self._fits):
            return False
        rows = None
        for t, (rank, fixed, axis) in zip(tensors, self._fits):
            shape = t.shape
            if len(shape) != rank or any(shape[d] != size for d, size in fixed):
                return False
            if axis is not None:
                if rows is not None and shape[axis] != rows:
                    return False
                rows = shape[axis]
        return all(condition_holds(c, tensors) for c in self.signature.conditions)

    def _arguments(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
        """The artifact's positional arguments from what the caller gave."""
        if self.inputs_alone and kwargs and not args and set(kwargs) == set(self.names) and all(
                isinstance(v, torch.Tensor) for v in kwargs.values()):
            return tuple(kwargs[n] for n in self.names)
        if not self.signature.flat:
            return self._positional(args, kwargs)
        if self.inputs_alone and not kwargs and len(args) == len(self.names) and all(isinstance(a, torch.Tensor)
                                                                                   for a in args):
            return args
        call = self._as_observed(Call(args, kwargs))
        self._refuse_unknown(call)
        for const in self.signature.constants:  # baked into the graph: another value would be ignored silently
            built = const.text if const.text is not None else repr(const.value)
            try:
                given = value_at(call, leaf_steps(const))
            except (KeyError, IndexError, AttributeError, TypeError):
                if const.default is None:
                    continue  # left out: the artifact computes with the value the calls had, forward's default
                raise ExportError(f"{self.what}: {const.path} left out, which the model takes as {const.default} "
                                  f"(forward's default); the artifact was built with {const.path}={built} (its value "
                                  "in the calls the export was built from) and computes with that value only: pass "
                                  f"{const.path}={built}, or export from steps whose calls leave it out") from None
            if not const.matches(given):
                raise ExportError(f"{self.what}: {const.path} is {given!r}; the artifact was built with "
                                  f"{const.path}={built} (its value in the calls the export was built from), and "
                                  "computes with that value only")
        values: List[Any] = []
        for leaf in self.signature.inputs:
            try:
                values.append(value_at(call, leaf_steps(leaf)))
            except (KeyError, IndexError, AttributeError, TypeError) as exc:
                if not leaf.unread and not leaf.optional:
                    wanted = ", ".join(f"{x.name} ({x.path})" for x in self.signature.inputs if not x.unread)
                    raise ExportError(f"{self.what}: cannot find its inputs in the arguments given "
                                      f"({type(exc).__name__}: {exc}); it takes {wanted}: by name, in that order, or "
                                      "as the original arguments") from None
                values.append(None)
        return tuple(values[i] if values[i] is not None or not (leaf.unread or leaf.optional) else
                     stand_in(self.signature.inputs, leaf, values)
                     for i, leaf in enumerate(self.signature.inputs))

    def _refuse_left_out(self, given: Sequence[Optional[str]]) -> None:
        """Refuse arguments the artifact's call leaves out (labels): the advice to export from calls that pass them
        cannot work, since every call did and they were left out."""
        left = [name for name in given if name is not None and name in self.signature.left_out]
        if left:
            raise ExportError(f"{self.what}: {', '.join(left)} given; the artifact's call leaves it out (the model "
                              "gave the same outputs without it on every call observed, the loss it computes from "
                              f"it aside: see the manifest's note labels_left_out): call it without {', '.join(left)}")

    def _positional(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
        """The inputs of an artifact that takes forward's arguments as they are, given by position or by name; one
        left out (or None) gets its proven stand-in (:mod:`~fx_lightning.signature.absent`), else is refused."""
        names = self.names
        if not kwargs and len(args) == len(names) and all(a is not None for a in args):  # every input, in order
            return args
        self._refuse_left_out([*(self.signature.argument_name(("arg", i)) for i in range(len(names), len(args))),
                               *kwargs])
        if len(args) > len(names):  # a runtime may answer for the first ones: refuse, naming them
            raise ExportError(f"{self.what}: takes {len(names)} input(s) ({', '.join(names)}); got {len(args)}"
                              + _NEVER_OBSERVED.format(first=len(names) + 1))
        unknown = [k for k in kwargs if k not in names[len(args):]]
        if unknown:
            raise ExportError(f"{self.what}: takes its inputs by position or by name ({', '.join(names)}); got "
                              f"keyword argument(s) {', '.join(unknown)}"
                              + (" given by position too" if set(unknown) & set(names) else
                                 ", which no call the export was built from passed (the artifact computes as the "
                                 "model does without it: leave it out only if that is the call you want)"))
        values = [*args, *(kwargs.get(name) for name in names[len(args):])]
        missing = [leaf.name for leaf, value in zip(self.signature.inputs, values)
                   if value is None and not leaf.optional]
        if missing:
            raise ExportError(f"{self.what}: takes {len(names)} input(s) ({', '.join(names)}); got "
                              f"{len(names) - len(missing)}" + _ALWAYS_OBSERVED.format(missing=", ".join(missing)))
        return tuple(stand_in(self.signature.inputs, leaf, values) if value is None else value
                     for leaf, value in zip(self.signature.inputs, values))

    def _as_observed(self, call: Call) -> Call:
        """``call`` with each argument of forward written as the observed calls wrote it (by position or by name):
        ``model(ids, attention_mask=m)`` is the call the steps wrote ``model(input_ids=ids, attention_mask=m)``."""
        names = self.signature.arguments
        if not names:
            return call
        firsts = [leaf.steps[0] for leaf in [*self.signature.inputs, *self.signature.constants] if leaf.steps]
        by_name = {key for kind, key in firsts if kind == "kwarg"}
        by_position = {key for kind, key in firsts if kind == "arg"}
        args, kwargs = list(call.args), dict(call.kwargs)
        for i in range(len(args) - 1, -1, -1):  # trailing arguments the calls gave by name
            if i in by_position or i >= len(names) or names[i] not in by_name or names[i] in kwargs:
                break
            kwargs[names[i]] = args.pop()
        for i, name in enumerate(names):  # then arguments the calls gave by position, in order
            if i == len(args) and i in by_position and name and name in kwargs and name not in by_name:
                args.append(kwargs.pop(name))
        return Call(tuple(args), kwargs)

    def _refuse_unknown(self, call: Call) -> None:
        """An argument, key, field or item the artifact was not built from (a ``labels=`` keyword, a fifth tensor of a
        list built for two) would be ignored without a word: refused, naming it. A ``None`` where nothing was passed
        is what leaving it out means, and is taken."""
        known = {_normal(leaf_steps(leaf)) for leaf in self.signature.inputs}
        known |= {_normal(leaf_steps(c)) for c in self.signature.constants}
        tree = tree_of_call(call)
        given = [tuple(path) for path in tree.leaf_paths()]
        given += [tuple(path) for path, value in tree.constants() if value is not None]
        unknown = [path for path in given if _normal(path) not in known]
        self._refuse_left_out([self.signature.argument_name(p[0]) for p in unknown if len(p) == 1])
        if unknown:
            wanted = ", ".join(leaf.path for leaf in self.signature.inputs)
            raise ExportError(f"{self.what}: {', '.join(path_text(p) for p in unknown)} given, which the artifact was "
                              f"not built for (it takes {wanted}): the artifact computes what the model does without "
                              "it, which may not be what this call asks for (a flag such as rev=True); leave it out "
                              "only if that is the call you want, else export from calls that pass it")


# Class 4 of the zero-configuration refusals: the served call passes what no observed call did (speechbrain's
# encode_batch passes wav_lens; its training recipe never does), so nothing shows what the model does with it.
_NEVER_OBSERVED = (": no call the export was built from (the training and validation calls observed, or the example "
                   "inputs) passed an argument from position {first} on, so the artifact was not built with one (it "
                   "computes as the model does without it). Leave it out, or pass it in the calls the training and "
                   "validation steps make, and the export takes it")


# The served call leaves out an input every observed call passed (Wav2Vec2's attention_mask, None by default):
# the artifact was built with it, and nothing shows what the model computes without it.
_ALWAYS_OBSERVED = (": {missing} left out, which every call the export was built from (the training and validation "
                    "calls observed) passed, so the artifact computes with it and nothing shows what the model does "
                    "without it: pass it as those calls did")


def _normal(path: Tuple[Step, ...]) -> Tuple[Step, ...]:
    """``path`` with a field and a key the same step: a dict with the recorded keys stands for an object."""
    return tuple(("key" if kind == "attr" else str(kind), key) for kind, key in path)


def nest_outputs(out: Any, specs: Sequence[LeafSpec]) -> Any:
    """``out`` nested as ``specs`` record the outputs, when a runtime returned them flat (a tensor, or a tuple of
    them); as it is when it already has their nesting."""
    steps = [leaf_steps(s) for s in specs]
    if not steps or all(len(s) == 0 for s in steps):
        return out
    leaves = flat_tensors(out)
    if len(leaves) != len(specs):
        return out
    flat_runtime = isinstance(out, torch.Tensor) or (isinstance(out, (tuple, list)) and
                                                     all(isinstance(o, torch.Tensor) for o in out))
    if not flat_runtime or all(len(s) == 1 and s[0][0] == "index" for s in steps):
        return out
    return _nested(list(zip(steps, leaves)), objects=False)


class FromLeaves(nn.Module):
    """A model called as the original is (the unfused target, loaded from its training code), behind the
    artifact's flat interface: the leaves are put back where ``signature`` records them (positional and keyword
    arguments, dict keys, and the fields of a stand-in object for a library's batch type), so an artifact and the
    model it came from can be timed on the same inputs."""

    def __init__(self, module: nn.Module, signature: Signature) -> None:
        super().__init__()
        self.module = module
        self.signature = signature

    def forward(self, *leaves: Any) -> Any:
        call = _nested([(leaf_steps(leaf), value) for leaf, value in zip(self.signature.inputs, leaves)], objects=True)
        call = call if isinstance(call, Call) else Call((call,))
        return self.module(*call.args, **call.kwargs)


def _nested(items: List[Tuple[Tuple[Step, ...], Any]], objects: bool) -> Any:
    """Plain containers holding each value at its path: a :class:`Call` for arguments, tuples for indices, dicts for
    keys, and for fields plain objects (``objects``) or dicts (outputs, as a runtime returns them)."""
    if len(items) == 1 and not items[0][0]:
        return items[0][1]
    groups: Dict[Any, List[Tuple[Tuple[Step, ...], Any]]] = {}
    kinds: Dict[Any, str] = {}
    for path, value in items:
        (kind, key), rest = path[0], path[1:]
        kinds[key] = kind
        groups.setdefault((kind, key), []).append((rest, value))
    values = {key: _nested(v, objects) for (kind, key), v in groups.items()}
    kind_set = set(kinds.values())
    if kind_set <= {"arg", "kwarg"}:
        args = tuple(values[k] for k in sorted(k for k, kd in kinds.items() if kd == "arg"))
        return Call(args, {k: values[k] for k, kd in kinds.items() if kd == "kwarg"})
    if kind_set == {"index"}:
        return tuple(values[k] for k in sorted(values))
    if kind_set == {"attr"} and objects:
        return types.SimpleNamespace(**values)
    return values


def for_sizes(module: nn.Module, signature: Signature, shapes: Sequence[Sequence[int]], what: str) -> nn.Module:
    """``module``, fixed to the input ``shapes``, behind its signature: another number of samples runs as pieces of
    the one it takes along a proven sample axis; any other size is refused, naming the input and the dimension."""
    axes = signature.input_axes() if signature.batched else [None] * len(signature.inputs)
    rows = next((shape[a] for shape, a in zip(shapes, axes) if a is not None), None)
    if rows is not None:
        module = BatchPieces({str(rows): module}, axes, signature.output_axes(), what=what, warn=False)
    built = [[None if d == a else int(size) for d, size in enumerate(shape)] for shape, a in zip(shapes, axes)]
    return ArtifactInterface(module, signature, built, what=what)
