"""The parity gate: measure (per process) -> merge (across ranks) -> judge (once).

:func:`measure_parity` runs the reference (unfused, eval) and the candidate on real batches and updates
torchmetrics metrics; nothing is computed or gated there and there is no collective call, so each rank of a
distributed run measures its own share. :func:`merge_parity_states` combines the states of several ranks
with torchmetrics' ``merge_state`` (sums, maxima, minima: the merge equals one pass over all the data), and
:func:`judge_parity` computes the metrics and applies the thresholds. :func:`check_parity` does all three.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torchmetrics import Metric

from fx_lightning.common.batches import (
    InputRule,
    detached,
    extract_input,
    label_candidates,
    flat_tensors,
    model_device_dtype,
    record_calls,
    to_model,
)
from fx_lightning.common.calls import as_call, no_distribution_validation
from fx_lightning.errors import ConfigError
from fx_lightning.common.notes import Note, NoteKind
from fx_lightning.parity.compare import judged_discrete, shared_specials_zeroed, structure_mismatch
from fx_lightning.parity.options import ParityConfig, load_parity
from fx_lightning.common.tolerance import LOW_PRECISION_FACTOR
from fx_lightning.parity.report import OutputError, ParityReport
from fx_lightning.parity.metrics import (
    CLASSIFICATION_KEYS,
    DISCRETE_KEY,
    LOCAL_ONLY,
    OUTPUT_KEYS,
    PER_OUTPUT_PREFIX,
    Agreement,
    RelativeMaxError,
    SampleErrors,
    classification_metrics,
    error_quantiles,
    log_histogram,
    output_metrics,
)

__all__ = [
    "LOW_PRECISION_FACTOR",
    "GATE_MISSED",
    "OUTPUT_STRUCTURE",
    "NO_BATCHES",
    "ParityReport",
    "ParityState",
    "check_parity",
    "measure_parity",
    "merge_parity_states",
    "judge_parity",
]

# Why the gate failed: each names the metric, the value and the key that sets the threshold.
GATE_MISSED = NoteKind("gate_missed", "{metric} = {value:.6g} {relation} {key} = {threshold:.6g}")
OUTPUT_STRUCTURE = NoteKind("output_structure", "output structure: {mismatch}")
NO_BATCHES = NoteKind("no_batches", "no batches: nothing was compared (give validation data, example_input_array, "
                                    "or set parity.enabled: false)")
CLASS_WIDTHS_DISAGREE = NoteKind("class_widths_disagree",
                                 "ranks disagree on the number of classes in the outputs ({widths})")
# What the gate could not measure, and how it judged.
LABELS_MISMATCH = NoteKind("labels_mismatch", "labels ({labels}) do not match the outputs ({rows} rows): accuracy "
                                              "not measured")
NOT_SCORES_FOR_LABELS = NoteKind("not_scores_for_labels", "the output's last axis ({width} wide) is not the labels' "
                                                          "classes (labels {low} to {high}): not class scores, so "
                                                          "top-1 agreement and accuracy are not measured")
RANKS_DIFFERENT_DATA = NoteKind("ranks_different_data", "ranks compared different data ({sources})")
LOW_PRECISION_GATE = NoteKind("low_precision_gate", "low-precision model: error gate is max(rtol, {factor:g} x the "
                                                    "unfused model's own error against fp64) = {rtol:.3g}")
LOSSY_NOT_GATED = NoteKind("lossy_not_gated", "lossy model: relative error reported, not gated")
NOT_CLASS_SCORES = NoteKind("not_class_scores", "outputs are not class scores: top-1 agreement not measured")
ALL_STOCHASTIC = NoteKind("all_stochastic", "every output of the target ({count}) changes from run to run (drawn at "
                                            "random in forward, in eval mode): nothing deterministic to compare")
NO_LABELS = NoteKind("no_labels", "no integer labels in the batches: accuracy not measured")
EMPTY_OUTPUTS = NoteKind("empty_outputs", "every output was empty on the batches compared (no rows: a score threshold "
                                          "that kept none, say): no value was compared, so the values are unproven")


@dataclass
class ParityState:
    """What parity measured on one process's batches, before the gate; states of several ranks merge.

    Its metrics are on the CPU, so a state can travel through ``torch.distributed.all_gather_object``.
    """

    batches: int = 0
    samples: int = 0
    labels_seen: bool = False
    num_classes: Optional[int] = None  # width of the class scores; None when the outputs are not class scores
    # The lowest and highest integer label seen with class scores (over every batch, every rank): judged once all
    # are in, since one batch of sorted validation data may hold a single class.
    labels_low: Optional[int] = None
    labels_high: Optional[int] = None
    source: str = "given"
    failures: List[Note] = field(default_factory=list)
    notes: List[Note] = field(default_factory=list)
    metrics: Dict[str, Metric] = field(default_factory=dict)


def check_parity(reference: nn.Module, candidate: Callable[..., Any], batches: Iterable[Any],
                 cfg: Union[ParityConfig, Mapping[str, Any], None] = None, *, input_rule: InputRule = None,
                 **options: Any) -> ParityReport:
    """Compare ``candidate`` with ``reference`` (both in eval mode) on up to ``cfg.max_batches`` batches: what
    :func:`measure_parity` measures (``options``: its keywords), gated by :func:`judge_parity`.

    Without ``whole_*``, both are called on the inputs taken out of each batch (``input_rule``, default
    ``cfg.input``). With ``whole_reference``/``whole_candidate`` (the complete models, the fused target in
    place in the candidate), the batch inputs go through the whole models; ``reference`` must be a
    submodule of ``whole_reference``: its inputs and outputs are recorded there and ``candidate`` is
    called on the same inputs. ``precise_reference`` (an fp64 copy of ``reference``) makes the error gate
    relative to the reference's own rounding error, for float16/bfloat16 models.

    Nothing here changes a model's weights or training flags (the caller passes eval-mode models).
    """
    pcfg = load_parity(cfg)
    state = measure_parity(reference, candidate, batches, pcfg,
                           input_rule=pcfg.input if input_rule is None else input_rule, **options)
    return judge_parity(state, pcfg)


# -------------------------------------------------------------------------------------------- measure


class _Measurement:
    """The metrics and counts of one measure_parity call, updated batch by batch."""

    def __init__(self, cfg: ParityConfig, device: Optional[torch.device], notes: Sequence[Note], nested: bool,
                 stochastic: Sequence[int] = (), names: Sequence[str] = (),
                 sample_axes: Sequence[Optional[int]] = ()) -> None:
        self.cfg = cfg
        self.names, self.sample_axes = list(names), list(sample_axes)
        self.per_output: Dict[int, Metric] = {}  # by position among the target's tensors: each output's errors
        self.nested = nested
        self.stochastic = set(stochastic)
        self.device = device
        self.state = ParityState(notes=list(notes))
        # The metrics live on the model's device while measuring, on the CPU in the state.
        self.outputs = {k: self._here(m) for k, m in output_metrics().items()}
        self.whole_error = self._here(RelativeMaxError(**LOCAL_ONLY))
        self.discrete = self._here(Agreement(**LOCAL_ONLY))
        self.own_error = self._here(RelativeMaxError(**LOCAL_ONLY))
        self.classes: Optional[Dict[str, Metric]] = None
        self.not_class_scores = False  # the labels showed the output is not class scores

    def _here(self, metric: Metric) -> Metric:
        return metric.to(self.device) if self.device is not None else metric

    def compare_target(self, calls: List[Tuple[tuple, dict, Any]], outputs: List[Any],
                       precise: Optional[nn.Module], drawn: "_RandomState") -> bool:
        """Update the output metrics for every call of the target; False when the outputs cannot be compared.
        ``precise`` (an fp64 copy of the reference) measures the reference's own error on exactly the outputs
        compared here, with the same random draws (``drawn`` is replayed): an output drawn at random or discrete
        would make that error, and so the low-precision gate, as large as the output itself."""
        for (args, kwargs, ref), cand in zip(calls, outputs):
            mismatch = structure_mismatch(cand, ref, nested=self.nested)
            if mismatch is not None:
                self.state.failures.append(OUTPUT_STRUCTURE(mismatch=mismatch))
                return False
            refs, cands = flat_tensors(ref), flat_tensors(cand)
            if self.stochastic and len(self.stochastic) >= len(refs):
                self.state.failures.append(ALL_STOCHASTIC(count=len(refs)))
                return False
            valued: List[int] = []  # the outputs compared by value: the only ones the own error is measured on
            for i, (r, c) in enumerate(zip(refs, cands)):
                if i in self.stochastic:
                    continue  # drawn at random: its structure was compared above
                if judged_discrete(c, r):  # labels, masks, thresholded scores: judged by agreement
                    self.discrete.update(c.detach(), r.detach())
                    continue
                valued.append(i)
                # .contiguous(): torchmetrics' MAE uses .view(-1), which fails on channels_last.
                c64, r64 = shared_specials_zeroed(c.detach().double().contiguous(), r.detach().double().contiguous())
                for metric in self.outputs.values():
                    metric.update(c64, r64)
                self._per_output(i).update(c64, r64)
            if precise is not None and valued:
                drawn.restore()
                exact = flat_tensors(precise(*to_model(args, None, torch.float64),
                                             **to_model(kwargs, None, torch.float64)))
                for i in valued:
                    self.own_error.update(*shared_specials_zeroed(refs[i].double(), exact[i].double()))
        return not self.state.failures

    def _per_output(self, i: int) -> Metric:
        """Output ``i``'s :class:`SampleErrors`, named as the signature names it (else ``output_<i>``)."""
        if i not in self.per_output:
            name = self.names[i] if i < len(self.names) else f"output_{i}"
            axis = self.sample_axes[i] if i < len(self.sample_axes) else 0
            self.per_output[i] = self._here(SampleErrors(name, axis, **LOCAL_ONLY))
        return self.per_output[i]

    def compare_whole(self, reference_out: Any, candidate_out: Any) -> None:
        for r, c in zip(flat_tensors(reference_out), flat_tensors(candidate_out)):
            if r.shape == c.shape:
                self.whole_error.update(*shared_specials_zeroed(c.double(), r.double()))

    def compare_classes(self, reference_out: Any, candidate_out: Any, candidates: Sequence[torch.Tensor]) -> None:
        """Top-1 agreement and accuracy, when the first output looks like class scores. The labels are the first of
        the batch's ``candidates`` with one value per row, each a class of the scores (a text batch's lengths or
        offsets come before its labels); when none is, the first, which may show the output is not class scores."""
        refs, cands = flat_tensors(reference_out), flat_tensors(candidate_out)
        if not refs or not cands or refs[0].shape != cands[0].shape:
            return
        lr, lc = refs[0].double(), cands[0].double()
        self.state.samples += lr.shape[0] if lr.dim() else 1
        if lr.dim() < 2 or lr.shape[-1] < 2:
            return  # not class scores: no top-1
        lr, lc = lr.reshape(-1, lr.shape[-1]), lc.reshape(-1, lc.shape[-1])
        if lr.shape[0] == 0:
            return  # no rows to pick a class in (a detector that kept no box)
        num_classes = lr.shape[-1]
        labels = _labels_for(candidates, lr.shape[0], num_classes)
        if self.not_class_scores or self._labels_rule_out_scores(labels, lr.shape[0], num_classes):
            return
        if self.classes is None:
            self.classes = {k: self._here(m) for k, m in classification_metrics(num_classes).items()}
            self.state.num_classes = num_classes
        ref_top1, cand_top1 = lr.argmax(dim=-1), lc.argmax(dim=-1)
        # A near tie in the reference (top two within rtol of its scale) may flip under any rounding:
        # count the candidate's pick as agreeing when the reference scores it within that tolerance.
        tol = self.cfg.rtol * lr.abs().amax(dim=-1)
        picked = lr.gather(-1, cand_top1[:, None])[:, 0]
        tolerant = torch.where(picked >= lr.amax(dim=-1) - tol, ref_top1, cand_top1)
        self.classes["top1_agreement"].update(tolerant, ref_top1)
        self.classes["top1_agreement_strict"].update(cand_top1, ref_top1)
        if labels is None:
            return
        labels = labels.reshape(-1).to(lr.device)
        if labels.numel() != lr.shape[0]:
            _note_once(self.state.notes, LABELS_MISMATCH(labels=labels.numel(), rows=lr.shape[0]))
        else:
            self.state.labels_seen = True
            self.classes["accuracy_reference"].update(ref_top1, labels)
            self.classes["accuracy_fused"].update(cand_top1, labels)

    def _labels_rule_out_scores(self, labels: Optional[torch.Tensor], rows: int, width: int) -> bool:
        """Whether the batch's integer labels show the output is not class scores: labels beyond its width.
        Decided once: the class metrics of earlier batches are dropped with it. (Classes filling under half of
        the width, as a 128-wide embedding against 10 classes, are judged on all batches: see
        ``labels_fill_the_scores``.)"""
        if labels is None or labels.numel() != rows or labels.numel() == 0:
            return False
        low, high = int(labels.min()), int(labels.max())
        if 0 <= low and high < width:
            state = self.state
            state.labels_low = low if state.labels_low is None else min(state.labels_low, low)
            state.labels_high = high if state.labels_high is None else max(state.labels_high, high)
            return False
        self.not_class_scores = True
        self.classes, self.state.num_classes, self.state.labels_seen = None, None, False
        _note_once(self.state.notes, NOT_SCORES_FOR_LABELS(width=width, low=low, high=high))
        return True

    def finish(self, source: str, whole: bool, precise: bool) -> ParityState:
        metrics: Dict[str, Metric] = dict(self.outputs)
        absolute = metrics.get("mean_absolute_error")
        if absolute is not None and absolute.update_called and int(getattr(absolute, "total", 1)) == 0:
            _note_once(self.state.notes, EMPTY_OUTPUTS())
        if whole:
            metrics["whole_relative_max_error"] = self.whole_error
        if precise:
            metrics["reference_error_vs_fp64"] = self.own_error
        if self.discrete.update_called:
            metrics[DISCRETE_KEY] = self.discrete
        metrics.update(self.classes or {})
        metrics.update({f"{PER_OUTPUT_PREFIX}{i}": m for i, m in sorted(self.per_output.items())})
        self.state.source = source
        self.state.metrics = {k: m.to("cpu") for k, m in metrics.items()}
        return self.state


