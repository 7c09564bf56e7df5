"""The project's exceptions. Every error we raise on purpose derives from :class:`FXLightningError`."""

from __future__ import annotations

__all__ = [
    "FXLightningError",
    "ConfigError",
    "TraceError",
    "PassError",
    "ParityError",
    "ExportError",
    "first_line",
]


class FXLightningError(RuntimeError):
    """Base class of fx-lightning's errors."""


class ConfigError(FXLightningError, ValueError):
    """A configuration key has a bad value; the message names the full key, the value and what is allowed."""


class TraceError(FXLightningError):
    """The module could not be captured; the message names the module, the source line and the fixes."""


class PassError(FXLightningError):
    """A graph pass raised or left a graph that does not lint; names the pass."""


class ParityError(FXLightningError):
    """The fused model does not give the same answers as the original."""


class ExportError(FXLightningError):
    """An export could not be written or read back."""


def first_line(exc: BaseException, *, with_type: bool = False) -> str:
    """The first line of ``exc``'s message (its type name when it has none), for one-line summaries.

    ``with_type``: prefix the type name (``"KeyError: 'x'"``), except for our own errors, whose first line
    already says what failed.
    """
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    if with_type and text and not isinstance(exc, FXLightningError):
        return f"{type(exc).__name__}: {line}"
    return line
