"""The outputs' containers, for a process without the training code: described for the manifest
(:func:`describe_outputs`), built again around an artifact's tensors (:func:`rebuild_outputs`), or refused where an
artifact could not give them back as the model returns them (:func:`unreturnable_output`)."""

from __future__ import annotations

import ast
import collections
import dataclasses
from typing import Any, Mapping, Optional, Sequence, Tuple

import torch

from fx_lightning.common.calls import Tree, distribution_params, path_text
from fx_lightning.common.imports import import_object
from fx_lightning.common.json_views import JsonObject, dtype_name
from fx_lightning.errors import ExportError

__all__ = ["describe_outputs", "rebuild_outputs", "class_at", "unreturnable_output", "UnreturnableOutput"]


def describe_outputs(tree: Tree) -> JsonObject:
    """The containers of an output as JSON, so a process without the training code rebuilds them: ``tensor``;
    ``tuple``/``list`` with ``items``; ``namedtuple`` and ``dataclass`` with their ``class`` (``module:qualname``),
    ``fields`` and whether the class can be imported by that name (``importable``: else a named tuple with the same
    fields stands in); ``dict`` with ``keys`` (mappings, other objects, distributions: as torch.export gives them)."""
    if tree.kind == "tensor":
        return {"kind": "tensor"}
    if tree.kind == "const":
        if tree.counts_samples:
            return {"kind": "const", "value": None, "samples": True}
        value = tree.template
        if isinstance(value, (dict, list, tuple)) and not value:  # an empty container: itself, not None
            return {"kind": "dict", "keys": [], "items": []} if isinstance(value, dict) else \
                {"kind": "list" if isinstance(value, list) else "tuple", "items": []}
        literal = _literal(value)
        if literal is not None:  # a container of plain values (transformers' is_updated {0: True}): as Python writes it
            return {"kind": "const", "value": None, "literal": literal}
        if isinstance(value, torch.dtype):  # a cache's dtype (transformers' DynamicLayer): restored by name
            return {"kind": "const", "value": None, "dtype": dtype_name(value)}
        if isinstance(value, torch.device):
            return {"kind": "const", "value": None, "device": str(value)}
        return {"kind": "const", "value": value if isinstance(value, (int, float, bool, str)) else None}
    items = [describe_outputs(child) for _, child in tree.children]
    keys = [key for (_, key), _child in tree.children]
    fields = getattr(tree.cls, "_fields", None) if tree.kind == "seq" else None
    # A dataclass that is also a mapping (Hugging Face's ModelOutput) comes back as its class where it imports (its
    # attributes and keys both work), else as the mapping it is.
    record = tree.cls is not None and (fields is not None or (tree.kind == "obj" and dataclasses.is_dataclass(tree.cls))
                                       or (tree.kind == "map" and dataclasses.is_dataclass(tree.cls)
                                           and class_at(f"{tree.cls.__module__}:{tree.cls.__qualname__}") is tree.cls))
    if record:
        name = f"{tree.cls.__module__}:{tree.cls.__qualname__}"
        return {"kind": "namedtuple" if fields is not None else "dataclass", "class": name,
                "importable": class_at(name) is tree.cls, "fields": [str(k) for k in (fields or keys)], "items": items}
    if tree.kind == "seq":
        return {"kind": "list" if tree.cls is list else "tuple", "items": items}
    own_class = _mapping_class(tree) if tree.kind == "map" else _object_description(tree) if tree.kind == "obj" else None
    if own_class is not None:  # a mapping built again from its items, an object with its fields set: its class
        return {"kind": "mapping" if tree.kind == "map" else "object", "class": own_class, "keys": keys,
                "items": items}
    if tree.kind == "dist" and tree.cls is not None:  # rebuilt from its parameters (torch's own classes import)
        name = f"{tree.cls.__module__}:{tree.cls.__qualname__}"
        if class_at(name) is tree.cls:
            extra = {"reinterpreted_batch_ndims": int(tree.template.reinterpreted_batch_ndims)} \
                if isinstance(tree.template, torch.distributions.Independent) else {}
            return {"kind": "distribution", "class": name, "keys": keys, "items": items,
                    "event_dims": len(tree.template.event_shape), **extra}
    ordered = {"ordered": True} if tree.kind == "map" and tree.cls is collections.OrderedDict else {}
    return {"kind": "dict", "keys": keys, "items": items, **ordered}


class UnreturnableOutput(ValueError):
    """An output an artifact cannot give back as the model returns it (:func:`unreturnable_output`): the model's code
    decides it, not its weights, so it is known before training."""


