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
samples the action its training calls passed), the other value of a bool whose default is a bool, and an optional
input no call passed fed the model's own output (a char-RNN's generation step ``model(x_t, hidden)`` passes the
``hidden`` the previous call returned): where exactly one of the outputs runs in its place and changes the outputs.
Nothing else is guessed (an int's other values are unbounded)."""

from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Collection, Dict, List, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from fx_lightning.common.calls import Call

__all__ = ["MISSING", "DECODER_FROM_LABELS", "decoder_maker", "CallForm", "call_forms", "own_defaults", "fed_output", "MAX_FORMS"]

Scalar = Union[bool, int, float, str, None]
_SCALARS = (bool, int, float, str)
MISSING = object()  # an argument a call does not give
# Each form is a capture, a parity run and an export of its own, at the end of fit and in the preflight.
MAX_FORMS = 4


@dataclass(frozen=True)
class CallForm:
    """forward's ``argument`` (at ``position`` among forward's parameters; -1: keyword only) given ``value`` (None:
    left out, an optional input's default).
    ``default``: the value is forward's default, so a call leaving the argument out is this form too.
    ``directory``: the form's export, relative to the artifact's (set when it is written). ``feedback``: the
    argument is given the model's own output at this top-level position of its outputs on the same call (the form
    takes any value given: a recurrent state). ``replaces``: the argument is given in place of this one, as the
    model's own ``prepare_decoder_input_ids_from_labels`` makes it (a seq2seq model trained with ``labels`` is
    served ``decoder_input_ids``: generation's call)."""

    argument: str
    position: int
    value: Scalar
    default: bool
    directory: str = ""
    feedback: Optional[Union[int, str]] = None
    replaces: Optional[str] = None

    @property
    def name(self) -> str:
        if self.replaces is not None:
            return f"{self.argument}=<from {self.replaces}>"
        if self.feedback is not None:
            return f"{self.argument}=<output {self.feedback}>"
        return f"{self.argument}={self.value!r}"

    @property
    def label(self) -> str:
        """The name, saying where leaving the argument out is this form too."""
        return f"{self.name} (or left out)" if self.default else self.name

    @property
    def slug(self) -> str:
        """The name as a directory name (letters, digits, ``=._-``)."""
        name = f"{self.argument}=from_{self.replaces}" if self.replaces is not None else \
            f"{self.argument}=output{self.feedback}" if self.feedback is not None else self.name
        return re.sub(r"[^A-Za-z0-9=._-]", "_", name)

    def given(self, call: Call) -> Any:
        """The value ``call`` gives the argument (by name or position), else ``MISSING``."""
        if self.argument in call.kwargs:
            return call.kwargs[self.argument]
        if 0 <= self.position < len(call.args):
            return call.args[self.position]
        return MISSING

    def takes(self, call: Call) -> bool:
        """Whether ``call`` is this form: it gives the argument this value (a bool as a bool), or leaves it out
        where this value is forward's default."""
        given = self.given(call)
        if given is MISSING:
            return self.default
        if self.replaces is not None:
            return given is not None and call.kwargs.get(self.replaces) is None
        if self.feedback is not None:
            return given is not None
        if self.value is None:
            return given is None
        return type(given) is type(self.value) and given == self.value

    def applied(self, call: Call, outputs: Any = None) -> Call:
        """``call`` with the argument given this value, where the call gave it (by position or by name); None: left
        out (None in its place where an argument after it is given by position). A feedback form gives it the
        output of ``outputs`` (the model's on ``call``) at its position."""
        if self.replaces is not None:  # ``outputs``: the value made from the argument it replaces
            kwargs = {k: v for k, v in call.kwargs.items() if k != self.replaces}
            return Call(tuple(call.args), {**kwargs, self.argument: outputs})
        if self.feedback is not None:
            return Call(tuple(call.args), {**call.kwargs, self.argument: outputs[self.feedback]})
        if self.value is None and (self.argument in call.kwargs or self.position == len(call.args) - 1):
            return self.without(call)
        if self.argument not in call.kwargs and 0 <= self.position < len(call.args):
            args = list(call.args)
            args[self.position] = self.value
            return Call(tuple(args), dict(call.kwargs))
        return Call(tuple(call.args), {**call.kwargs, self.argument: self.value})

    def without(self, call: Call) -> Call:
        """``call`` with the argument left out (by name, or as the last positional argument), where it can be."""
        if self.argument in call.kwargs:
            return Call(tuple(call.args), {k: v for k, v in call.kwargs.items() if k != self.argument})
        if self.position >= 0 and self.position == len(call.args) - 1:
            return Call(tuple(call.args[:-1]), dict(call.kwargs))
        return call

    def to_dict(self) -> Dict[str, object]:
        return {"argument": self.argument, "position": self.position, "value": self.value, "default": self.default,
                "directory": self.directory, **({"feedback": self.feedback} if self.feedback is not None else {}),
                **({"replaces": self.replaces} if self.replaces is not None else {})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CallForm":
        value = data["value"]
        if value is not None and type(value) not in _SCALARS:
            raise ValueError(f"call form value {value!r}: a bool, int, float or str")
        feedback = data.get("feedback")
        return cls(str(data["argument"]), int(data["position"]), value, bool(data["default"]),
                   str(data.get("directory") or ""), feedback if isinstance(feedback, (int, str)) else None,
                   str(data["replaces"]) if data.get("replaces") else None)


def call_forms(module: nn.Module, calls: Sequence[Call], built: Sequence[Call] = (), covered: Collection[str] = (),
               run: Optional[Callable[[Call], Any]] = None) -> List[CallForm]:
    """The forms of ``module``'s forward other than the artifact's own (``built``: the calls it is built from, by
    default ``calls``), each one argument away from them, as ``calls`` (every call observed: training's too) and
    forward's signature show them: a Python constant's value in another observed call and forward's default for it
    (RAFT's training leaves ``num_flow_updates`` out, its validation passes 4), the other value of a bool whose
    default is a bool, an optional input (default None) every call passed left out unless the artifact already
    takes it left out (``covered``: a stand-in, labels left out), and an optional input no call passed fed the one
    output that runs in its place (``run``: the model on a call, tried on the first built call)."""
    built = list(built) or list(calls)
    forms: List[CallForm] = []
    if run is not None and built:  # the model's outputs on the first built call, once for every experiment
        run = _first_run_once(run, built[0])
    for p, index in _parameters(module):
        probe = CallForm(p.name, index, p.default, True)
        values = [probe.given(call) for call in calls]
        if p.default is None:
            if calls and p.name not in covered and all(isinstance(v, torch.Tensor) for v in values):
                forms.append(probe)  # an input every call passed: leaving it out is another call
            elif built and run is not None and all(v is MISSING or v is None for v in values):
                forms += _made_by_the_model(module, probe, built[0], run)
            continue
        if type(p.default) not in _SCALARS:
            continue
        own = _one_value([p.default if v is MISSING else v for v in (probe.given(call) for call in built)])
        if own is MISSING:  # the artifact's own calls vary: not one value to vary from
            continue
        others = [p.default] + ([not p.default] if type(p.default) is bool else [])  # never a guess between
        for value in others:
            if not (type(value) is type(own) and value == own) and value == value:  # another value (not a NaN)
                forms.append(CallForm(p.name, index, value, type(value) is type(p.default) and value == p.default))
    decoder = CallForm("decoder_input_ids", -1, None, False, replaces="labels")
    if built and run is not None and _passes_keywords(module) and not any(f.replaces for f in forms) and \
            all(decoder.given(c) is MISSING for c in calls) and decoder_inputs_from_labels(module, decoder, built[0], run):
        forms.append(decoder)  # forward(**batch) passes them on to the seq2seq model (a LightningModule around it)
    # The forms the model itself makes an argument for (generation's calls) first: at most MAX_FORMS are made.
    return sorted(forms, key=lambda f: f.replaces is None and f.feedback is None)


def _made_by_the_model(module: nn.Module, form: CallForm, call: Call, run: Callable[[Call], Any]) -> List[CallForm]:
    """The form of an optional argument no call passed whose value the model makes: its decoder's inputs from the
    labels, else its own output fed back (a recurrent state); none where it makes none."""
    if decoder_inputs_from_labels(module, form, call, run):
        return [CallForm(form.argument, form.position, None, False, replaces="labels")]
    fed = fed_output(form, call, run)
    return [CallForm(form.argument, form.position, None, False, feedback=fed)] if fed is not None else []


def _passes_keywords(module: nn.Module) -> bool:
    """Whether forward takes any keyword (``forward(self, **batch)``)."""
    try:
        return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False


def own_defaults(module: nn.Module, built: Sequence[Call]) -> List[CallForm]:
    """forward's Python-constant and None defaults no call in ``built`` passed: the artifact computes with them, so a
    call giving one explicitly (``rev=False``; ``hidden=None``, a generation loop's first step) is the artifact's own
    call (these forms have no directory)."""
    return [CallForm(p.name, index, p.default, True) for p, index in _parameters(module)
            if (p.default is None or type(p.default) in _SCALARS)
            and all(CallForm(p.name, index, None, True).given(c) is MISSING for c in built)]


def _parameters(module: nn.Module) -> List[Any]:
    """forward's parameters that a call may give by name (each with its position; -1: keyword only)."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # a builtin or C forward: nothing to read
        return []
    return [(p, position if p.kind is p.POSITIONAL_OR_KEYWORD else -1) for position, p in enumerate(parameters)
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


# A seq2seq model's own method making its decoder's inputs from the labels (transformers' T5, BART, Whisper...).
DECODER_FROM_LABELS = "prepare_decoder_input_ids_from_labels"


def decoder_maker(module: nn.Module) -> Optional[Callable[..., Any]]:
    """The model's :data:`DECODER_FROM_LABELS`: its own, else that of the one submodule that has it (a
    LightningModule around a T5), else the shift its forward applies to labels where transformers declares it as a
    function beside the model's class (Whisper: ``shift_tokens_right(labels, pad, start)`` with its config's ids).
    A candidate only: :func:`decoder_inputs_from_labels` proves it on the calls."""
    found = [m for m in module.modules() if callable(getattr(m, DECODER_FROM_LABELS, None))]
    own = getattr(module, DECODER_FROM_LABELS, None)
    if callable(own):
        return own
    if found:
        return getattr(found[0], DECODER_FROM_LABELS) if len(found) == 1 else None
    shifts = {_config_shift(m) for m in module.modules()} - {None}
    if len(shifts) != 1:
        return None
    shift, pad, start = shifts.pop()
    return lambda labels: shift(labels, pad, start)


def _config_shift(module: nn.Module) -> Optional[tuple]:
    """``(shift_tokens_right, pad_token_id, decoder_start_token_id)`` where the module of ``module``'s class defines
    that function (input_ids, pad_token_id, decoder_start_token_id) and its config has both ids, else None."""
    shift = getattr(sys.modules.get(type(module).__module__), "shift_tokens_right", None)
    config = getattr(module, "config", None)
    pad, start = getattr(config, "pad_token_id", None), getattr(config, "decoder_start_token_id", None)
    if not (callable(shift) and isinstance(pad, int) and isinstance(start, int)):
        return None
    try:
        names = list(inspect.signature(shift).parameters)
    except (TypeError, ValueError):
        return None
    return (shift, pad, start) if names == ["input_ids", "pad_token_id", "decoder_start_token_id"] else None


def decoder_inputs_from_labels(module: nn.Module, form: CallForm, call: Call, run: Callable[[Call], Any]) -> bool:
    """Whether ``form``'s argument (never passed) is what ``call``'s ``labels`` stand for: the model's own
    :data:`DECODER_FROM_LABELS` makes it from them, and the model given it without the labels gives the named
    outputs of the labelled call (the loss aside)."""
    make = decoder_maker(module)
    if form.argument != "decoder_input_ids" or make is None or call.kwargs.get("labels") is None:
        return False
    try:
        with_labels = run(call)
        without = run(CallForm(form.argument, form.position, None, False, replaces="labels").applied(
            call, make(labels=call.kwargs["labels"])))
    except Exception:  # noqa: BLE001 - the model's own code: no form
        return False
    if not (isinstance(with_labels, Mapping) and isinstance(without, Mapping)):
        return False
    both = [k for k in with_labels if k in without and isinstance(with_labels[k], torch.Tensor)]
    return bool(both) and len(both) < len(with_labels) and all(_same(without[k], with_labels[k]) for k in both)


def _first_run_once(run: Callable[[Call], Any], first: Call) -> Callable[[Call], Any]:
    """``run``, answering ``first`` (the same object) from one run: each experiment starts from its outputs."""
    done: List[Any] = []

    def once(call: Call) -> Any:
        if call is not first:
            return run(call)
        if not done:
            done.append(run(call))
        return done[0]

    return once


def fed_output(form: CallForm, call: Call, run: Callable[[Call], Any]) -> Optional[Union[int, str]]:
    """The one top-level output of the model on ``call`` (a tensor, or a tuple of them: an LSTM's ``(h, c)``) that,
    given as ``form``'s argument, runs and changes the outputs; None where none or several do (never a guess)."""
    try:
        outputs = run(call)
    except Exception:  # noqa: BLE001 - the model's own code: no form
        return None
    keys = list(outputs) if isinstance(outputs, Mapping) else (
        list(range(len(outputs))) if isinstance(outputs, (tuple, list)) else [])
    found = []
    for key in keys:
        value = outputs[key]
        if not (isinstance(value, torch.Tensor) or isinstance(value, tuple) and value
                and all(isinstance(v, torch.Tensor) for v in value)):
            continue
        try:
            fed = run(Call(tuple(call.args), {**call.kwargs, form.argument: value}))
        except Exception:  # noqa: BLE001 - this output is not what the argument takes
            continue
        if not _same(fed, outputs):
            found.append(key)
    return found[0] if len(found) == 1 else None


def _same(a: Any, b: Any) -> bool:
    """Whether two outputs are equal, tensor for tensor (containers by their items)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _one_value(values: Sequence[Any]) -> Any:
    """The one scalar every value is (equal and of one type), else ``MISSING``."""
    first: Optional[Any] = values[0] if values else MISSING
    if first is MISSING or type(first) not in _SCALARS:
        return MISSING
    same = all(type(v) is type(first) and v == first for v in values)
    return first if same else MISSING
