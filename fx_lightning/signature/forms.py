"""Call forms: a call of the model with a value of a flag or count that no observed call had, exported beside the
artifact as one of its own.

The observed calls show one value of each Python constant forward takes (``rev`` never passed, so ``False``; RAFT's
``num_flow_updates=8`` in every validation call), and the artifact computes with that value only: a call with
another one is refused by name. The served call is often that other one: forward's default (RAFT's predict leaves
``num_flow_updates`` out, which means 12), or the other value of a bool flag (FrEIA's ``inn(z, rev=True)``, the
inverse). Each such form is the observed calls with that one argument changed: captured, proven on those inputs
against the model called the same way, and exported under ``forms/<argument>=<value>`` with its own manifest;
:class:`~fx_lightning.export.load.forms.WithForms` sends each call to the form it is.

Only forms forward's own signature names are made: forward's default where the calls had another value (a flag, a
count; ``None`` for an optional input every call passed that no stand-in replaces: the PPO rollout's ``agent(obs)``
samples the action its training calls passed), and the other value of a bool whose default is a bool. Nothing else
is guessed (an int's other values are unbounded)."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Collection, Dict, List, Mapping, Optional, Sequence, Union

from torch import nn

from fx_lightning.common.calls import Call

__all__ = ["CallForm", "call_forms", "MAX_FORMS"]

Scalar = Union[bool, int, float, str, None]
_SCALARS = (bool, int, float, str)
_MISSING = object()
# Each form is a capture, a parity run and an export of its own, at the end of fit and in the preflight.
MAX_FORMS = 4


@dataclass(frozen=True)
class CallForm:
    """forward's ``argument`` (at ``position`` among forward's parameters; -1: keyword only) given ``value`` (None:
    left out, an optional input's default).
    ``default``: the value is forward's default, so a call leaving the argument out is this form too.
    ``directory``: the form's export, relative to the artifact's (set when it is written)."""

    argument: str
    position: int
    value: Scalar
    default: bool
    directory: str = ""

    @property
    def name(self) -> str:
        return f"{self.argument}={self.value!r}"

    @property
    def slug(self) -> str:
        """The name as a directory name (letters, digits, ``=._-``)."""
        return re.sub(r"[^A-Za-z0-9=._-]", "_", self.name)

    def given(self, call: Call) -> Any:
        """The value ``call`` gives the argument (by name or position), else ``_MISSING``."""
        if self.argument in call.kwargs:
            return call.kwargs[self.argument]
        if 0 <= self.position < len(call.args):
            return call.args[self.position]
        return _MISSING

    def takes(self, call: Call) -> bool:
        """Whether ``call`` is this form: it gives the argument this value (a bool as a bool), or leaves it out
        where this value is forward's default."""
        given = self.given(call)
        if given is _MISSING:
            return self.default
        if self.value is None:
            return given is None
        return type(given) is type(self.value) and given == self.value

    def applied(self, call: Call) -> Call:
        """``call`` with the argument given this value, where the call gave it (by position or by name); None: left
        out (None in its place where an argument after it is given by position)."""
        if self.value is None and self.argument in call.kwargs:
            return Call(tuple(call.args), {k: v for k, v in call.kwargs.items() if k != self.argument})
        if self.value is None and self.position == len(call.args) - 1:
            return Call(tuple(call.args[:-1]), dict(call.kwargs))
        if self.argument not in call.kwargs and 0 <= self.position < len(call.args):
            args = list(call.args)
            args[self.position] = self.value
            return Call(tuple(args), dict(call.kwargs))
        return Call(tuple(call.args), {**call.kwargs, self.argument: self.value})

    def to_dict(self) -> Dict[str, object]:
        return {"argument": self.argument, "position": self.position, "value": self.value, "default": self.default,
                "directory": self.directory}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CallForm":
        value = data["value"]
        if value is not None and type(value) not in _SCALARS:
            raise ValueError(f"call form value {value!r}: a bool, int, float or str")
        return cls(str(data["argument"]), int(data["position"]), value, bool(data["default"]),
                   str(data.get("directory") or ""))


def call_forms(module: nn.Module, calls: Sequence[Call], covered: Collection[str] = ()) -> List[CallForm]:
    """The forms of ``module``'s forward that no call in ``calls`` made, each one argument away from them: forward's
    default for a Python constant the calls gave another value (the same in every call), an optional input (default
    None) every call passed left out, unless the artifact already takes it left out (``covered``: a stand-in, labels
    left out), and the other value of a bool whose default is a bool and which every call left at one value."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # a builtin or C forward: nothing to read
        return []
    forms: List[CallForm] = []
    for position, p in enumerate(parameters):
        index = position if p.kind is p.POSITIONAL_OR_KEYWORD else -1
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            continue
        probe = CallForm(p.name, index, p.default, True)
        if p.default is None:
            if calls and p.name not in covered and all(probe.given(call) not in (_MISSING, None) for call in calls):
                forms.append(probe)  # passed by every call: leaving it out is another call
            continue
        if type(p.default) not in _SCALARS:
            continue
        values = [probe.given(call) for call in calls]
        values = [p.default if v is _MISSING else v for v in values]
        observed = _one_value(values)
        if observed is _MISSING:
            continue
        if not (type(observed) is type(p.default) and observed == p.default):
            forms.append(probe)  # the calls had another value: a call leaving it out means the default
        elif type(p.default) is bool:
            forms.append(CallForm(p.name, index, not p.default, False))
    return forms


def _one_value(values: Sequence[Any]) -> Any:
    """The one scalar every value is (equal and of one type), else ``_MISSING``."""
    first: Optional[Any] = values[0] if values else _MISSING
    if first is _MISSING or type(first) not in _SCALARS:
        return _MISSING
    same = all(type(v) is type(first) and v == first for v in values)
    return first if same else _MISSING