def unreturnable_output(tree: Tree, path: Tuple[Any, ...] = ()) -> Optional[str]:
    """Why an artifact could not give back an object of the outputs as the model returns it (None: it can): a
    distribution it cannot build again from its parameters (zuko's flows, a TransformedDistribution: its tensors
    are in its transforms), an object whose class does not import by name or whose attributes are not all recorded
    (private ones, values JSON cannot hold besides a dtype and a device), tensors in private attributes."""
    where = "output" + path_text(path)
    name = f"{tree.cls.__module__}.{tree.cls.__qualname__}" if tree.cls is not None else "object"
    if tree.kind == "const" and tree.hidden:
        return f"{where} is a {name} that keeps its tensors in private attributes: an artifact cannot give them back"
    if tree.kind == "dist" and (not tree.leaf_paths() or tree.cls is None
                                or class_at(f"{tree.cls.__module__}:{tree.cls.__qualname__}") is not tree.cls
                                or not _distribution_rebuilds(tree)):
        return (f"{where} is a {name}, a distribution an artifact cannot build again from its parameters (its "
                "tensors are not all arguments of its class, or the class does not import by name): it would come "
                "back as a dict of them. Fuse the module that computes its parameters (target), or return them")
    if tree.kind == "map" and tree.origin is not None and _mapping_class(tree) is None:
        origin = f"{tree.origin.__module__}.{tree.origin.__qualname__}"
        return (f"{where} is a {origin}, a mapping an artifact cannot give back as one (its class does not import by "
                "name, or built again from its items it is not the same: other state beside them): it would come back "
                "as a dict")
    if tree.kind == "obj" and not dataclasses.is_dataclass(tree.cls) and _object_description(tree) is None:
        return (f"{where} is a {name}, which an artifact cannot give back as one (its class does not import by name, "
                "or it has attributes that are private or hold values JSON cannot, such as a class): it "
                "would come back as a dict of its fields")
    for step, child in tree.children:
        problem = unreturnable_output(child, (*path, step))
        if problem is not None:
            return problem
    return None


def _distribution_rebuilds(tree: Tree) -> bool:
    """Whether the distribution built again from its recorded parameters, as :func:`rebuild_outputs` builds it, gives
    the model's own mean and variance (each one the model's gives). gpytorch's MultivariateNormal keeps its covariance
    in a private lazy attribute: built again from its ``loc`` alone, its variance raised AttributeError."""
    original = tree.template
    if tree.cls is torch.distributions.Independent or original is None:
        return True  # built from its base distribution, checked on its own
    try:
        again = _distribution_of(tree.cls, dict(distribution_params(original)), len(original.event_shape))
    except Exception:  # noqa: BLE001 - not built again at all
        return False
    for statistic in ("mean", "variance"):
        try:
            want = getattr(original, statistic)
        except Exception:  # noqa: BLE001 - the model's own does not give it: nothing to give back
            continue
        try:
            got = getattr(again, statistic)
        except Exception:  # noqa: BLE001 - the model's gives it, the one built again does not
            return False
        if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and got.shape == want.shape
                and bool(torch.equal(got.nan_to_num(), want.nan_to_num()))):
            return False
    return True


def _mapping_class(tree: Tree) -> Optional[str]:
    """The ``module:qualname`` of a mapping's own class (not dict), when it imports by that name and gives the
    mapping back from its items (``Tree.origin_rebuilds``)."""
    if tree.origin is None or not tree.origin_rebuilds:
        return None
    name = f"{tree.origin.__module__}:{tree.origin.__qualname__}"
    return name if class_at(name) is tree.origin else None


