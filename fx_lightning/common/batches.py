"""Batches and the values that flow through a model: taking the input and labels out of a data batch,
moving arguments to a model's device and dtype, recording a submodule's calls, flattening outputs.

Shared by parity, the pipeline, export and the Lightning glue.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Callable, Iterator, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from fx_lightning.common.imports import import_object
from fx_lightning.common.calls import Call, map_leaves, plain, tree_of
from fx_lightning.errors import ConfigError

__all__ = [
    "INPUT_KEYS",
    "WHOLE_BATCH",
    "PARITY_INPUT_SPELLINGS",
    "LABEL_KEYS",
    "InputRule",
    "extract_input",
    "extract_labels",
    "label_candidates",
    "describe",
    "identity_rule",
    "example_call",
    "to_model",
    "model_device_dtype",
    "flat_tensors",
    "detached",
    "record_calls",
    "is_record_type",
    "PlainOutputs",
    "describe_call",
    "loader_sample_counts",
]

# Keys tried, in order, when a batch is a mapping and no input rule is configured.
INPUT_KEYS: Tuple[str, ...] = ("x", "input", "inputs", "image", "images", "pixel_values", "features", "data")
LABEL_KEYS: Tuple[str, ...] = ("y", "label", "labels", "target", "targets")

InputRule = Union[None, str, int, Callable[[Any], Any]]

# What parity.input can say, for error messages.
PARITY_INPUT_SPELLINGS = (
    "parity.input can be a key of a dict batch ('image'), an index into a tuple batch (0), '*' (the whole batch is "
    "forward's one argument), or 'pkg.module:function' taking the batch and returning forward's argument, a tuple "
    "of its positional arguments, or fx_lightning.calls.Call(args, kwargs)")


def identity_rule(batch: Any) -> Any:
    """The input rule for "the batch is already forward's arguments" (example inputs)."""
    return batch


# parity.input: the whole batch is forward's one argument (a dict batch passed whole, say).
WHOLE_BATCH = "*"


def extract_input(batch: Any, rule: InputRule = None) -> Any:
    """Take the model input out of a batch.

    ``rule``: ``None`` (automatic: a tensor as is; the first item of a tuple/list; the first of
    ``INPUT_KEYS`` in a mapping), a mapping key, an integer index (or its string form), ``"*"`` (the whole batch is
    forward's one argument), an import path ``"pkg.module:function"`` or a callable taking the batch. A returned
    *tuple* is read as several positional arguments of forward (see :func:`as_args`), a
    :class:`~fx_lightning.common.calls.Call` as positional and keyword arguments.
    """
    if callable(rule):
        return rule(batch)
    if rule == WHOLE_BATCH:
        return (batch,)
    if isinstance(rule, str) and ":" in rule:
        try:
            fn = import_object(rule)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(f"parity.input: cannot import {rule!r}: {exc}.") from None
        return fn(batch)
    if isinstance(rule, int) or (isinstance(rule, str) and rule.lstrip("-").isdigit()):
        return _by_index(batch, rule)
    if isinstance(rule, str):
        return _by_key(batch, rule)
    if rule is not None:
        raise ConfigError(f"parity.input: expected a key, an index, an import path or a callable, got {rule!r}.")
    return _automatic_input(batch)


def _by_index(batch: Any, rule: Union[int, str]) -> Any:
    index = int(rule)
    if not isinstance(batch, (tuple, list)):
        raise ConfigError(
            f"parity.input: {rule!r} is an index, but the batch is a {type(batch).__name__}, not a tuple/list."
        )
    if not -len(batch) <= index < len(batch):
        raise ConfigError(f"parity.input: index {index} is out of range for a batch of {len(batch)} items.")
    return batch[index]


def _by_key(batch: Any, key: str) -> Any:
    if isinstance(batch, Mapping):
        if key not in batch:
            raise ConfigError(
                f"parity.input: key {key!r} is not in the batch; its keys: {', '.join(map(str, batch))}."
            )
        return batch[key]
    if hasattr(batch, key):
        return getattr(batch, key)
    raise ConfigError(f"parity.input: {key!r} names a key, but the batch is a {type(batch).__name__} without it.")


def _automatic_input(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and batch:
        return batch[0]
    if isinstance(batch, Mapping):
        for key in INPUT_KEYS:
            if key in batch:
                return batch[key]
        raise ConfigError(
            f"parity.input: cannot tell which entry of the batch is the model input (keys: "
            f"{', '.join(map(str, batch))}; tried {', '.join(INPUT_KEYS)}). {PARITY_INPUT_SPELLINGS}."
        )
    found = next((getattr(batch, key) for key in INPUT_KEYS if isinstance(getattr(batch, key, None), torch.Tensor)),
                 None)
    if found is not None:  # a library's own batch type (a dataclass with an ``image`` field, say)
        return found
    raise ConfigError(
        f"parity.input: cannot take a model input out of a batch of type {type(batch).__name__}. "
        f"{PARITY_INPUT_SPELLINGS}."
    )


def extract_labels(batch: Any, rule: InputRule = None) -> Optional[torch.Tensor]:
    """The batch's first integer tensor that may be class labels (:func:`label_candidates`), if any."""
    candidates = label_candidates(batch, rule)
    return candidates[0] if candidates else None


def label_candidates(batch: Any, rule: InputRule = None) -> Tuple[torch.Tensor, ...]:
    """The batch's integer tensors that may be class labels, in order: what ``rule`` picks, else the items of a
    tuple/list after the first (a text batch's lengths or offsets come before its labels: which is which is decided
    where the outputs show it, :meth:`~fx_lightning.parity.gate.ParityRun.compare_classes`), a ``LABEL_KEYS`` entry,
    or a library batch type's ``label``/``target`` field."""
    found: Any = None
    if callable(rule):
        found = rule(batch)
    elif isinstance(rule, (str, int)):
        try:
            found = batch[rule]
        except (KeyError, IndexError, TypeError):
            found = None
    elif isinstance(batch, (tuple, list)) and len(batch) >= 2:
        found = tuple(batch[1:])
    elif isinstance(batch, Mapping):
        found = next((batch[k] for k in LABEL_KEYS if k in batch), None)
    else:  # a library's own batch type: a ``label``/``target`` field
        found = next((getattr(batch, k) for k in LABEL_KEYS if hasattr(batch, k)), None)
    items = found if isinstance(found, (tuple, list)) else (found,)
    return tuple(t for t in items
                 if isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex())


def describe(value: Any, depth: int = 0) -> str:
    """What a batch (or an input) is, for error messages: types, shapes and dtypes, nested."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if depth > 3:
        return type(value).__name__
    if isinstance(value, (tuple, list)):
        items = ", ".join(describe(v, depth + 1) for v in value[:6]) + (", ..." if len(value) > 6 else "")
        return f"{type(value).__name__}({items})"
    if isinstance(value, Mapping):
        items = ", ".join(f"{k!r}: {describe(v, depth + 1)}" for k, v in list(value.items())[:6])
        return f"{type(value).__name__}({items})"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = ", ".join(f"{f.name}={describe(getattr(value, f.name), depth + 1)}" for f in dataclasses.fields(value))
        return f"{type(value).__name__}({items})"
    return type(value).__name__


def example_call(example_inputs: Any) -> Optional[Call]:
    """``fuse()``'s ``example_inputs`` as a call: a :class:`~fx_lightning.common.calls.Call` as it is, a tensor one
    positional argument, a sequence several (None: none given)."""
    if example_inputs is None or isinstance(example_inputs, Call):
        return example_inputs
    return Call((example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs))


def to_model(args: Any, device: Optional[torch.device], dtype: Optional[torch.dtype]) -> Any:
    """Move tensors (nested in tuples, lists, named tuples, mappings, a :class:`~fx_lightning.common.calls.Call`, a
    library's batch object) to ``device`` and floating ones to ``dtype``."""
    def move(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device) if device is not None else t
        return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t

    return map_leaves(move, args)


def model_device_dtype(module: nn.Module) -> Tuple[Optional[torch.device], Optional[torch.dtype]]:
    """The device and floating dtype of ``module``'s first floating parameter or buffer (None: unknown)."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        if t.is_floating_point():
            return t.device, t.dtype
    for t in itertools.chain(module.parameters(), module.buffers()):
        return t.device, None
    return None, None


def flat_tensors(out: Any) -> List[torch.Tensor]:
    """Every tensor of a (nested) output, in a stable order: tuples, lists, mappings, dataclasses (Hugging Face
    ``ModelOutput`` is a mapping), ``torch.distributions`` objects (their parameters), objects' tensor fields."""
    return tree_of(out).leaves(out)


def describe_call(call: Call) -> str:
    """A call's arguments, for messages: types, shapes and dtypes."""
    parts = [describe(a) for a in call.args] + [f"{k}={describe(v)}" for k, v in call.kwargs.items()]
    return ", ".join(parts)


def detached(value: Any) -> Any:
    """A detached clone of every tensor in ``value``: a later in-place op (``ReLU(inplace=True)``) cannot change it."""
    return map_leaves(lambda t: t.detach().clone(), value)


@contextlib.contextmanager
def record_calls(module: nn.Module) -> Iterator[List[Tuple[tuple, dict, Any]]]:
    """Record ``(args, kwargs, output)`` of every call of ``module`` while the block runs."""
    calls: List[Tuple[tuple, dict, Any]] = []

    def hook(_mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        calls.append((detached(args), detached(kwargs), detached(output)))

    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def is_record_type(cls: Any) -> bool:
    """A named tuple or a plain dataclass: a record type torch.export's serialiser does not know by itself
    (a registered one, such as Hugging Face's ModelOutput, is a mapping and left alone)."""
    if not isinstance(cls, type):
        return False
    return (issubclass(cls, tuple) and hasattr(cls, "_fields")) or (
        dataclasses.is_dataclass(cls) and not issubclass(cls, Mapping))


class PlainOutputs(nn.Module):
    """``model`` with its outputs made plain: named tuples as tuples, dataclasses, objects and distributions as
    dicts of their fields (:func:`fx_lightning.common.calls.plain`)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any) -> Any:
        return plain(self.model(*args))


def loader_sample_counts(loader: Any, count: int) -> List[Optional[int]]:
    """How many samples each of the first ``count`` batches of ``loader`` holds, as the loader says: a DataLoader
    with a ``batch_size`` (or a batch sampler with one) and a sampler of known length; None where it does not say
    (graph libraries batch graphs: a batch of 6 graphs has as many nodes as they have together)."""
    size = getattr(loader, "batch_size", None)
    sampler = getattr(loader, "sampler", None)
    if size is None:
        batch_sampler = getattr(loader, "batch_sampler", None)
        size = getattr(batch_sampler, "batch_size", None)
        sampler = getattr(batch_sampler, "sampler", sampler)
        drop_last = bool(getattr(batch_sampler, "drop_last", False))
    else:
        drop_last = bool(getattr(loader, "drop_last", False))
    if not isinstance(size, int) or size < 1:
        return [None] * count
    try:
        total = len(sampler)  # type: ignore[arg-type]
    except TypeError:
        total = None
    counts: List[Optional[int]] = []
    for i in range(count):
        if total is None:
            counts.append(None)
        elif drop_last or (i + 1) * size <= total:
            counts.append(size)
        else:
            counts.append(max(0, total - i * size) or None)
    return counts
