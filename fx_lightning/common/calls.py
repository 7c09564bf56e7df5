"""How a module is called, as data: the arguments it received (:class:`Call`), their structure with the tensors
as named leaves (:class:`Tree`), and the two adapters that put a flat interface in front of a module and take it
away again.

People call models with more than tensors: a graph library's batch object, a chemistry library's dataclass, a dict
batch, keyword arguments; outputs can be ``torch.distributions`` objects, dataclasses or dicts. torch.export and
every runtime behind it take tensors in and give tensors out. So a call is flattened to its tensor leaves, each
named by where it sits (``bmg.V``, ``x['continuous']``, ``qz.loc``), and rebuilt from them:

- :class:`FlatCall` takes the leaves as named parameters, rebuilds the original arguments (the batch object, the
  dict) from the recorded :class:`Tree` and returns the outputs made plain (distributions as their parameters,
  dataclasses and objects as dicts of their fields): what capture and export trace.
- :class:`StructuredCall` goes the other way: a flat model behind the original interface (the user's objects in,
  the original output types out), so the fused model sits in the whole model exactly where the original was.

A leaf's name is an identifier (``bmg_V``), its ``path`` the readable place (``bmg.V``); paths are also recorded
as JSON steps so that a process without the training code can flatten a duck-typed object the same way.
"""

from __future__ import annotations

import contextlib
import collections
import copy
import dataclasses
import inspect
import keyword
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.fx
from torch import nn

from fx_lightning.common.seeding import python_random_seeded
from fx_lightning.common.objects import fresh_copy, set_field
from fx_lightning.common.mappings import own_mapping

__all__ = [
    "Call",
    "as_call",
    "Step",
    "Tree",
    "tree_of",
    "tree_of_call",
    "plain",
    "is_flat_call",
    "needs_flat_outputs",
    "FlatCall",
    "StructuredCall",
    "path_text",
    "value_at",
    "forward_parameter_names",
    "no_distribution_validation",
    "run_seeded",
    "distribution_params",
    "Interface",
    "map_leaves",
]


