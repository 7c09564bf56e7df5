"""The call forms step (:mod:`~fx_lightning.signature.forms`): each form's calls are the observed calls with one
argument changed; they are fused and proven as the artifact's were (:func:`.steps.fuse_target`, :func:`.steps.measure`,
:func:`.steps.judge`), and those that pass are exported beside it by the export step.

A form never stops anything: one that cannot be captured, disagrees with the model or cannot be written is left
out with a note saying why, and its calls are refused by name as before. The preflight makes the same forms."""

from __future__ import annotations

import dataclasses
from typing import Any, List, Union

import torch

from fx_lightning.config import FuseConfig, Selection, Strategy
from fx_lightning.common.calls import Call, run_seeded
from fx_lightning.common.notes import Note, NoteKind
from fx_lightning.errors import first_line
from fx_lightning.export.progress import Progress
from fx_lightning.pipeline.records import Fused, FusedForm, FusedForms, Observations, ObservedStep, Source
from fx_lightning.pipeline.steps import fuse_target, judge, measure
from fx_lightning.signature.absent import leaf_steps
from fx_lightning.signature.forms import MAX_FORMS, decoder_maker, CallForm, call_forms, own_defaults

__all__ = ["fuse_forms", "form_config", "FORM_EXPORTED", "FORM_NOT_EXPORTED", "FORMS_NOT_MADE"]

FORM_EXPORTED = NoteKind("call_form_exported", "call form {form} exported to {directory}: load_fused sends the calls "
                                               "that {how} to it (proven on the observed calls so given)")
FORM_NOT_EXPORTED = NoteKind("call_form_not_exported", "call form {form} not exported ({reason}): the calls that "
                                                       "{how} are refused by name")
FORMS_NOT_LOOKED_FOR = NoteKind("call_forms_not_looked_for", "call forms not looked for ({reason}): calls other than "
                                                             "the observed ones are refused by name")
FORMS_NOT_MADE = NoteKind("call_forms_not_made", "call forms {forms} not made: at most {limit} are (set "
                                                 "export.call_forms: false for none)")


def how_called(form: CallForm) -> str:
    """Which calls a form takes, in words."""
    if form.feedback is not None:
        return f"pass {form.argument} (the model's output {form.feedback} of a previous call, as a recurrent step does)"
    if form.replaces is not None:
        return f"pass {form.argument} without {form.replaces} (generation's call)"
    given = f"pass {form.name}"
    return f"{given} or leave {form.argument} out" if form.default else given


def fuse_forms(config: FuseConfig, fused: Fused, source: Source, *, final: bool, progress: Progress) -> FusedForms:
    """The call forms of ``fused``'s target that no observed call made, each fused and proven on the observed
    calls given that form; ``final``: a form whose parity failed is left out (the preflight measures it only).
    ``made`` fuses each form as the export asks for it, after the artifact's own: one fused copy at a time."""
    observed = source.observed
    if not config.export.call_forms or observed is None:  # no observed calls: no values to vary from
        return FusedForms()
    calls = [s.target for s in [*observed.steps, *observed.calibration]]
    signature = fused.signature
    covered = {signature.argument_name(leaf_steps(leaf)[0]) for leaf in signature.inputs
               if (leaf.optional or leaf.unread) and leaf_steps(leaf)} | set(signature.left_out)
    built = [s.target for s in fused.steps]
    try:
        forms = call_forms(fused.reference, calls, built, {name for name in covered if name},
                           run=lambda call: run_seeded(fused.reference, call))
    except Exception as exc:  # noqa: BLE001 - looking for forms never stops the artifact
        return FusedForms(iter(()), [FORMS_NOT_LOOKED_FOR(reason=first_line(exc))])
    notes: List[Note] = []
    if len(forms) > MAX_FORMS:
        notes.append(FORMS_NOT_MADE(forms=", ".join(f.name for f in forms[MAX_FORMS:]), limit=MAX_FORMS))
    own_config = form_config(config)
    made = (_fuse_form(form, fused, source, own_config, final=final, progress=progress) for form in forms[:MAX_FORMS])
    return FusedForms(made, notes, own_defaults(fused.reference, built))


def _fuse_form(form: CallForm, fused: Fused, source: Source, config: FuseConfig, *, final: bool,
               progress: Progress) -> Union[FusedForm, Note]:
    """``form`` fused and proven on the observed calls given that form, or the note saying why it is left out."""
    with progress.step(f"call form {form.name}") as end:
        try:
            form_fused = fuse_target(_with_form(source, fused, form), config)
            parity = judge(measure(form_fused, config), config)
        except Exception as exc:  # noqa: BLE001 - the form is left out, saying why; the artifact stands
            end.result = "left out"
            return FORM_NOT_EXPORTED(form=form.name, reason=first_line(exc), how=how_called(form))
        if final and parity is not None and not parity.passed:
            end.result = "left out (parity failed)"
            reason = "parity failed: " + "; ".join(str(f) for f in parity.failures)
            return FORM_NOT_EXPORTED(form=form.name, reason=reason, how=how_called(form))
        end.result = "proven"
        return FusedForm(form, form_fused, parity, config)


def _made_value(fused: Fused, form: CallForm, call: Call) -> Any:
    """The value a form gives its argument on ``call`` where the model makes it: its own output on the call
    (``feedback``), or its decoder's inputs from the call's labels (``replaces``); else None."""
    if form.feedback is not None:
        return run_seeded(fused.reference, call)
    if form.replaces is not None:
        with torch.no_grad():
            make = decoder_maker(fused.reference)
            assert make is not None  # the form was made because it exists
            return make(labels=call.kwargs[form.replaces])
    return None


def form_config(config: FuseConfig) -> FuseConfig:
    """The config a form is exported with: the artifact's formats and passes, no lossy variants, no selection, no
    forms of its own and nothing logged to MLflow (the artifact's export does)."""
    passes = config.passes
    for key in ("quantize_int8", "cast_bf16"):
        if hasattr(passes, key):
            passes = dataclasses.replace(passes, **{key: dataclasses.replace(getattr(passes, key), enabled=False)})
    export = dataclasses.replace(config.export, select=Selection.preference, select_strategy=Strategy.min_latency,
                                 latency_budget_ms=None, call_forms=False,
                                 mlflow=dataclasses.replace(config.export.mlflow, enabled=False))
    return dataclasses.replace(config, passes=passes, export=export)


def _with_form(source: Source, fused: Fused, form: CallForm) -> Source:
    """``source`` whose observed calls are the target's calls parity used (at the weights fused) given ``form``,
    compared on the target alone (the whole model's call passes the value the steps gave)."""
    observed = source.observed
    assert observed is not None
    steps = [ObservedStep(form.applied(s.target, _made_value(fused, form, s.target)), None, s.samples, s.labels)
             for s in fused.steps]
    fed = form.feedback is not None or form.replaces is not None or form.value is None  # the inputs change
    # No calibration calls: a form has no lossy variants to calibrate.
    calls = Observations(fused.target, steps, list(observed.shapes) if not fed else [], [], observed.stage)
    return dataclasses.replace(source, observed=calls, notes=[],
                               batches=dataclasses.replace(source.batches, notes=[]))