def measure_parity(
    reference: nn.Module,
    candidate: Callable[..., Any],
    batches: Iterable[Any],
    cfg: Union[ParityConfig, Mapping[str, Any], None] = None,
    *,
    whole_reference: Optional[nn.Module] = None,
    whole_candidate: Optional[Callable[..., Any]] = None,
    input_rule: InputRule = None,
    label_rule: InputRule = None,
    source: str = "given",
    notes: Sequence[Note] = (),
    precise_reference: Optional[nn.Module] = None,
    nested: bool = True,
    stochastic: Sequence[int] = (),
    output_names: Sequence[str] = (),
    sample_axes: Sequence[Optional[int]] = (),
) -> ParityState:
    """Run the comparison of :func:`check_parity` on this process's batches and return the metric states
    (nothing is computed or gated here, and there is no collective call). ``input_rule`` takes forward's
    inputs out of a batch (None: automatic). Both sides draw the same random numbers (the generators' state is
    replayed for the candidate), so a model that draws in eval mode is compared on equal terms. ``stochastic``: the
    target's outputs (by position among its tensors) drawn at random in forward: compared by structure only (no
    runtime draws the same numbers), and a target whose every output is drawn at random fails. ``output_names`` and
    ``sample_axes`` (by position, as the signature has them; default ``output_<i>``, axis 0): what the per-output
    errors are called and along which axis an output's samples lie."""
    cfg = load_parity(cfg)
    if whole_reference is not None and whole_candidate is None:
        raise ValueError("whole_candidate is required with whole_reference")
    device, dtype = model_device_dtype(reference if whole_reference is None else whole_reference)
    run = _Measurement(cfg, device, notes, nested, stochastic, output_names, sample_axes)
    with torch.no_grad(), no_distribution_validation():
        for batch in itertools.islice(iter(batches), cfg.max_batches):
            call = as_call(to_model(extract_input(batch, input_rule), device, dtype))
            drawn = _RandomState.now(device)  # both sides draw the same random numbers, if they draw any
            if whole_reference is not None:
                with record_calls(reference) as calls:
                    whole_ref_out = call.run(whole_reference)
                if not calls:
                    raise ConfigError(
                        "target: the target module is never called by the model's forward, so the fused target "
                        "cannot be compared; point `target` at a module that forward uses."
                    )
                drawn.restore()
                whole_cand_out = call.run(whole_candidate)  # type: ignore[misc]
                drawn = _RandomState.now(device)
            else:
                calls = [(call.args, call.kwargs, detached(call.run(reference)))]
            cand_outs = []
            for a, k, _ in calls:
                drawn.restore()
                cand_outs.append(candidate(*a, **k))
            if not run.compare_target(calls, cand_outs, precise_reference, drawn):
                break
            if whole_reference is not None:
                run.compare_whole(whole_ref_out, whole_cand_out)
            else:
                whole_ref_out, whole_cand_out = calls[0][2], cand_outs[0]
            run.state.batches += 1
            run.compare_classes(whole_ref_out, whole_cand_out, label_candidates(batch, label_rule))
    return run.finish(source, whole_reference is not None, precise_reference is not None)


