"""Loading a configuration: every source merged into the schema, and every failure as a :class:`ConfigError`.

Every entry point (``fuse()``, ``FXFuseCallback``, the CLI, Hydra) goes through :func:`load_config`, so a
typo or a bad value fails the same way everywhere: a :class:`ConfigError` that names the full key, the
value given and what is allowed, raised before any work (or training step) starts. Keys are walked here where
OmegaConf's own errors lack the key or the allowed values, OmegaConf's other errors are worded by
:func:`fx_lightning.errors.config_error`, and each dataclass's ``check()`` (:mod:`fx_lightning.config.schema`)
gets its full key prefixed.
"""

from __future__ import annotations

import dataclasses
import typing
from enum import Enum
from typing import Any, Dict, Iterator, List, Tuple, Union

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fx_lightning.common.imports import exception_text
from fx_lightning.config.schema import ExtraPassConfig, FuseConfig
from fx_lightning.errors import ConfigError, config_error, run_check, unknown_key
from fx_lightning.passes import Stage, resolve_pass

__all__ = ["ConfigLike", "load_config", "validate", "to_yaml", "to_container"]

ConfigLike = Union[FuseConfig, DictConfig, Dict[str, Any], None]


def load_config(config: ConfigLike = None, **overrides: Any) -> FuseConfig:
    """Merge ``config`` (dataclass, dict, DictConfig or None) and keyword overrides into the schema.

    Returns a validated :class:`FuseConfig` object. Raises :class:`ConfigError` naming the full key.
    """
    schema = OmegaConf.structured(FuseConfig)
    sources: List[tuple[str, Any]] = []
    if config is not None:
        sources.append(("config", config))
    for key, value in overrides.items():
        if value is not None:
            sources.append((key, {key: value}))
    for label, source in sources:
        plain = _to_plain(source, label)
        _check_keys(plain, FuseConfig, "")
        plain = _normalise(plain)
        try:
            schema = OmegaConf.merge(schema, plain)
        except _MERGE_ERRORS as exc:
            raise config_error(exc) from None
    try:
        # OmegaConf.to_object would silently give a '???' (missing) field its dataclass default.
        missing = sorted(OmegaConf.missing_keys(schema))
        if missing:
            raise ConfigError(
                f"{missing[0]}: missing value ('???'); give a value"
                + (" (a registered pass name or 'pkg.module:function')." if missing[0].endswith("].name") else ".")
            )
        cfg = OmegaConf.to_object(schema)
    except _MERGE_ERRORS as exc:
        raise config_error(exc) from None
    assert isinstance(cfg, FuseConfig)
    validate(cfg)
    # The user passes: resolved, and their options as their options dataclasses read them.
    extras = [dataclasses.replace(e, options=_typed_pass_options(e, i)) for i, e in enumerate(cfg.passes.extra)]
    return dataclasses.replace(cfg, passes=dataclasses.replace(cfg.passes, extra=extras))


def validate(cfg: FuseConfig) -> None:
    """Value checks the type system cannot express: every node's ``check()`` (the config, its sections, the
    options of each built-in pass), its ``ValueError`` as a :class:`ConfigError` naming the full key.
    Changes nothing."""
    for prefix, node in sorted(_checked_nodes(cfg, ""), key=_check_rank):
        run_check(node, prefix)


# The sections in the order their checks run (others after them, in field order): the root's own values
# and the range checks first, then those that import user code (trace, the options of some passes).
_CHECK_ORDER = ("", "parity", "export", "trace", "passes")


def _check_rank(item: Tuple[str, Any]) -> int:
    section = item[0].split(".", 1)[0].split("[", 1)[0]
    return _CHECK_ORDER.index(section) if section in _CHECK_ORDER else len(_CHECK_ORDER)


def _checked_nodes(node: Any, prefix: str) -> Iterator[Tuple[str, Any]]:
    """``(key prefix, dataclass)`` for ``node`` and every dataclass below it that has a ``check()``: the node
    first, then its fields in order (list items included)."""
    if callable(getattr(node, "check", None)):
        yield prefix, node
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from _checked_nodes(value, f"{prefix}{f.name}.")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item) and not isinstance(item, type):
                    yield from _checked_nodes(item, f"{prefix}{f.name}[{i}].")


