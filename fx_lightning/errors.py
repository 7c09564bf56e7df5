"""The project's exceptions: one type per condition. Every error we raise on purpose derives from
:class:`FXLightningError`.

Context is added once, where the error crosses into the user's code (the callback names the pipeline step and
where the checkpoints are), with :meth:`FXLightningError.add_context` on the same object, which is then raised
again; a foreign exception is wrapped once with ``raise ... from``. Nothing rebuilds an exception from its type.
A configuration record is loaded from mappings here too (:func:`load_record`), so that every section's loader
reports a bad key the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import typing
from enum import Enum
from typing import TYPE_CHECKING, Any, Iterable, Iterator, List, Mapping, Optional, Sequence, Type, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

if TYPE_CHECKING:  # records of higher layers, carried as fields
    from fx_lightning.parity.report import ParityReport

__all__ = [
    "FXLightningError",
    "ConfigError",
    "TraceError",
    "PassError",
    "raised_in_pass",
    "ParityError",
    "ExportError",
    "ModelError",
    "NoInputsError",
    "require_inputs",
    "ERROR_CLASSES",
    "first_line",
    "OnError",
    "unknown_key",
    "config_error",
    "load_record",
    "merge_into",
    "run_check",
]

# What to do when a step fails (on_error, parity.on_failure): raise, or warn and carry on. A str Enum named as its
# values, as the config's enums are (the functional API: ``raise`` is a keyword; ``module``: picklable by name).
OnError: Any = Enum("OnError", [("raise", "raise"), ("warn", "warn")], type=str,  # type: ignore[misc]
                    module=__name__, qualname="OnError")
OnError.__doc__ = "What to do when a step fails: raise, or warn and carry on."


class FXLightningError(RuntimeError):
    """Base class of fx-lightning's errors.

    ``message`` is the cause; ``headline`` (before it) and ``context`` (lines after it) are added where the
    error reaches the user; ``step`` is the pipeline step it came from (set by the driver); ``fix``: the advice for
    this error in place of its step's (``""``: none works, so none is given)."""

    def __init__(self, message: str, fix: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.headline: Optional[str] = None
        self.context: List[str] = []
        self.step: Optional[str] = None
        self.fix = fix

    def within(self, place: str) -> "FXLightningError":
        """Say where it happened, in front of the cause (``export to DIR failed: ...``); returns the error itself."""
        self.message = f"{place}: {self.message}"
        return self

    def add_context(self, headline: Optional[str] = None, after: Sequence[str] = ()) -> "FXLightningError":
        """Put ``headline`` before the message and ``after`` below it; returns the error itself (raise it again)."""
        if headline is not None:
            self.headline = headline
        self.context.extend(after)
        return self

    def __str__(self) -> str:
        return "\n".join(([self.headline] if self.headline else []) + [self.message] + self.context)


class ConfigError(FXLightningError, ValueError):
    """A configuration value, or an input the configuration points at, is wrong or missing; the message names
    the full key, the value and what is allowed."""


class TraceError(FXLightningError):
    """The module could not be captured; the message names the module, the source line and the fixes."""


class PassError(FXLightningError):
    """A graph pass raised or left a graph that does not lint; names the pass."""


@contextlib.contextmanager
def raised_in_pass(who: str) -> Iterator[None]:
    """Run a pass's (or a variant's) own code: whatever it raises, but a PassError, becomes a PassError naming
    ``who``, so the user learns which pass to fix or disable."""
    try:
        yield
    except PassError:
        raise
    except Exception as exc:
        raise PassError(f"{who} raised {type(exc).__name__}: {exc}") from exc


class ParityError(FXLightningError):
    """The fused model does not give the same answers as the original. ``report``: the gate's
    :class:`~fx_lightning.parity.ParityReport`; ``outcome``: what the pipeline did up to the verdict."""

    def __init__(self, message: str, report: Optional["ParityReport"] = None, outcome: Any = None) -> None:
        super().__init__(message)
        self.report = report
        self.outcome = outcome


class ExportError(FXLightningError):
    """An export could not be written or read back."""


class ModelError(FXLightningError):
    """The model's own code raises on the data, unfused and untouched: a condition of the model, not of the
    pipeline (a memory bank that training fills, say). Before training the preflight proves what it can and goes on."""


class NoInputsError(ConfigError, PassError):
    """Nothing to run the model on: no data batches and no example inputs. A ConfigError (the inputs are for the
    user to give), and a PassError too, as a variant that lacks them has always raised one."""


# What gives the pipeline its inputs, named where the caller does not know better.
_GIVE_INPUTS = ("data batches (the trainer's, or fuse_and_export's batches) or example inputs (the LightningModule's "
          "example_input_array, or fuse_and_export's example_inputs)")


def require_inputs(given: bool, needed_for: str, give: str = _GIVE_INPUTS, key: Optional[str] = None) -> None:
    """Raise the one error for nothing to run the model on, unless ``given``: ``needed_for`` is what needs the
    inputs, ``give`` what to set, ``key`` (the setting or step) leads the message."""
    if not given:
        raise NoInputsError(f"{key + ': ' if key else ''}no inputs for {needed_for}: give {give}")


# Our error classes by name: an error that crossed between processes by name is raised again as its class.
ERROR_CLASSES = {cls.__name__: cls for cls in (FXLightningError, ConfigError, TraceError, PassError, ParityError,
                                               ExportError, ModelError, NoInputsError)}


def first_line(exc: BaseException, *, with_type: bool = False) -> str:
    """The first line of ``exc``'s cause (its type name when it has none), for one-line summaries.

    ``with_type``: prefix the type name (``"KeyError: 'x'"``), except for our own errors, whose first line
    already says what failed.
    """
    text = (exc.message if isinstance(exc, FXLightningError) else str(exc)).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    if with_type and text and not isinstance(exc, FXLightningError):
        return f"{type(exc).__name__}: {line}"
    return line


# ---------------------------------- configuration errors: records merged key by key, so each error names its key


def unknown_key(path: str, key: str, allowed: Iterable[str]) -> ConfigError:
    """Key ``key`` under ``path`` (dotted, "" at the root) is not one of ``allowed``: the closest one suggested."""
    allowed = sorted(allowed)
    full = f"{path}.{key}" if path else key
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" Did you mean '{f'{path}.{close[0]}' if path else close[0]}'?" if close else ""
    return ConfigError(f"{full}: unknown key.{hint} Allowed keys under '{path or '<root>'}': {', '.join(allowed)}.")


def config_error(exc: Exception, prefix: str = "", *, key: str = "", node: Any = None) -> ConfigError:
    """OmegaConf's error (or a raw one it let through, such as OverflowError) as a ConfigError naming the full key
    (``key``; else OmegaConf's, under ``prefix``: the key of the node it was raised in), with what OmegaConf's text
    lacks: the keys allowed (and the closest) for an unknown key, the members for an enum's value, the type a value
    of ``node`` (the field's node, when the caller has it) must have."""
    if isinstance(exc, ConfigError):
        return exc
    if not key:
        key = getattr(exc, "full_key", None) or ""
        if prefix:
            key = f"{prefix}{key}" if key.startswith("[") else f"{prefix}.{key}" if key else prefix
    schema = getattr(exc, "object_type", None)
    if type(exc).__name__ == "ConfigKeyError" and dataclasses.is_dataclass(schema) and key:
        path, _, name = key.rpartition(".")
        return unknown_key(path, name, (f.name for f in dataclasses.fields(schema)))
    value = getattr(exc, "value", None)
    members = _enum_members(exc)
    if members:
        return ConfigError(f"{key}: invalid value {value!r}. Allowed: {', '.join(members)}.")
    msg = (getattr(exc, "msg", None) or str(exc)).split("\n")[0]
    if type(exc).__name__ == "InterpolationKeyError":
        msg = f"cannot resolve: {msg}"
    got = f" Got {value!r:.80}." if value is not None and repr(value) not in msg else ""
    allowed = _TYPE_TEXT.get(getattr(getattr(node, "_metadata", None), "ref_type", None))
    return ConfigError(f"{key or '<config>'}: {msg}.{got}".replace("..", ".")
                       + (f" Allowed: {allowed}." if allowed else ""))


# What a value of a field of this type must be, in the words of an error.
_TYPE_TEXT = {float: "a number", int: "an integer", bool: "true or false", str: "a string",
              Optional[float]: "a number or null", Optional[int]: "an integer or null", Optional[str]: "a string or null"}


def _enum_members(exc: Exception) -> List[str]:
    """The member names of the enum a rejected value was for (a field's or a list item's), else []."""
    if type(exc).__name__ != "ValidationError":
        return []
    field = getattr(getattr(exc, "child_node", None), "_metadata", None)  # a field's node; a list item has none
    hints = [getattr(field, "ref_type", None), *typing.get_args(getattr(exc, "ref_type", None))]
    enums = [t for t in hints if isinstance(t, type) and issubclass(t, Enum)]
    return [m.name for m in enums[0]] if enums else []


R = TypeVar("R")  # the record type load_record builds


def load_record(schema: Type[R], sources: Sequence[Mapping[Any, Any]], path: str = "") -> R:
    """The dataclass ``schema`` with ``sources`` merged into it in order (:func:`merge_into`), as its object; every
    failure a ConfigError naming the full key (``path``: the record's own key, "" for the root)."""
    node = OmegaConf.structured(schema)
    for source in sources:
        merge_into(node, source, path)
    try:
        # OmegaConf.to_object would silently give a '???' (missing) field its dataclass default.
        missing = sorted(OmegaConf.missing_keys(node))
        if missing:
            raise ConfigError(f"{path + '.' if path else ''}{missing[0]}: missing value ('???'); give a value"
                              + (" (a registered pass name or 'pkg.module:function')." if missing[0].endswith("].name")
                                 else "."))
        return OmegaConf.to_object(node)
    except _MERGE_ERRORS as exc:
        raise config_error(exc, prefix=path) from None


def merge_into(node: DictConfig, source: Mapping[Any, Any], path: str) -> None:
    """Merge ``source`` into ``node`` (a structured node at key ``path``) one key at a time, so that OmegaConf's own
    error names the full key: its merge of a whole mapping loses the key of a record given a scalar and of a key
    inside a list of records, and lets an integer too large for a float through raw, without it."""
    for key, value in source.items():
        full = f"{path}.{key}" if path else str(key)
        child = node._get_node(key, validate_access=False)  # None: a key the node does not have
        try:
            if isinstance(child, DictConfig) and isinstance(value, dict) and not child._is_none():
                merge_into(child, value, full)
            elif isinstance(child, (DictConfig, ListConfig)) and value is not None and \
                    not isinstance(value, dict if isinstance(child, DictConfig) else (list, tuple)):
                raise ConfigError(f"{full}: expected a {'mapping' if isinstance(child, DictConfig) else 'list'}, "
                                  f"got {type(value).__name__} {value!r:.80}.")
            elif isinstance(child, ListConfig) and value is not None:
                node[key] = []
                _extend(node._get_node(key), value, full)
            else:
                node[key] = value
        except _MERGE_ERRORS as exc:
            raise config_error(exc, key=full, node=child) from None


def _extend(items: ListConfig, values: Sequence[Any], path: str) -> None:
    """Append ``values`` to ``items`` (the list at key ``path``): a record item as the record merged key by key."""
    element = items._metadata.element_type
    for i, value in enumerate(values):
        if dataclasses.is_dataclass(element) and not isinstance(value, dict):  # (a pass's name was made a mapping)
            keys = [f.name for f in dataclasses.fields(element)]
            raise ConfigError(f"{path}[{i}]: expected {'a name or ' if 'name' in keys else ''}a mapping with keys "
                              f"{', '.join(keys)}, got {type(value).__name__} {value!r:.80}.")
        try:
            if dataclasses.is_dataclass(element) and isinstance(value, dict):
                items.append(OmegaConf.structured(element))
                merge_into(items._get_node(i), value, f"{path}[{i}]")
            else:
                items.append(value)
        except _MERGE_ERRORS as exc:
            raise config_error(exc, key=f"{path}[{i}]") from None


# OmegaConf wraps most failures in its own exceptions, but lets some through (OverflowError for a huge int in a float
# field): none of them may escape as anything but a ConfigError.
_MERGE_ERRORS = (OmegaConfBaseException, ValueError, TypeError, OverflowError)


def run_check(node: Any, prefix: str) -> None:
    """``node.check()``, its ``ValueError`` (which names the key relative to ``node``) as a ConfigError naming the
    full key (``prefix``: the node's, with its dot)."""
    error = None
    try:
        node.check()
    except ValueError as exc:
        error = exc
    if error is not None:  # raised here, not in the handler: the ValueError is not the ConfigError's context
        if error.__cause__ is not None:  # user code that failed to import: its traceback stays
            raise ConfigError(f"{prefix}{error}") from error.__cause__
        raise ConfigError(f"{prefix}{error}")