def _labels_for(candidates: Sequence[torch.Tensor], rows: int, width: int) -> Optional[torch.Tensor]:
    """The first candidate with ``rows`` values in ``[0, width)``, else the first (None: no candidate)."""
    for labels in candidates:
        if labels.numel() == rows and rows and 0 <= int(labels.min()) and int(labels.max()) < width:
            return labels
    return candidates[0] if candidates else None


class _RandomState:
    """The random number generators' state (the CPU's, and the model's GPU's), to replay the same draws."""

    def __init__(self, cpu: torch.Tensor, cuda: Optional[Tuple[int, torch.Tensor]]) -> None:
        self.cpu, self.cuda = cpu, cuda

    @classmethod
    def now(cls, device: Optional[torch.device]) -> "_RandomState":
        index = (device.index or 0) if device is not None and device.type == "cuda" else None
        return cls(torch.get_rng_state(), (index, torch.cuda.get_rng_state(index)) if index is not None else None)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda[1], self.cuda[0])


# ---------------------------------------------------------------------------------------------- merge


def merge_parity_states(states: Sequence[ParityState]) -> ParityState:
    """One state for the data of every rank: counts add up, metric states merge with torchmetrics'
    ``merge_state``, failures and notes are united. Ranks whose class-score widths disagree make a failure
    rather than a wrong accuracy."""
    if not states:
        raise ValueError("merge_parity_states() needs at least one state")
    if len(states) == 1:
        return states[0]
    widths = sorted({s.num_classes for s in states if s.num_classes is not None})
    merged = ParityState(
        batches=sum(s.batches for s in states),
        samples=sum(s.samples for s in states),
        labels_seen=any(s.labels_seen for s in states),
        num_classes=widths[0] if len(widths) == 1 else None,
        labels_low=min((s.labels_low for s in states if s.labels_low is not None), default=None),
        labels_high=max((s.labels_high for s in states if s.labels_high is not None), default=None),
    )
    sources = list(dict.fromkeys(s.source for s in states if s.batches) or [states[0].source])
    merged.source = "+".join(sources)
    for s in states:
        for failure in s.failures:
            _note_once(merged.failures, failure)
        for note in s.notes:
            _note_once(merged.notes, note)
    if len(sources) > 1:
        _note_once(merged.notes, RANKS_DIFFERENT_DATA(sources=", ".join(sources)))
    if len(widths) > 1:
        merged.failures.append(CLASS_WIDTHS_DISAGREE(widths=", ".join(map(str, widths))))
    keys = list(dict.fromkeys(k for s in states for k in s.metrics))
    for key in keys:
        if key in CLASSIFICATION_KEYS and merged.num_classes is None:
            continue  # no common width: accuracy cannot be merged (reported as a failure above)
        merged.metrics[key] = _merged_metric([s.metrics[key] for s in states if key in s.metrics])
    return merged


