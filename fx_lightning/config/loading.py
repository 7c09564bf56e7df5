"""Loading a configuration: every source merged into the schema, and every failure as a :class:`ConfigError`.

Every entry point (``fuse()``, ``FXFuseCallback``, the CLI, Hydra) goes through :func:`load_config`, so a
typo or a bad value fails the same way everywhere: a :class:`ConfigError` that names the full key, the
value given and what is allowed, raised before any work (or training step) starts. Keys are walked here
(OmegaConf loses the path inside lists), OmegaConf's own errors are translated, and each dataclass's
``check()`` (:mod:`fx_lightning.config.schema`) gets its full key prefixed.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from enum import Enum
from typing import Any, Dict, Iterator, List, Tuple, Union

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fx_lightning._imports import exception_text
from fx_lightning.config.schema import ExtraPassConfig, FuseConfig
from fx_lightning.errors import ConfigError
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
            raise _from_omegaconf(exc) from None
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
        raise _from_omegaconf(exc) from None
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
        error = None
        try:
            node.check()
        except ValueError as exc:
            error = exc
        if error is not None:  # raised here, not in the handler: the ValueError is not the ConfigError's context
            if error.__cause__ is not None:  # user code that failed to import: its traceback stays
                raise ConfigError(f"{prefix}{error}") from error.__cause__
            raise ConfigError(f"{prefix}{error}")


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
            raise _from_omegaconf(exc, prefix=path, what="cannot resolve") from None
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


# --------------------------------------------------------------------------------------- the key walker


def _field_types(schema: type) -> Dict[str, Any]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _check_keys(value: Any, schema: type, path: str) -> None:
    """Reject unknown keys at every level, with the full path and the closest valid key.

    OmegaConf checks keys too, but loses the path inside lists; this walk keeps it.
    """
    if not isinstance(value, dict):
        return
    fields = _field_types(schema)
    for key, sub in value.items():
        full = f"{path}.{key}" if path else str(key)
        # OmegaConf's merge keeps the default where the value is '???' (missing): say so instead.
        if isinstance(sub, str) and sub == "???" and key in fields:
            raise ConfigError(f"{full}: missing value ('???'); give a value.")
        if key not in fields:
            # passes.<bool> shorthand and enabled flags are handled later; only unknown names fail here.
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" Did you mean '{_join(path, close[0])}'?" if close else ""
            raise ConfigError(
                f"{full}: unknown key.{hint} Allowed keys under '{path or '<root>'}': "
                f"{', '.join(sorted(fields))}."
            )
        _check_value(sub, _unwrap_optional(fields[key]), full, path)


def _check_value(sub: Any, inner: Any, full: str, path: str) -> None:
    """``sub``, the value at key ``full`` (under ``path``), against its declared type ``inner``: by case."""
    if dataclasses.is_dataclass(inner):
        _check_section(sub, inner, full, path)
    elif typing.get_origin(inner) in (list, List):
        _check_list(sub, inner, full)
    elif typing.get_origin(inner) in (dict, Dict):
        # OmegaConf reports a list or scalar here as "Cannot merge DictConfig with ListConfig" at <config>.
        if sub is not None and not isinstance(sub, dict):
            raise ConfigError(f"{full}: expected a mapping, got {type(sub).__name__} {sub!r:.80}.")
    elif isinstance(inner, type) and issubclass(inner, Enum):
        _check_enum(sub, inner, full)
    elif inner is float:
        _check_float(sub, full)


def _check_float(sub: Any, key: str) -> None:
    """An integer given for a float must fit one: OmegaConf raises OverflowError raw, without the key."""
    if isinstance(sub, int) and not isinstance(sub, bool):
        try:
            float(sub)
        except OverflowError:
            raise ConfigError(f"{key}: a {sub.bit_length()}-bit integer is too large for a float.") from None


def _check_section(sub: Any, schema: type, full: str, path: str) -> None:
    """A nested dataclass: a mapping of its keys (or null; or, under ``passes``, the on/off shorthand)."""
    if isinstance(sub, dict):
        _check_keys(sub, schema, full)
    elif not (isinstance(sub, bool) and path == "passes") and sub is not None:
        raise ConfigError(f"{full}: expected a mapping of {schema.__name__} options, got {sub!r:.80}.")


def _check_list(sub: Any, list_type: Any, full: str) -> None:
    """A list (or null; ``export.formats`` may be one name): each item with its index in the key."""
    (item_type,) = typing.get_args(list_type) or (Any,)
    if isinstance(sub, (list, tuple)):
        for i, item in enumerate(sub):
            _check_item(item, item_type, f"{full}[{i}]")
    elif sub is not None and not (isinstance(sub, str) and full == "export.formats"):
        raise ConfigError(f"{full}: expected a list, got {type(sub).__name__} {sub!r:.80}.")


def _check_item(item: Any, item_type: Any, key: str) -> None:
    if isinstance(item, str) and item == "???":
        raise ConfigError(f"{key}: missing value ('???'); give a value.")
    if dataclasses.is_dataclass(item_type):
        if isinstance(item, dict):
            _check_keys(item, item_type, key)
            _check_types(item, item_type, key)
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


def _check_types(value: Dict[str, Any], schema: type, path: str) -> None:
    """Type-check a list item against its dataclass: OmegaConf's own error there names only the leaf
    ("name: ..."), not the item ("passes.extra[0].name")."""
    try:
        OmegaConf.merge(OmegaConf.structured(schema), value)
    except _MERGE_ERRORS as exc:
        raise _from_omegaconf(exc, prefix=path) from None


def _check_enum(value: Any, enum_type: type, path: str) -> None:
    if isinstance(value, enum_type):
        return
    allowed = [m.name for m in enum_type]  # type: ignore[attr-defined]
    if isinstance(value, str) and value in allowed:
        return
    raise ConfigError(f"{path}: invalid value {value!r}. Allowed: {', '.join(allowed)}.")


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# ------------------------------------------------------------------------------- OmegaConf's errors


# OmegaConf wraps most failures in its own exceptions, but lets some through (OverflowError for a huge int
# in a float field): none of them may escape load_config as anything but a ConfigError.
_MERGE_ERRORS = (OmegaConfBaseException, ValueError, TypeError, OverflowError)


def _from_omegaconf(exc: Exception, prefix: str = "", what: str = "") -> ConfigError:
    if isinstance(exc, ConfigError):
        return exc
    key = getattr(exc, "full_key", None) or ""
    if prefix:
        key = f"{prefix}{key}" if key.startswith("[") else _join(prefix, key) if key else prefix
    key = key or "<config>"
    msg = getattr(exc, "msg", None) or str(exc)
    msg = msg.split("\n")[0]
    if what:
        msg = f"{what}: {msg}"
    value = getattr(exc, "value", None)
    got = f" Got {value!r}." if value is not None and repr(value) not in msg else ""
    return ConfigError(f"{key}: {msg}.{got}".replace("..", "."))


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
            raise ConfigError(
                f"passes.extra[{i}].options.{key}: unknown option of pass {extra.name!r}; "
                f"allowed: {', '.join(sorted(option_fields))}."
            )
    prefix = f"passes.extra[{i}].options"
    _check_keys(extra.options, spec.options_type, prefix)  # enums and huge ints, with the key
    try:
        typed = OmegaConf.merge(OmegaConf.structured(spec.options_type), extra.options)
    except _MERGE_ERRORS as exc:
        raise _from_omegaconf(exc, prefix=prefix) from None
    converted = OmegaConf.to_container(typed, enum_to_str=True)
    assert isinstance(converted, dict)
    return {key: converted[key] for key in extra.options}
