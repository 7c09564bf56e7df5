"""Loading a configuration: every source merged into the schema, and every failure as a :class:`ConfigError`.

Every entry point (``fuse()``, ``FXFuseCallback``, the CLI, Hydra) goes through :func:`load_config`, so a
typo or a bad value fails the same way everywhere: a :class:`ConfigError` that names the full key, the
value given and what is allowed, raised before any work (or training step) starts. The types are OmegaConf's to
check (:func:`fx_lightning.errors.load_record` sets one key at a time, so its errors name the full key), worded by
:func:`fx_lightning.errors.config_error`, and each dataclass's ``check()`` (:mod:`fx_lightning.config.schema`)
gets its full key prefixed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, Tuple, Union

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fx_lightning.common.imports import exception_text
from fx_lightning.config.schema import ExtraPassConfig, FuseConfig
from fx_lightning.errors import ConfigError, config_error, load_record, merge_into, run_check
from fx_lightning.passes import Stage, resolve_pass

__all__ = ["ConfigLike", "load_config", "validate", "to_yaml", "to_container"]

ConfigLike = Union[FuseConfig, DictConfig, Dict[str, Any], None]


def load_config(config: ConfigLike = None, **overrides: Any) -> FuseConfig:
    """Merge ``config`` (dataclass, dict, DictConfig or None) and keyword overrides into the schema.

    Returns a validated :class:`FuseConfig` object. Raises :class:`ConfigError` naming the full key.
    """
    sources = ([config] if config is not None else []) + [{k: v} for k, v in overrides.items() if v is not None]
    cfg = load_record(FuseConfig, [_normalise(_to_plain(source)) for source in sources])
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


def _to_plain(source: Any, path: str = "") -> Any:
    """``source`` as plain containers; ``path``: the dotted key ``source`` sits at (for error messages)."""
    if isinstance(source, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(source, resolve=True, enum_to_str=False)
        except OmegaConfBaseException as exc:
            # full_key is relative to this node: prefix the key it sits at, so the message names it.
            raise config_error(exc, prefix=path) from None
    if dataclasses.is_dataclass(source) and not isinstance(source, type):
        return OmegaConf.to_container(OmegaConf.structured(source), enum_to_str=False)
    if isinstance(source, dict):
        return {k: _to_plain(v, f"{path}.{k}" if path else str(k)) if isinstance(v, (DictConfig, ListConfig)) or (
            dataclasses.is_dataclass(v) and not isinstance(v, type)) else v for k, v in source.items()}
    raise ConfigError(
        f"config: expected a FuseConfig, dict or DictConfig, got {type(source).__name__} ({source!r:.80})"
    )


# Keys that moved: (section, key) -> where to, and why. Refused naming the new key, not as an unknown one.
_MOVED = {("trace", "dynamic_batch"): "export.dynamic_batch (one knob for the capture and the artifacts)"}


def _normalise(plain: Any) -> Any:
    """Accept shorthands OmegaConf cannot: ``passes.extra: ["name", ...]`` and ``passes.X: false``."""
    if not isinstance(plain, dict):
        return plain
    for (section, key), moved_to in _MOVED.items():
        if isinstance(plain.get(section), dict) and key in plain[section]:
            raise ConfigError(f"{section}.{key}: moved to {moved_to}; got {plain[section][key]!r}.")
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
    typed = OmegaConf.structured(spec.options_type)
    merge_into(typed, extra.options, f"passes.extra[{i}].options")
    converted = OmegaConf.to_container(typed, enum_to_str=True)
    assert isinstance(converted, dict)
    return {key: converted[key] for key in extra.options}