def _merged_metric(metrics: List[Metric]) -> Metric:
    # merge_state adds states, not update counts: start from a copy of one that was updated, so compute()
    # knows it has data.
    base_index = next((i for i, m in enumerate(metrics) if m.update_called), 0)
    merged = copy.deepcopy(metrics[base_index])
    for i, metric in enumerate(metrics):
        if i != base_index and metric.update_called:
            merged.merge_state(metric)
    return merged


# ---------------------------------------------------------------------------------------------- judge


def judge_parity(state: ParityState, cfg: Union[ParityConfig, Mapping[str, Any], None] = None, *,
                 lossy: bool = False, config_key: str = "parity") -> ParityReport:
    """Compute the metrics of ``state`` (one rank's, or the merge of every rank's) and apply the gate.

    ``lossy``: a model meant to differ (int8) is judged on cosine similarity, top-1 agreement and accuracy
    drop; its relative error is reported, not gated. ``config_key``: where the user sets the thresholds,
    named in the failures (``passes.quantize_int8`` for the int8 gate)."""
    cfg = load_parity(cfg)
    report = ParityReport(passed=False, failures=list(state.failures), batches=state.batches, source=state.source,
                          notes=list(state.notes))
    if state.batches == 0 and not report.failures:
        report.failures.append(NO_BATCHES())
    elif not report.failures:
        _judge_outputs(state, cfg, report, lossy, config_key)
        _judge_classes(state, cfg, report, config_key)
        report.metrics["samples"] = float(state.samples)
    report.passed = not report.failures
    return report