def to_yaml(cfg: FuseConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_container(cfg: FuseConfig) -> Dict[str, Any]:
    """JSON-safe dict view (enums as their values)."""
    out = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------ the sources


def _to_plain(source: Any, label: str, path: str = "") -> Any:
    """``source`` as plain containers; ``path``: the dotted key ``source`` sits at (for error messages)."""
    if isinstance(source, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(source, resolve=True, enum_to_str=False)
        except OmegaConfBaseException as exc:
            # full_key is relative to this node: prefix the key it sits at, so the message names it.
            raise config_error(exc, prefix=path, what="cannot resolve") from None
    if dataclasses.is_dataclass(source) and not isinstance(source, type):
        return OmegaConf.to_container(OmegaConf.structured(source), enum_to_str=False)
    if isinstance(source, dict):
        return {k: _to_plain(v, label, _join(path, str(k))) if isinstance(v, (DictConfig, ListConfig)) or (
            dataclasses.is_dataclass(v) and not isinstance(v, type)) else v for k, v in source.items()}
    raise ConfigError(
        f"config: expected a FuseConfig, dict or DictConfig, got {type(source).__name__} ({source!r:.80})"
    )


def _normalise(plain: Any) -> Any:
    """Accept shorthands OmegaConf cannot: ``passes.extra: ["name", ...]`` and ``passes.X: false``."""
    if not isinstance(plain, dict):
        return plain
    passes = plain.get("passes")
    if isinstance(passes, dict):
        passes = dict(passes)
        extra = passes.get("extra")
        if isinstance(extra, (list, tuple)):
            passes["extra"] = [{"name": e} if isinstance(e, str) else e for e in extra]
        for name, value in list(passes.items()):
            if isinstance(value, bool) and name != "extra":
                passes[name] = {"enabled": value}
        plain = {**plain, "passes": passes}
    export = plain.get("export")
    if isinstance(export, dict) and isinstance(export.get("formats"), str):
        plain = {**plain, "export": {**export, "formats": [export["formats"]]}}
    return plain


# ------------------------------------------------------------------------- what OmegaConf says without the key

# OmegaConf's merge names the full key of a scalar of the wrong type (config_error words it). Walked here, before
# it and in key order (the first error is the one reported), is what OmegaConf 2.3 reports without the key, without
# the allowed values, or not at all: an unknown key inside a list of records (passes.extra; every unknown key is
# walked, to keep the order), an enum's value (its message lists no names for a value that is not a string), a record
# or mapping given another value, '???' (the default kept), an integer too large for a float (a raw OverflowError),
# a list inside a list of scalars.


def _check_keys(value: Any, schema: type, path: str) -> None:
    """The keys of ``value`` (a mapping at ``path``) known to ``schema`` and their values of its shapes."""
    if not isinstance(value, dict):
        return
    hints = typing.get_type_hints(schema)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(schema)}
    for key, sub in value.items():
        full = _join(path, str(key))
        if key not in fields:
            raise unknown_key(path, str(key), fields)
        if isinstance(sub, str) and sub == "???":
            raise ConfigError(f"{full}: missing value ('???'); give a value.")
        _check_value(sub, _unwrap_optional(fields[key]), full, path)


def _check_value(sub: Any, inner: Any, full: str, path: str) -> None:
    """``sub``, the value at key ``full`` (under ``path``), against its declared type ``inner``: by case."""
    origin = typing.get_origin(inner)
    if dataclasses.is_dataclass(inner):
        if isinstance(sub, dict):
            _check_keys(sub, inner, full)
        elif not (isinstance(sub, bool) and path == "passes") and sub is not None:  # passes.X: on/off shorthand
            raise ConfigError(f"{full}: expected a mapping of {inner.__name__} options, got {sub!r:.80}.")
    elif origin in (list, List):
        if isinstance(sub, (list, tuple)):
            (item_type,) = typing.get_args(inner) or (Any,)
            for i, item in enumerate(sub):
                _check_item(item, item_type, f"{full}[{i}]")
        elif sub is not None and not (isinstance(sub, str) and full == "export.formats"):  # one name: a list of it
            raise ConfigError(f"{full}: expected a list, got {type(sub).__name__} {sub!r:.80}.")
    elif origin in (dict, Dict) and sub is not None and not isinstance(sub, dict):
        raise ConfigError(f"{full}: expected a mapping, got {type(sub).__name__} {sub!r:.80}.")
    elif isinstance(inner, type) and issubclass(inner, Enum):
        _check_enum(sub, inner, full)
    elif inner is float:
        _check_float(sub, full)


def _check_item(item: Any, item_type: Any, key: str) -> None:
    if isinstance(item, str) and item == "???":
        raise ConfigError(f"{key}: missing value ('???'); give a value.")
    if dataclasses.is_dataclass(item_type):
        if isinstance(item, dict):
            _check_keys(item, item_type, key)
            try:  # its types too: OmegaConf's error names only the leaf ("name"), not the item's key
                OmegaConf.merge(OmegaConf.structured(item_type), item)
            except _MERGE_ERRORS as exc:
                raise config_error(exc, prefix=key) from None
        elif not isinstance(item, str):
            raise ConfigError(
                f"{key}: expected a name or a mapping with keys "
                f"{', '.join(f.name for f in dataclasses.fields(item_type))}, got {item!r:.80}."
            )
    elif isinstance(item_type, type) and issubclass(item_type, Enum):
        _check_enum(item, item_type, key)
    elif item_type in (str, int, float, bool) and isinstance(item, (list, tuple, dict)):
        raise ConfigError(f"{key}: expected a {item_type.__name__}, got {type(item).__name__} {item!r:.80}.")
    elif item_type is float:
        _check_float(item, key)


def _check_float(sub: Any, key: str) -> None:
    """An integer given for a float must fit one: OmegaConf raises OverflowError raw, without the key."""
    if isinstance(sub, int) and not isinstance(sub, bool):
        try:
            float(sub)
        except OverflowError:
            raise ConfigError(f"{key}: a {sub.bit_length()}-bit integer is too large for a float.") from None


def _check_enum(value: Any, enum_type: Any, path: str) -> None:
    """OmegaConf's own message for a value that is not a name (a number, None, a list) does not list the names."""
    allowed = [m.name for m in enum_type]
    if not isinstance(value, enum_type) and not (isinstance(value, str) and value in allowed):
        raise ConfigError(f"{path}: invalid value {value!r}. Allowed: {', '.join(allowed)}.")


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# OmegaConf wraps most failures in its own exceptions, but lets some through (OverflowError for a huge int
# in a float field): none of them may escape load_config as anything but a ConfigError.
_MERGE_ERRORS = (OmegaConfBaseException, ValueError, TypeError, OverflowError)


# --------------------------------------------------------------------------------------- the user passes


def _typed_pass_options(extra: ExtraPassConfig, i: int) -> Dict[str, Any]:
    """``passes.extra[i].options`` checked against the pass's options dataclass and converted by it
    (``"false"`` -> False, enums as names); the keys given, no defaults added. Raises ConfigError."""
    if extra.name in ("???", ""):
        raise ConfigError(f"passes.extra[{i}].name: missing; give a registered pass name or 'pkg.module:function'.")
    try:
        spec = resolve_pass(extra.name)
    except (KeyError, ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"passes.extra[{i}].name: {exc.args[0] if exc.args else exc}") from None
    except Exception as exc:  # noqa: BLE001 - importing a user pass may raise anything
        raise ConfigError(f"passes.extra[{i}].name: cannot import {extra.name!r}: {exception_text(exc)}.") from exc
    if spec.stage is not Stage.graph:
        raise ConfigError(
            f"passes.extra[{i}].name: {extra.name!r} works on the module before capture, not on the graph; "
            f"configure it under passes.{extra.name} instead."
        )
    if spec.options_type is None or not extra.options:
        return dict(extra.options)
    option_fields = {f.name for f in dataclasses.fields(spec.options_type)}
    for key in extra.options:
        if key not in option_fields:
            raise ConfigError(f"passes.extra[{i}].options.{key}: unknown option of pass {extra.name!r}; "
                              f"allowed: {', '.join(sorted(option_fields))}.")
    prefix = f"passes.extra[{i}].options"
    _check_keys(extra.options, spec.options_type, prefix)  # huge ints and shapes, with the key
    try:
        typed = OmegaConf.merge(OmegaConf.structured(spec.options_type), extra.options)
    except _MERGE_ERRORS as exc:
        raise config_error(exc, prefix=prefix) from None
    converted = OmegaConf.to_container(typed, enum_to_str=True)
    assert isinstance(converted, dict)
    return {key: converted[key] for key in extra.options}