@dataclass
class Call:
    """One call of a module: its positional and keyword arguments."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any] = field(default_factory=dict)

    def run(self, module: Callable[..., Any]) -> Any:
        """``module`` on this call, its dicts and lists fresh copies: a forward that writes into its input dict
        (sentence-transformers' modules add their outputs to it) leaves the recorded call as it was."""
        return module(*(_fresh(a) for a in self.args), **{k: _fresh(v) for k, v in self.kwargs.items()})


def _fresh(value: Any) -> Any:
    """``value`` with its dicts and lists (and the plain tuples holding them) copied; tensors and objects shared."""
    if isinstance(value, dict):
        fresh = copy.copy(value)
        for key, item in value.items():
            fresh[key] = _fresh(item)
        return fresh
    if type(value) is list:
        return [_fresh(v) for v in value]
    if type(value) is tuple:
        return tuple(_fresh(v) for v in value)
    return value


def as_call(inputs: Any) -> Call:
    """Forward's arguments: a :class:`Call` as it is, a tuple as several positional arguments, anything else one."""
    if isinstance(inputs, Call):
        return inputs
    return Call(tuple(inputs) if isinstance(inputs, tuple) else (inputs,))


# A step into a value: ("arg", 0), ("kwarg", "V_d"), ("index", 1), ("key", "continuous"), ("attr", "loc").
Step = Tuple[str, Any]


@dataclass
class Tree:
    """The structure of a value with its tensors as leaves.

    ``kind``: ``tensor`` (a leaf), ``const`` (anything that is not a tensor: kept as it was), ``seq`` (tuple, list,
    named tuple), ``map`` (a mapping), ``dist`` (a ``torch.distributions`` object: its parameters), ``obj`` (a
    dataclass or an object whose fields hold tensors), ``call`` (a call's arguments). ``template``: the original
    object (``obj``, ``dist``, ``const``), so it can be rebuilt in this process."""

    kind: str
    cls: Optional[type] = None
    children: List[Tuple[Step, "Tree"]] = field(default_factory=list)
    template: Any = None
    hidden: bool = False  # a constant whose object holds tensors where they cannot be read (private attributes)
    counts_samples: bool = False  # a constant equal to the call's number of samples in every call observed
    # A mapping of another class than dict (transformers' BatchEncoding), and whether ``origin(dict)`` gives it back
    # with the same state: an artifact then returns that class, else the output is refused.
    origin: Optional[type] = None
    origin_rebuilds: bool = False

    # ------------------------------------------------------------------------------------------ leaves

    def leaf_paths(self) -> List[Tuple[Step, ...]]:
        """The path of every tensor leaf, in order."""
        if self.kind == "tensor":
            return [()]
        return [(step, *rest) for step, child in self.children for rest in child.leaf_paths()]

    def hidden_paths(self) -> List[Tuple[Tuple[Step, ...], type]]:
        """The path and class of every object holding tensors that cannot be read as its fields."""
        if self.kind == "const":
            return [((), self.cls)] if self.hidden and self.cls is not None else []
        return [((step, *rest), cls) for step, child in self.children for rest, cls in child.hidden_paths()]

    def constants(self) -> List[Tuple[Tuple[Step, ...], Any]]:
        """The path and value of every constant (a flag, a count): part of what a call means."""
        if self.kind == "const":
            return [((), self.template)]
        return [((step, *rest), value) for step, child in self.children for rest, value in child.constants()]

    def sample_count_paths(self) -> List[Tuple[Step, ...]]:
        """The path of every constant that counts the call's samples (:meth:`counting_samples`)."""
        if self.kind == "const":
            return [()] if self.counts_samples else []
        return [(step, *rest) for step, child in self.children for rest in child.sample_count_paths()]

    def counting_samples(self, paths: Sequence[Tuple[Step, ...]]) -> "Tree":
        """This structure with the constants at ``paths`` rebuilt as the number of samples of the call at hand (a
        loss record's row count) instead of the value first seen."""
        if not paths:
            return self
        if self.kind == "const":
            return dataclasses.replace(self, counts_samples=True) if () in paths else self
        children = [(step, child.counting_samples([p[1:] for p in paths if p and p[0] == step]))
                    for step, child in self.children]
        return dataclasses.replace(self, children=children)

    def leaves(self, value: Any) -> List[torch.Tensor]:
        """The tensors of ``value`` (which has this structure) in leaf order."""
        return [value_at(value, path) for path in self.leaf_paths()]

    def same_structure(self, other: "Tree") -> bool:
        """The same nesting, leaves and constants (a call with another flag is another structure)."""
        if self.kind != other.kind or len(self.children) != len(other.children):
            return False
        if self.kind == "const":
            return (self.counts_samples and other.counts_samples) or _same_constant(self.template, other.template)
        if self.kind in ("obj", "dist", "seq", "map") and self.cls is not other.cls:
            return False
        return all(a == b and ca.same_structure(cb) for (a, ca), (b, cb) in zip(self.children, other.children))

    # ---------------------------------------------------------------------------------------- rebuild

    def rebuild(self, leaves: Sequence[Any], samples: Optional[int] = None) -> Any:
        """The value in its original types (this process has the classes), with ``leaves`` in place (and
        ``samples`` for the constants that count them)."""
        return self._rebuild(iter(leaves), False, samples)

    def plain(self, leaves: Sequence[Any]) -> Any:
        """The value with ``leaves`` in place, in plain containers: sequences as tuples/lists, mappings, objects and
        distributions as dicts of their fields (what torch.export, a saved program and a runtime can carry)."""
        return self._rebuild(iter(leaves), True, None)

    def _rebuild(self, it: Iterator[Any], plain: bool, samples: Optional[int]) -> Any:
        if self.kind == "tensor":
            return next(it)
        if self.kind == "const":
            return samples if self.counts_samples and samples is not None else self.template
        parts = [(step, child._rebuild(it, plain, samples)) for step, child in self.children]
        if self.kind == "call":
            args = tuple(v for (kind, _), v in parts if kind == "arg")
            return Call(args, {k: v for (kind, k), v in parts if kind == "kwarg"})
        if self.kind == "seq":
            items = [v for _, v in parts]
            if plain or self.cls in (tuple, list):
                return tuple(items) if issubclass(self.cls or tuple, tuple) else list(items)
            return self.cls._make(items) if hasattr(self.cls, "_make") else self.cls(items)  # type: ignore[union-attr]
        if self.kind == "map" and not plain and self.cls is collections.OrderedDict:
            return collections.OrderedDict((key, v) for (_, key), v in parts)
        if self.kind == "map" and not plain and self.origin is not None:
            again = own_mapping(self.origin, self.origin_rebuilds, self.template, {key: v for (_, key), v in parts})
            if again is not None:
                return again
        if self.kind == "map" or plain:
            return {key: v for (_, key), v in parts}
        if self.kind == "dist":
            return _rebuilt_distribution(self, {key: v for (_, key), v in parts})
        obj = fresh_copy(self.template)  # keeps the fields that hold no tensor; init=False fields, slots, frozen
        for (_, key), v in parts:
            set_field(obj, key, v)
        return obj

    # ------------------------------------------------------------------------------------------ names

    def leaf_names(self, root_names: Optional[Sequence[str]] = None) -> List[str]:
        """An identifier per leaf: the path's parts joined by ``_`` (``bmg_V``), positional arguments named by
        ``root_names`` (forward's parameters), made unique."""
        names: List[str] = []
        for path in self.leaf_paths():
            parts = [_part(step, root_names) for step in path] or ["output"]
            base = _identifier("_".join(parts))
            name, n = base, 1
            while name in names:
                n += 1
                name = f"{base}_{n}"
            names.append(name)
        return names


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a usable ==: the same object only
        return a is b


def _part(step: Step, root_names: Optional[Sequence[str]]) -> str:
    kind, key = step
    if kind == "arg":
        return root_names[key] if root_names is not None and key < len(root_names) else f"arg{key}"
    return str(key)


def _identifier(text: str) -> str:
    name = re.sub(r"\W", "_", text).strip("_") or "input"
    if name[0].isdigit() or keyword.iskeyword(name):
        name = "_" + name
    return name


def path_text(path: Sequence[Step], root_names: Optional[Sequence[str]] = None) -> str:
    """A leaf's place as people write it: ``bmg.V``, ``x['continuous']``, ``output[0].loc``."""
    text = ""
    for kind, key in path:
        if kind == "arg":
            text += root_names[key] if root_names is not None and key < len(root_names) else f"args[{key}]"
        elif kind == "kwarg":
            text += str(key)
        elif kind == "index":
            text += f"[{key}]"
        elif kind == "key":
            text += f"[{key!r}]"
        else:
            text += f".{key}"
    return text


def value_at(value: Any, path: Sequence[Step]) -> Any:
    """The value at ``path`` inside ``value``: by index, key or attribute (any object with those fields will do)."""
    for kind, key in path:
        if kind == "arg":
            value = value.args[key]
        elif kind == "kwarg":
            value = value.kwargs[key]
        elif kind in ("index", "key"):
            value = value[key]
        else:
            value = value[key] if isinstance(value, Mapping) else getattr(value, key)
    return value


@contextlib.contextmanager
def no_distribution_validation() -> Iterator[None]:
    """``torch.distributions`` objects built while the block runs skip their argument checks: a check is a branch
    on tensor values (``if not valid.all(): raise``), which no tracer can capture; eager runs keep them."""
    before = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(before)


def run_seeded(fn: Callable[..., Any], call: Call, seed: int = 0) -> Any:
    """``fn`` on ``call`` without gradients, the RNG seeded with ``seed`` and distributions' checks off, the caller's
    streams (CPU, and the CUDA devices of the call's tensors and of ``fn``'s parameters) restored after: a model
    that draws random numbers in eval mode then gives the same numbers on every run, and training's draws are
    untouched."""
    tensors = tree_of_call(call).leaves(call) + (list(fn.parameters()) if isinstance(fn, nn.Module) else [])
    devices = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
    with torch.no_grad(), torch.random.fork_rng(devices=devices), no_distribution_validation(), \
            python_random_seeded(seed):
        # Only the streams forked above are seeded: torch.manual_seed would seed every CUDA device (or queue it
        # until CUDA starts) and change the draws of a training on a device this call does not use.
        torch.random.default_generator.manual_seed(seed)
        for device in devices:
            torch.cuda.default_generators[device].manual_seed(seed)
        return call.run(fn)



# ------------------------------------------------------------------------------------------- structure


def distribution_params(value: Any) -> List[Tuple[str, Any]]:
    """A distribution's own parameters: those of ``arg_constraints`` it was built with (a lazily derived one,
    such as ``probs`` of a distribution built from ``logits``, is left out), or its base distribution."""
    if isinstance(value, torch.distributions.Independent):
        return [("base_dist", value.base_dist)]
    own = vars(value)
    names = [name for name in value.arg_constraints if name in own]
    if "probs" in names and "logits" in names:  # one was derived (lazily, when read): after it in the instance's dict
        order = list(own)
        names.remove("probs" if order.index("probs") > order.index("logits") else "logits")
    return [(name, own[name]) for name in names]


def _rebuilt_distribution(tree: Tree, params: Dict[str, Any]) -> Any:
    cls = tree.cls
    if cls is torch.distributions.Independent:
        return cls(params["base_dist"], tree.template.reinterpreted_batch_ndims, validate_args=False)
    try:
        return cls(**params, validate_args=False)  # type: ignore[misc]
    except TypeError:  # a constructor of its own: the template's other fields, these parameters
        obj = copy.copy(tree.template)
        for key, v in params.items():
            object.__setattr__(obj, key, v)
        return obj


def _mapping_rebuilds(value: Mapping[Any, Any]) -> bool:
    """Whether ``type(value)(dict(value))`` is ``value`` again: its class, its keys in order, and the same other
    state (a UserDict's attributes besides its ``data``)."""
    cls = type(value)
    try:
        again = cls(dict(value))
    except Exception:  # noqa: BLE001 - a constructor of other arguments: not rebuilt so
        return False
    if type(again) is not type(value) or list(again.keys()) != list(value.keys()):
        return False
    try:
        mine, theirs = vars(value), vars(again)
    except TypeError:  # no instance state beside the items
        return True
    return mine.keys() == theirs.keys() and all(k == "data" or _same_constant(mine[k], theirs[k]) for k in mine)


def _object_fields(value: Any) -> Optional[List[Tuple[str, Any]]]:
    """The fields of a dataclass, or of an object whose attributes hold tensors (a library's batch type); None
    when ``value`` holds no tensor."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value) if hasattr(value, f.name)]
    else:
        try:
            own = vars(value)
        except TypeError:
            return None
        items = [(k, v) for k, v in own.items() if not k.startswith("_")]
        if not any(_holds_tensor(v) for _, v in items) and callable(getattr(value, "to_dict", None)):
            try:  # a batch type keeping its fields in a private store (a graph library's Data): its own view
                mapped = value.to_dict()
            except Exception:  # noqa: BLE001 - no usable view: the fields above
                mapped = None
            if isinstance(mapped, Mapping):
                items = [(str(k), v) for k, v in mapped.items() if not str(k).startswith("_")]
    return items if any(_holds_tensor(v) for _, v in items) else None


def _holds_tensor(value: Any, depth: int = 0) -> bool:
    if isinstance(value, (torch.Tensor, torch.fx.Proxy)):  # a Proxy: a tensor while symbolic tracing runs
        return True
    if depth > 8:
        return False
    if isinstance(value, Mapping):
        return any(_holds_tensor(v, depth + 1) for v in value.values())
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(v, depth + 1) for v in value)
    if isinstance(value, torch.distributions.Distribution):
        return True
    if isinstance(value, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)):
        return False
    fields = None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    elif hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type)):
        fields = list(vars(value).values())
    return fields is not None and any(_holds_tensor(v, depth + 1) for v in fields)


def tree_of(value: Any, depth: int = 0) -> Tree:
    """The structure of ``value``: tensors are leaves, anything holding no tensor is a constant."""
    if isinstance(value, (torch.Tensor, torch.fx.Proxy)):
        return Tree("tensor")
    if depth > 16 or not _holds_tensor(value):
        return Tree("const", template=value)
    if isinstance(value, (tuple, list)):
        return Tree("seq", type(value), [(("index", i), tree_of(v, depth + 1)) for i, v in enumerate(value)])
    if isinstance(value, Mapping):  # an OrderedDict (torchvision's feature extractors) stays one; others: a dict
        # (a dataclass that is a mapping, Hugging Face's ModelOutput, keeps its class for the outputs' description)
        cls = type(value) if dataclasses.is_dataclass(value) else \
            collections.OrderedDict if type(value) is collections.OrderedDict else dict
        origin = type(value) if type(value) not in (dict, collections.OrderedDict) and cls is not type(value) else None
        return Tree("map", cls, [(("key", k), tree_of(v, depth + 1)) for k, v in value.items()], origin=origin,
                    origin_rebuilds=origin is not None and _mapping_rebuilds(value),
                    template=value if origin is not None else None)
    if isinstance(value, torch.distributions.Distribution):
        return Tree("dist", type(value), [(("attr", k), tree_of(v, depth + 1)) for k, v in distribution_params(value)],
                    template=value)
    if isinstance(value, nn.Module):
        return Tree("const", template=value)
    fields = _object_fields(value)
    if fields is None:  # tensors only in private attributes: not readable as fields, and not a constant either
        return Tree("const", type(value), template=value, hidden=True)
    return Tree("obj", type(value), [(("attr", k), tree_of(v, depth + 1)) for k, v in fields], template=value)


def tree_of_call(call: Call) -> Tree:
    """The structure of a call's arguments."""
    children = [(("arg", i), tree_of(a)) for i, a in enumerate(call.args)]
    children += [(("kwarg", k), tree_of(v)) for k, v in call.kwargs.items()]
    return Tree("call", children=children)


def plain(value: Any) -> Any:
    """``value`` in plain containers (see :meth:`Tree.plain`)."""
    tree = tree_of(value)
    return tree.plain(tree.leaves(value))


def is_flat_call(tree: Tree) -> bool:
    """Whether a call is tensors as positional arguments only: no nesting, no keywords, no constants (a flag or a
    count is part of the graph: the artifact takes the tensors, and the constants are checked where given)."""
    return all(kind == "arg" and child.kind == "tensor" for (kind, _), child in tree.children)


def needs_flat_outputs(tree: Tree) -> bool:
    """Whether an output holds something torch.export cannot carry: a distribution or another object."""
    if tree.kind in ("dist", "obj"):
        return True
    if tree.kind == "seq" and tree.cls not in (tuple, list):  # a named tuple: its class stays out of the graph
        return True  # (one defined in a function cannot be pickled); it is recorded and rebuilt on load
    return any(needs_flat_outputs(child) for _, child in tree.children)


def forward_parameter_names(module: nn.Module, count: int = 64) -> Optional[List[str]]:
    """Names for ``module.forward``'s first ``count`` positional arguments: its parameters' names, then those a
    ``*args`` parameter collects, numbered (``cat_list_0``...). None when forward's signature is unknown."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    names = []
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            names += [f"{p.name}_{i}" for i in range(max(0, count - len(names)))]
            break
    return names


# -------------------------------------------------------------------------------------------- adapters


class FlatCall(nn.Module):
    """``module`` behind a flat interface: one named parameter per input leaf (``forward(self, bmg_V, bmg_E,
    ...)``), the original arguments rebuilt from ``inputs`` (the recorded :class:`Tree` of the call), the outputs
    returned in plain containers. What capture and export trace when the call is not flat tensors."""

    def __init__(self, module: nn.Module, inputs: Tree, names: Sequence[str]) -> None:
        super().__init__()
        self.module = module
        self.inputs = inputs
        self.names = list(names)

    def call_with(self, leaves: Sequence[Any]) -> Any:
        call = self.inputs.rebuild(leaves)
        return _without_dtypes(plain(call.run(self.module)))

    @classmethod
    def make(cls, module: nn.Module, inputs: Tree, names: Sequence[str]) -> "FlatCall":
        """A FlatCall whose ``forward`` names its parameters (placeholders, ONNX inputs and the manifest use them)."""
        params = ", ".join(names)
        namespace: Dict[str, Any] = {}
        exec(f"def forward(self, {params}):\n    return self.call_with(({params}{',' if len(names) == 1 else ''}))\n",
             namespace)
        subclass = type("FlatCall", (cls,), {"forward": namespace["forward"], "__module__": cls.__module__})
        return subclass(module, inputs, names)

    def __reduce_ex__(self, protocol: Any) -> Any:  # the generated subclass is not importable: pickle the base
        state = self.__dict__.copy()
        return (_rebuild_flat_call, (state,))


def _without_dtypes(value: Any) -> Any:
    """Plain outputs with each dtype or device (a cache's fields) as None: torch.export refuses them among outputs,
    and what rebuilds the outputs behind a FlatCall (its recorded tree, the manifest's description) restores them."""
    if isinstance(value, (torch.dtype, torch.device)):
        return None
    if isinstance(value, tuple):  # plain() gives plain tuples and lists only
        return tuple(_without_dtypes(v) for v in value)
    if isinstance(value, list):
        return [_without_dtypes(v) for v in value]
    if isinstance(value, dict):
        return {k: _without_dtypes(v) for k, v in value.items()}
    return value


def _rebuild_flat_call(state: Dict[str, Any]) -> FlatCall:
    flat = FlatCall.make(state["_modules"]["module"], state["inputs"], state["names"])
    flat.__dict__.update(state)
    return flat


class StructuredCall(nn.Module):
    """A flat model (one tensor per input leaf, plain outputs) behind the original interface: the call's
    arguments (the user's objects) are flattened by the recorded input paths, and the outputs rebuilt in their
    original types (``outputs``: the recorded :class:`Tree` of the original outputs)."""

    def __init__(self, flat: nn.Module, inputs: Tree, outputs: Tree,
                 count_dim: Optional[Tuple[int, int]] = None) -> None:
        super().__init__()
        self.flat = flat
        self.inputs = inputs
        self.outputs = outputs
        self.count_dim = count_dim  # (input leaf, dim): what an output counting the samples counts

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves = self.inputs.leaves(Call(args, kwargs))
        out = self.flat(*leaves)
        samples = int(leaves[self.count_dim[0]].shape[self.count_dim[1]]) if self.count_dim is not None else None
        return self.outputs.rebuild(tree_of(out).leaves(out), samples)


@dataclass
class Interface:
    """How capture calls a module: the module itself on the call, or a :class:`FlatCall` on the call's tensor
    leaves when the call is not positional tensors or the outputs are not plain (``flat``)."""

    module: Optional[nn.Module]  # what is captured (dropped once captured: the graph holds what it uses)
    call: Call  # what it is called with
    inputs: Tree  # the original call's structure
    outputs: Tree  # the original outputs' structure
    names: List[str]  # a name per input leaf
    flat: bool
    count_dim: Optional[Tuple[int, int]] = None  # (input leaf, dim) the counting outputs count, once known

    def counting_samples(self, paths: Sequence[Tuple[Step, ...]], count_dim: Tuple[int, int]) -> "Interface":
        """The interface with the output constants at ``paths`` giving the size of input leaf ``count_dim[0]``
        along ``count_dim[1]`` (the number of samples)."""
        return dataclasses.replace(self, outputs=self.outputs.counting_samples(paths), count_dim=count_dim)

    @classmethod
    def of(cls, module: nn.Module, call: Call, outputs: Any) -> "Interface":
        """The interface for ``module`` called with ``call``, whose ``outputs`` (one run) show their structure."""
        tree, out_tree = tree_of_call(call), tree_of(outputs)
        names = tree.leaf_names(forward_parameter_names(module))
        flat = not is_flat_call(tree) or needs_flat_outputs(out_tree)
        if not flat:
            return cls(module, call, tree, out_tree, names, False)
        return cls(FlatCall.make(module, tree, names), Call(tuple(tree.leaves(call))), tree, out_tree, names, True)

    def leaves_of(self, call: Call) -> Call:
        """Another call of the original interface as the captured module takes it."""
        return Call(tuple(self.inputs.leaves(call))) if self.flat else call

    def flattened(self, module: nn.Module) -> nn.Module:
        """``module`` (one called as the original is: the unfused target) behind the captured interface."""
        return FlatCall.make(module, self.inputs, self.names) if self.flat else module

    def structured(self, flat_model: nn.Module) -> nn.Module:
        """``flat_model`` (the captured, fused graph) behind the original interface."""
        return StructuredCall(flat_model, self.inputs, self.outputs, self.count_dim) if self.flat else flat_model


def map_leaves(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """``value`` (a call, or anything :func:`tree_of` reads) with ``fn`` applied to every tensor leaf, in its own
    types (objects and distributions rebuilt)."""
    tree = tree_of_call(value) if isinstance(value, Call) else tree_of(value)
    return tree.rebuild([fn(t) for t in tree.leaves(value)])