def _judge_outputs(state: ParityState, cfg: ParityConfig, report: ParityReport, lossy: bool, config_key: str) -> None:
    discrete = state.metrics.get(DISCRETE_KEY)
    if discrete is not None and discrete.update_called:
        report.metrics[DISCRETE_KEY] = float(discrete.compute())
        _gate(report, DISCRETE_KEY, ">=", cfg.min_discrete_agreement, f"{config_key}.min_discrete_agreement")
    if not state.metrics[OUTPUT_KEYS[0]].update_called:
        return  # every output is discrete: no value to measure a relative error or a cosine on
    for key in OUTPUT_KEYS:
        report.metrics[key] = float(state.metrics[key].compute())
    report.outputs = per_output_errors(state)
    whole = state.metrics.get("whole_relative_max_error")
    if whole is not None and whole.update_called:
        report.metrics["whole_relative_max_error"] = float(whole.compute())
    rtol = cfg.rtol
    own = state.metrics.get("reference_error_vs_fp64")
    if own is not None and own.update_called:
        own_error = float(own.compute())
        report.metrics["reference_error_vs_fp64"] = own_error
        rtol = max(rtol, LOW_PRECISION_FACTOR * own_error)
        report.notes.append(LOW_PRECISION_GATE(factor=LOW_PRECISION_FACTOR, rtol=rtol))
    report.thresholds["cosine_similarity_min"] = cfg.min_cosine  # listed before the relative error's (gated first)
    if lossy:
        _note_once(report.notes, LOSSY_NOT_GATED())
    else:
        _gate(report, "relative_max_error", "<=", rtol, f"{config_key}.rtol")
    _gate(report, "cosine_similarity_min", ">=", cfg.min_cosine, f"{config_key}.min_cosine")