def _const(node: Mapping[str, Any]) -> Any:
    """A constant the manifest records by its text: a Python literal (read with ``ast.literal_eval``, never run), a
    torch dtype or a device. Raises ExportError naming the text when it is none of those."""
    try:
        if "literal" in node:
            return ast.literal_eval(str(node["literal"]))
        if "dtype" in node:
            dtype = getattr(torch, str(node["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError("not a torch dtype")
            return dtype
        return torch.device(str(node["device"]))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, RuntimeError) as exc:
        key = next(k for k in ("literal", "dtype", "device") if k in node)
        raise ExportError(f"manifest output_tree: a constant's {key} {str(node[key])[:80]!r} cannot be read "
                          f"({type(exc).__name__}: {exc}); it takes a Python literal, a torch dtype's name or a "
                          "device") from None


def _literal(value: Any) -> Optional[str]:
    """``value`` as a Python literal that reads back equal (a dict, list, tuple or set of plain values), else None."""
    if not isinstance(value, (dict, list, tuple, set)) or not value:
        return None
    try:
        text = repr(value)
        back = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return text if type(back) is type(value) and back == value else None


def _object_description(tree: Tree) -> Optional[str]:
    """The ``module:qualname`` of a plain object's class, when the object is its recorded fields alone (every
    attribute public, each a tensor, a container of them or a JSON value) and the class imports by that name."""
    if tree.cls is None or tree.template is None:
        return None
    name = f"{tree.cls.__module__}:{tree.cls.__qualname__}"
    try:
        attributes = set(vars(tree.template))
    except TypeError:
        return None
    keys = {key for (_, key), _child in tree.children}
    plain_values = all(child.kind != "const" or child.template is None or _literal(child.template) is not None or
                       isinstance(child.template, (dict, list, tuple)) and not child.template or
                       isinstance(child.template, (int, float, bool, str, torch.dtype, torch.device))
                       for _, child in tree.children)
    return name if attributes == keys and plain_values and class_at(name) is tree.cls else None


def _distribution_of(cls: Optional[type], params: Mapping[str, Any], event_dims: int) -> Any:
    """A distribution of ``cls`` built from ``params``: by its constructor, else past a constructor of its own (scvi's
    Normal takes ``mu``) with them as its fields. The one way outputs are built again, and checked to be."""
    try:
        return cls(**params, validate_args=False)  # type: ignore[misc]
    except (TypeError, KeyError, ValueError):
        return _distribution_from_fields(cls, params, event_dims)


def _distribution_from_fields(cls: Optional[type], params: Mapping[str, torch.Tensor], event_dims: int) -> Any:
    """A distribution of ``cls`` with ``params`` as its fields, past a constructor that takes other names; its
    shapes from the parameters' (the last ``event_dims`` are the event's). The parameters as a dict without a class."""
    tensors = [v for v in params.values() if isinstance(v, torch.Tensor)]
    if cls is None or not tensors:
        return params
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    split = len(shape) - event_dims
    obj = cls.__new__(cls)
    torch.distributions.Distribution.__init__(obj, shape[:split], shape[split:], validate_args=False)
    for key, value in params.items():
        object.__setattr__(obj, key, value)
    return obj


def class_at(name: str) -> Optional[type]:
    """The class ``module:qualname`` names, when it can be imported by that name (not one defined in a function)."""
    if "<locals>" in name:
        return None
    try:
        value = import_object(name)
    except Exception:  # noqa: BLE001 - not importable here
        return None
    return value if isinstance(value, type) else None


def rebuild_outputs(description: Mapping[str, Any], leaves: Sequence[Any], samples: Optional[int] = None) -> Any:
    """The outputs with their containers as ``description`` records them, from their tensors in order (and the
    call's number of ``samples`` for a constant that counts them)."""
    it = iter(leaves)

    def build(node: Mapping[str, Any]) -> Any:
        kind = node["kind"]
        if kind == "tensor":
            return next(it)
        if kind == "const":
            if "literal" in node or "dtype" in node or "device" in node:
                return _const(node)
            return samples if node.get("samples") and samples is not None else node.get("value")
        items = [build(child) for child in node.get("items") or []]
        if kind in ("namedtuple", "dataclass"):
            cls = class_at(str(node["class"])) if node.get("importable") else None
            fields = [str(f) for f in node["fields"]]
            if cls is not None:
                return cls(*items) if kind == "namedtuple" else cls(**dict(zip(fields, items)))
            stand_in = collections.namedtuple(str(node["class"]).rpartition(".")[2].rpartition(":")[2], fields)
            return stand_in(*items)
        if kind == "distribution":
            params = dict(zip(node.get("keys") or [], items))
            cls = class_at(str(node["class"]))
            if "reinterpreted_batch_ndims" in node and "base_dist" in params:
                return torch.distributions.Independent(params["base_dist"], int(node["reinterpreted_batch_ndims"]),
                                                       validate_args=False)
            return _distribution_of(cls, params, int(node.get("event_dims", 0)))
        if kind == "mapping":
            cls = class_at(str(node["class"]))
            if cls is None:
                raise ExportError(f"the outputs hold a {node['class']} (recorded in the manifest's output_tree), "
                                  "and that class cannot be imported here: install the package that defines it")
            return cls(dict(zip(node.get("keys") or [], items)))
        if kind == "object":
            cls = class_at(str(node["class"]))
            if cls is None:  # a dict of its fields would be another structure: never without a word
                raise ExportError(f"the outputs hold a {node['class']} (recorded in the manifest's output_tree), "
                                  "and that class cannot be imported here: install the package that defines it")
            obj = cls.__new__(cls)  # the object as the model returned it: its class, its fields (nothing else)
            tensors = [v for v in items if isinstance(v, torch.Tensor)]
            for key, value in zip(node.get("keys") or [], items):
                if isinstance(value, torch.device) and tensors:  # where its tensors are now, not at export
                    value = tensors[0].device
                object.__setattr__(obj, str(key), value)
            return obj
        if kind == "list":
            return list(items)
        if kind == "tuple":
            return tuple(items)
        return (collections.OrderedDict if node.get("ordered") else dict)(zip(node.get("keys") or [], items))

    return build(description)