def per_output_errors(state: ParityState) -> List[OutputError]:
    """Each output's relative error and the distribution of its samples' errors, in the target's order."""
    keys = sorted((k for k in state.metrics if k.startswith(PER_OUTPUT_PREFIX)),
                  key=lambda k: int(k[len(PER_OUTPUT_PREFIX):]))
    out = []
    for key in keys:
        metric = state.metrics[key]
        if not isinstance(metric, SampleErrors) or not metric.update_called:
            continue
        errors = metric.compute()
        if errors.numel() == 0:
            continue  # only empty tensors: no sample to tell about
        quantiles = error_quantiles(errors)
        edges, counts, zeros = log_histogram(errors)
        out.append(OutputError(metric.name, quantiles.get("max", 0.0), int(errors.numel()), quantiles,
                               list(metric.shape), edges, counts, zeros))
    return out


def labels_fill_the_scores(state: ParityState) -> bool:
    """Whether the labels seen fill at least half of the class scores' width: a 10-class classifier's labels
    do, a 128-wide embedding's dataset targets (10 classes) do not. True when no labels were seen."""
    if state.num_classes is None or state.labels_high is None:
        return True
    return 2 * (state.labels_high + 1) >= state.num_classes


def _judge_classes(state: ParityState, cfg: ParityConfig, report: ParityReport, config_key: str) -> None:
    if state.num_classes is not None and not labels_fill_the_scores(state):
        _note_once(report.notes, NOT_SCORES_FOR_LABELS(width=state.num_classes, low=state.labels_low,
                                                       high=state.labels_high))
        return
    if state.num_classes is None or "top1_agreement" not in state.metrics:
        if not any(n.kind == NOT_SCORES_FOR_LABELS for n in report.notes):  # that one says why already
            _note_once(report.notes, NOT_CLASS_SCORES())
        return
    for key in ("top1_agreement", "top1_agreement_strict"):
        report.metrics[key] = float(state.metrics[key].compute())
    _gate(report, "top1_agreement", ">=", cfg.min_top1_agreement, f"{config_key}.min_top1_agreement")
    if not state.labels_seen:
        _note_once(report.notes, NO_LABELS())
        return
    acc_ref = float(state.metrics["accuracy_reference"].compute())
    acc_fused = float(state.metrics["accuracy_fused"].compute())
    report.metrics.update(accuracy_reference=acc_ref, accuracy_fused=acc_fused, accuracy_drop=acc_ref - acc_fused)
    _gate(report, "accuracy_drop", "<=", cfg.max_accuracy_drop, f"{config_key}.max_accuracy_drop")


def _gate(report: ParityReport, name: str, op: str, threshold: float, key: str) -> None:
    """Metric ``name`` of the report against ``threshold`` (recorded with it), a failure naming ``key`` if it misses."""
    report.thresholds[name] = threshold
    value = report.metrics[name]
    # Written so that NaN fails: NaN compares False both ways.
    ok = value <= threshold if op == "<=" else value >= threshold
    if not ok:
        report.failures.append(GATE_MISSED(metric=name, value=value, relation=">" if op == "<=" else "<", key=key,
                                           threshold=threshold))


def _note_once(notes: List[Note], note: Note) -> None:
    if note not in notes:
        notes.append(note)
