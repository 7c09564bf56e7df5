"""Parity: does the fused model give the same answers as the original? Measured with torchmetrics.

Usable on its own::

    from fx_lightning.parity import check_parity
    report = check_parity(model, fused, val_loader, {"max_batches": 4})
    assert report.passed, report.failures

Two levels are measured. On the *target* (the module that was fused): relative max error
``max|fused - ref| / max|ref|`` (relative, because a correct fusion of a large network shows large
absolute but tiny relative error), mean absolute error and per-sample cosine similarity. On the *whole
model* (when ``whole_reference``/``whole_candidate`` are given, or the target itself when not): top-1
agreement and, when the batch carries integer labels, the accuracy of each and the drop. Everything is
compared in float64.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.regression import MeanAbsoluteError

from fx_lightning.config import ParityConfig, import_object, load_config
from fx_lightning.errors import ConfigError, ParityError

__all__ = [
    "ParityReport",
    "RelativeMaxError",
    "SampleCosineSimilarity",
    "check_parity",
    "ParityState",
    "measure_parity",
    "merge_parity_states",
    "judge_parity",
    "extract_input",
    "extract_labels",
    "as_args",
    "INPUT_KEYS",
    "LABEL_KEYS",
]

# Keys tried, in order, when a batch is a mapping and no input rule is configured.
INPUT_KEYS: Tuple[str, ...] = ("x", "input", "inputs", "image", "images", "pixel_values", "features", "data")
LABEL_KEYS: Tuple[str, ...] = ("y", "label", "labels", "target", "targets")

InputRule = Union[None, str, int, Callable[[Any], Any]]

# Low-precision targets are compared against their own rounding error (see check_parity's
# ``precise_reference``): a correct fusion may differ from the unfused model by a few times that error.
LOW_PRECISION_FACTOR = 4.0


# ------------------------------------------------------------------------------------------- report


@dataclass
class ParityReport:
    passed: bool
    metrics: Dict[str, float] = field(default_factory=dict)
    # Each names the metric, the value and the threshold, e.g. "relative_max_error = 0.3 > rtol = 0.0001".
    failures: List[str] = field(default_factory=list)
    batches: int = 0
    source: str = "val"  # val | train | example | given
    notes: List[str] = field(default_factory=list)
    thresholds: Dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-safe view (non-finite floats become strings, since JSON has no NaN)."""
        def safe(v: float) -> Union[float, str]:
            return float(v) if math.isfinite(v) else str(v)

        out = dataclasses.asdict(self)
        out["metrics"] = {k: safe(v) for k, v in self.metrics.items()}
        out["thresholds"] = {k: safe(v) for k, v in self.thresholds.items()}
        return out

    def __str__(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        lines = [f"parity {verdict} on {self.batches} batch(es) of {self.source} data"]
        for key, value in self.metrics.items():
            lines.append(f"  {key:<28} {value:.6g}")
        for failure in self.failures:
            lines.append(f"  FAIL: {failure}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------- metrics


class RelativeMaxError(Metric):
    """``max|preds - target| / max|target|`` over everything seen: error against the reference's scale."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = False

    max_abs_diff: torch.Tensor
    max_abs_ref: torch.Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("max_abs_diff", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="max")
        self.add_state("max_abs_ref", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="max")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        if target.numel() == 0:
            return
        diff = (preds.double() - target.double()).abs().max()
        # torch.maximum propagates NaN, so a NaN output can never pass the gate.
        self.max_abs_diff = torch.maximum(self.max_abs_diff, diff)
        self.max_abs_ref = torch.maximum(self.max_abs_ref, target.double().abs().max())

    def compute(self) -> torch.Tensor:
        if self.max_abs_ref == 0:
            # An all-zero reference: any difference at all is an infinite relative error.
            return torch.where(self.max_abs_diff == 0, self.max_abs_diff, torch.full_like(self.max_abs_diff, math.inf))
        return self.max_abs_diff / self.max_abs_ref


class SampleCosineSimilarity(Metric):
    """Cosine similarity of each sample's flattened output, reduced by ``mean`` or ``min``.

    torchmetrics' own CosineSimilarity concatenates every batch (so widths must agree) and treats a
    pair of zero vectors as 0; here two zero rows count as identical (1.0).
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = True

    total: torch.Tensor
    count: torch.Tensor
    minimum: torch.Tensor

    def __init__(self, reduction: str = "mean", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if reduction not in ("mean", "min"):
            raise ValueError(f"reduction must be 'mean' or 'min', got {reduction!r}")
        self.reduction = reduction
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("minimum", torch.tensor(1.0, dtype=torch.float64), dist_reduce_fx="min")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        a = preds.double().reshape(preds.shape[0], -1) if preds.dim() >= 2 else preds.double().reshape(1, -1)
        b = target.double().reshape(a.shape)
        na, nb = a.norm(dim=1), b.norm(dim=1)
        cos = (a * b).sum(dim=1) / (na * nb)
        both_zero = (na == 0) & (nb == 0)
        cos = torch.where(both_zero, torch.ones_like(cos), cos)
        cos = torch.where(((na == 0) ^ (nb == 0)), torch.zeros_like(cos), cos)
        self.total = self.total + cos.sum()
        self.count = self.count + cos.numel()
        # min() propagates NaN.
        self.minimum = torch.minimum(self.minimum, cos.min())

    def compute(self) -> torch.Tensor:
        if self.reduction == "min":
            return self.minimum
        return self.total / self.count.clamp_min(1)


# compute() would be a collective under torch.distributed, called in an order that depends on each rank's data
# (and not at all by a rank that failed): ranks merge their states explicitly instead (merge_parity_states), so
# compute() must stay local. These go to the constructor: torchmetrics reads sync_on_compute in __init__ only
# (setting the attribute afterwards leaves compute() syncing, which hangs a rank that computes alone).
_LOCAL_ONLY: Dict[str, Any] = {"sync_on_compute": False, "dist_sync_on_step": False}


def _output_metrics() -> MetricCollection:
    collection = MetricCollection(
        {
            "relative_max_error": RelativeMaxError(**_LOCAL_ONLY),
            "mean_absolute_error": MeanAbsoluteError(**_LOCAL_ONLY),
            "cosine_similarity": SampleCosineSimilarity("mean", **_LOCAL_ONLY),
            "cosine_similarity_min": SampleCosineSimilarity("min", **_LOCAL_ONLY),
        },
        compute_groups=False,
    )
    # MeanAbsoluteError keeps float32 sums and does not upcast its inputs.
    collection.set_dtype(torch.float64)
    return collection


# -------------------------------------------------------------------------------------- batch inputs


def extract_input(batch: Any, rule: InputRule = None) -> Any:
    """Take the model input out of a batch.

    ``rule``: ``None`` (automatic: a tensor as is; the first item of a tuple/list; the first of
    ``INPUT_KEYS`` in a mapping), a mapping key, an integer index (or its string form), an import path
    ``"pkg.module:function"`` or a callable taking the batch. A returned *tuple* is read as several
    positional arguments of forward (see :func:`as_args`).
    """
    if callable(rule):
        return rule(batch)
    if isinstance(rule, str) and ":" in rule:
        try:
            fn = import_object(rule)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(f"parity.input: cannot import {rule!r}: {exc}.") from None
        return fn(batch)
    if isinstance(rule, int) or (isinstance(rule, str) and rule.lstrip("-").isdigit()):
        index = int(rule)
        if not isinstance(batch, (tuple, list)):
            raise ConfigError(
                f"parity.input: {rule!r} is an index, but the batch is a {type(batch).__name__}, not a tuple/list."
            )
        if not -len(batch) <= index < len(batch):
            raise ConfigError(f"parity.input: index {index} is out of range for a batch of {len(batch)} items.")
        return batch[index]
    if isinstance(rule, str):
        if isinstance(batch, Mapping):
            if rule not in batch:
                raise ConfigError(
                    f"parity.input: key {rule!r} is not in the batch; its keys: {', '.join(map(str, batch))}."
                )
            return batch[rule]
        if hasattr(batch, rule):
            return getattr(batch, rule)
        raise ConfigError(
            f"parity.input: {rule!r} names a key, but the batch is a {type(batch).__name__} without it."
        )
    if rule is not None:
        raise ConfigError(f"parity.input: expected a key, an index, an import path or a callable, got {rule!r}.")
    # automatic
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
            f"{', '.join(map(str, batch))}; tried {', '.join(INPUT_KEYS)}). Set parity.input to the key, "
            "or to 'pkg.module:function' taking the batch."
        )
    raise ConfigError(
        f"parity.input: cannot take a model input out of a batch of type {type(batch).__name__}; set "
        "parity.input to a key, an index or 'pkg.module:function'."
    )


def extract_labels(batch: Any, rule: InputRule = None) -> Optional[torch.Tensor]:
    """Integer class labels in the batch, if any: the second item of a tuple/list, or a ``LABEL_KEYS`` entry."""
    labels: Any = None
    if callable(rule):
        labels = rule(batch)
    elif isinstance(rule, (str, int)):
        try:
            labels = batch[rule]
        except (KeyError, IndexError, TypeError):
            labels = None
    elif isinstance(batch, (tuple, list)) and len(batch) >= 2:
        labels = batch[1]
    elif isinstance(batch, Mapping):
        labels = next((batch[k] for k in LABEL_KEYS if k in batch), None)
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point() and not labels.is_complex():
        return labels
    return None


def as_args(inputs: Any) -> Tuple[Any, ...]:
    """Forward's positional arguments: a tuple is several arguments, anything else is one."""
    return inputs if isinstance(inputs, tuple) else (inputs,)


def _to_model(args: Any, device: Optional[torch.device], dtype: Optional[torch.dtype]) -> Any:
    """Move tensors to the model's device and floating tensors to its floating dtype."""
    if isinstance(args, torch.Tensor):
        t = args.to(device) if device is not None else args
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        return t
    if isinstance(args, tuple) and hasattr(args, "_fields"):
        return type(args)(*(_to_model(a, device, dtype) for a in args))
    if isinstance(args, (tuple, list)):
        return type(args)(_to_model(a, device, dtype) for a in args)
    if isinstance(args, Mapping):
        return {k: _to_model(v, device, dtype) for k, v in args.items()}
    return args


def _device_dtype(module: nn.Module) -> Tuple[Optional[torch.device], Optional[torch.dtype]]:
    for t in itertools.chain(module.parameters(), module.buffers()):
        if t.is_floating_point():
            return t.device, t.dtype
    for t in itertools.chain(module.parameters(), module.buffers()):
        return t.device, None
    return None, None


def _tensors(out: Any) -> List[torch.Tensor]:
    """Every tensor of a (nested) output, in a stable order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        return [t for k in out for t in _tensors(out[k])]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [t for f in dataclasses.fields(out) for t in _tensors(getattr(out, f.name))]
    return []


def _detached(value: Any) -> Any:
    # Recorded values are cloned: a later in-place op (ReLU(inplace=True) in the head) would change them.
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_detached(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _detached(v) for k, v in value.items()}
    return value


@contextlib.contextmanager
def record_calls(module: nn.Module) -> Iterator[List[Tuple[tuple, dict, Any]]]:
    """Record ``(args, kwargs, output)`` of every call of ``module`` while the block runs."""
    calls: List[Tuple[tuple, dict, Any]] = []

    def hook(_mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        calls.append((_detached(args), _detached(kwargs), _detached(output)))

    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


# ------------------------------------------------------------------------------------------- the gate


def _parity_config(cfg: Union[ParityConfig, Mapping[str, Any], None]) -> ParityConfig:
    if isinstance(cfg, ParityConfig):
        return cfg
    return load_config(parity=dict(cfg) if cfg is not None else None).parity


_UNSET: Any = object()


@dataclass
class ParityState:
    """What parity measured on one process's batches, before the gate; states of several ranks merge.

    :func:`measure_parity` fills it, :func:`merge_parity_states` combines the states of several ranks (the
    torchmetrics states are sums, maxima and minima, so the merge equals one pass over all the data) and
    :func:`judge_parity` computes the metrics and applies the gate. Its tensors are on the CPU, so a state can
    travel through ``torch.distributed.all_gather_object``.
    """

    batches: int = 0
    samples: int = 0
    labels_seen: bool = False
    num_classes: Optional[int] = None  # width of the class scores; None when the outputs are not class scores
    source: str = "given"
    failures: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    # metric name -> (number of update() calls, the metric's state tensors)
    states: Dict[str, Tuple[int, Dict[str, torch.Tensor]]] = field(default_factory=dict)


def check_parity(
    reference: nn.Module,
    candidate: Callable[..., Any],
    batches: Iterable[Any],
    cfg: Union[ParityConfig, Mapping[str, Any], None] = None,
    *,
    whole_reference: Optional[nn.Module] = None,
    whole_candidate: Optional[Callable[..., Any]] = None,
    input_rule: InputRule = _UNSET,
    label_rule: InputRule = None,
    source: str = "given",
    notes: Sequence[str] = (),
    precise_reference: Optional[nn.Module] = None,
) -> ParityReport:
    """Compare ``candidate`` with ``reference`` (both in eval mode) on up to ``cfg.max_batches`` batches.

    Without ``whole_*``, both are called on the inputs taken out of each batch (``input_rule``, default
    ``cfg.input``). With ``whole_reference``/``whole_candidate`` (the complete models, the fused target in
    place in the candidate), the batch inputs go through the whole models; ``reference`` must be a
    submodule of ``whole_reference``: its inputs and outputs are recorded there and ``candidate`` is
    called on the same inputs. ``precise_reference`` (an fp64 copy of ``reference``) makes the error gate
    relative to the reference's own rounding error, for float16/bfloat16 models.

    Nothing here changes a model's weights or training flags (the caller passes eval-mode models).
    This is :func:`measure_parity` followed by :func:`judge_parity`; under torch.distributed, measure on
    every rank, :func:`merge_parity_states` the states and judge once.
    """
    pcfg = _parity_config(cfg)
    state = measure_parity(
        reference, candidate, batches, pcfg, whole_reference=whole_reference, whole_candidate=whole_candidate,
        input_rule=input_rule, label_rule=label_rule, source=source, notes=notes,
        precise_reference=precise_reference,
    )
    return judge_parity(state, pcfg)


def measure_parity(
    reference: nn.Module,
    candidate: Callable[..., Any],
    batches: Iterable[Any],
    cfg: Union[ParityConfig, Mapping[str, Any], None] = None,
    *,
    whole_reference: Optional[nn.Module] = None,
    whole_candidate: Optional[Callable[..., Any]] = None,
    input_rule: InputRule = _UNSET,
    label_rule: InputRule = None,
    source: str = "given",
    notes: Sequence[str] = (),
    precise_reference: Optional[nn.Module] = None,
) -> ParityState:
    """Run the comparison of :func:`check_parity` on this process's batches and return the metric states
    (nothing is computed or gated here, and there is no collective call)."""
    pcfg = _parity_config(cfg)
    rule = pcfg.input if input_rule is _UNSET else input_rule
    report_notes = list(notes)
    device, dtype = _device_dtype(reference if whole_reference is None else whole_reference)
    target_metrics = _output_metrics()
    whole_error = RelativeMaxError(**_LOCAL_ONLY)
    own_error = RelativeMaxError(**_LOCAL_ONLY) if precise_reference is not None else None
    classification: Optional[Dict[str, Metric]] = None
    failures: List[str] = []
    n_batches = 0
    samples = 0
    labels_seen = False
    num_classes: Optional[int] = None

    with torch.no_grad():
        for batch in itertools.islice(iter(batches), pcfg.max_batches):
            args = as_args(_to_model(extract_input(batch, rule), device, dtype))
            if whole_reference is not None:
                assert whole_candidate is not None, "whole_candidate is required with whole_reference"
                with record_calls(reference) as calls:
                    whole_ref_out = whole_reference(*args)
                if not calls:
                    raise ParityError(
                        "parity: the fused target was never called by the whole model's forward, so it "
                        "cannot be compared; check `target`."
                    )
                whole_cand_out = whole_candidate(*args)
            else:
                ref_out = reference(*args)
                calls = [(args, {}, _detached(ref_out))]
                whole_ref_out = whole_cand_out = None
            cand_outs = []
            for t_args, t_kwargs, t_ref in calls:
                t_cand = candidate(*t_args, **t_kwargs)
                cand_outs.append(t_cand)
                refs, cands = _tensors(t_ref), _tensors(t_cand)
                if len(refs) != len(cands):
                    failures.append(
                        f"output structure: reference returns {len(refs)} tensor(s), fused returns {len(cands)}"
                    )
                    break
                for r, c in zip(refs, cands):
                    if r.shape != c.shape:
                        failures.append(f"output shape: reference {tuple(r.shape)}, fused {tuple(c.shape)}")
                        continue
                    # .contiguous(): torchmetrics' MAE uses .view(-1), which fails on channels_last.
                    r64, c64 = r.detach().double().contiguous(), c.detach().double().contiguous()
                    target_metrics.update(c64, r64)
                if precise_reference is not None and own_error is not None:
                    precise_out = precise_reference(*_to_model(t_args, None, torch.float64),
                                                    **_to_model(t_kwargs, None, torch.float64))
                    for r, p in zip(refs, _tensors(precise_out)):
                        own_error.update(r.double(), p.double())
            if failures:
                break
            logits_ref = whole_ref_out if whole_reference is not None else calls[0][2]
            logits_cand = whole_cand_out if whole_reference is not None else cand_outs[0]
            ref_tensors, cand_tensors = _tensors(logits_ref), _tensors(logits_cand)
            if whole_reference is not None:
                for r, c in zip(ref_tensors, cand_tensors):
                    if r.shape == c.shape:
                        whole_error.update(c.double(), r.double())
            n_batches += 1
            if not ref_tensors or not cand_tensors or ref_tensors[0].shape != cand_tensors[0].shape:
                continue
            lr, lc = ref_tensors[0].double(), cand_tensors[0].double()
            samples += lr.shape[0] if lr.dim() else 1
            if lr.dim() < 2 or lr.shape[-1] < 2:
                continue  # not class scores: no top-1
            lr, lc = lr.reshape(-1, lr.shape[-1]), lc.reshape(-1, lc.shape[-1])
            num_classes = lr.shape[-1]
            if classification is None:
                classification = _classification_metrics(num_classes)
            ref_top1 = lr.argmax(dim=-1)
            cand_top1 = lc.argmax(dim=-1)
            # A near tie in the reference (top two within rtol of its scale) may flip under any rounding:
            # count the candidate's pick as agreeing when the reference scores it within that tolerance.
            tol = pcfg.rtol * lr.abs().amax(dim=-1)
            picked = lr.gather(-1, cand_top1[:, None])[:, 0]
            tolerant = torch.where(picked >= lr.amax(dim=-1) - tol, ref_top1, cand_top1)
            classification["top1_agreement"].update(tolerant, ref_top1)
            classification["top1_agreement_strict"].update(cand_top1, ref_top1)
            labels = extract_labels(batch, label_rule)
            if labels is not None:
                labels = labels.reshape(-1).to(lr.device)
                if labels.numel() != lr.shape[0]:
                    _note_once(report_notes, f"labels ({labels.numel()}) do not match the outputs ({lr.shape[0]} rows): accuracy not measured")
                elif labels.min() < 0 or labels.max() >= num_classes:
                    _note_once(report_notes, f"labels outside [0, {num_classes}): accuracy not measured")
                else:
                    labels_seen = True
                    classification["accuracy_reference"].update(ref_top1, labels)
                    classification["accuracy_fused"].update(cand_top1, labels)

    metrics: Dict[str, Metric] = dict(target_metrics.items())
    if whole_reference is not None:
        metrics["whole_relative_max_error"] = whole_error
    if own_error is not None:
        metrics["reference_error_vs_fp64"] = own_error
    if classification is not None:
        metrics.update(classification)
    return ParityState(
        batches=n_batches,
        samples=samples,
        labels_seen=labels_seen,
        num_classes=num_classes if classification is not None else None,
        source=source,
        failures=failures,
        notes=report_notes,
        states={key: _export_state(metric) for key, metric in metrics.items()},
    )


def merge_parity_states(states: Sequence[ParityState]) -> ParityState:
    """One state for the data of every rank: counts add up, metric states reduce as torchmetrics' own
    distributed sync would (sum, max, min), failures and notes are united. Ranks whose class-score widths
    disagree make a failure rather than a wrong accuracy."""
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
    )
    sources = list(dict.fromkeys(s.source for s in states if s.batches) or [states[0].source])
    merged.source = "+".join(sources)
    for s in states:
        for failure in s.failures:
            _note_once(merged.failures, failure)
        for note in s.notes:
            _note_once(merged.notes, note)
    if len(sources) > 1:
        _note_once(merged.notes, f"ranks compared different data ({', '.join(sources)})")
    if len(widths) > 1:
        merged.failures.append(f"ranks disagree on the number of classes in the outputs ({widths})")
    metrics: Dict[str, Metric] = {}
    for s in states:
        for key, (count, tensors) in s.states.items():
            if key in _CLASSIFICATION_KEYS and merged.num_classes is None:
                continue  # no common width: accuracy cannot be merged (reported as a failure above)
            if key not in metrics:
                metrics[key] = _fresh_metric(key, merged.num_classes)
            _merge_state(metrics[key], count, tensors)
    merged.states = {key: _export_state(metric) for key, metric in metrics.items()}
    return merged


def judge_parity(state: ParityState, cfg: Union[ParityConfig, Mapping[str, Any], None] = None) -> ParityReport:
    """Compute the metrics of ``state`` (one rank's, or the merge of every rank's) and apply the gate."""
    pcfg = _parity_config(cfg)
    failures = list(state.failures)
    report_notes = list(state.notes)
    live = {key: _rebuilt_metric(key, state.num_classes, count, tensors)
            for key, (count, tensors) in state.states.items()
            if key not in _CLASSIFICATION_KEYS or state.num_classes is not None}
    metrics: Dict[str, float] = {}
    thresholds: Dict[str, float] = {}
    if state.batches == 0 and not failures:
        failures.append(
            "no batches: nothing was compared (give validation data, example_input_array, or set "
            "parity.enabled: false)"
        )
    elif not failures:
        for key in _OUTPUT_KEYS:
            metrics[key] = float(live[key].compute())
        whole_error = live.get("whole_relative_max_error")
        if whole_error is not None and whole_error.update_called:
            metrics["whole_relative_max_error"] = float(whole_error.compute())
        rtol = pcfg.rtol
        own_error = live.get("reference_error_vs_fp64")
        if own_error is not None and own_error.update_called:
            own = float(own_error.compute())
            metrics["reference_error_vs_fp64"] = own
            rtol = max(rtol, LOW_PRECISION_FACTOR * own)
            report_notes.append(
                f"low-precision model: error gate is max(rtol, {LOW_PRECISION_FACTOR:g} x the unfused model's own "
                f"error against fp64) = {rtol:.3g}"
            )
        thresholds["relative_max_error"] = rtol
        thresholds["cosine_similarity_min"] = pcfg.min_cosine
        _gate(failures, "relative_max_error", metrics["relative_max_error"], "<=", rtol, "rtol")
        _gate(failures, "cosine_similarity_min", metrics["cosine_similarity_min"], ">=", pcfg.min_cosine, "min_cosine")
        if "top1_agreement" in live:
            for key in ("top1_agreement", "top1_agreement_strict"):
                metrics[key] = float(live[key].compute())
            thresholds["top1_agreement"] = pcfg.min_top1_agreement
            _gate(failures, "top1_agreement", metrics["top1_agreement"], ">=", pcfg.min_top1_agreement,
                  "min_top1_agreement")
            if state.labels_seen:
                acc_ref = float(live["accuracy_reference"].compute())
                acc_fused = float(live["accuracy_fused"].compute())
                metrics.update(accuracy_reference=acc_ref, accuracy_fused=acc_fused, accuracy_drop=acc_ref - acc_fused)
                thresholds["accuracy_drop"] = pcfg.max_accuracy_drop
                _gate(failures, "accuracy_drop", acc_ref - acc_fused, "<=", pcfg.max_accuracy_drop, "max_accuracy_drop")
            else:
                _note_once(report_notes, "no integer labels in the batches: accuracy not measured")
        else:
            _note_once(report_notes, "outputs are not class scores: top-1 agreement not measured")
        metrics["samples"] = float(state.samples)
    return ParityReport(
        passed=not failures,
        metrics=metrics,
        failures=failures,
        batches=state.batches,
        source=state.source,
        notes=report_notes,
        thresholds=thresholds,
    )


_OUTPUT_KEYS: Tuple[str, ...] = ("relative_max_error", "mean_absolute_error", "cosine_similarity", "cosine_similarity_min")
_CLASSIFICATION_KEYS: Tuple[str, ...] = ("top1_agreement", "top1_agreement_strict", "accuracy_reference", "accuracy_fused")


def _fresh_metric(key: str, num_classes: Optional[int]) -> Metric:
    if key in _OUTPUT_KEYS:
        return _output_metrics()[key]
    if key in ("whole_relative_max_error", "reference_error_vs_fp64"):
        return RelativeMaxError(**_LOCAL_ONLY)
    if key in _CLASSIFICATION_KEYS and num_classes is not None:
        return _classification_metrics(num_classes)[key]
    raise ValueError(f"parity state: unknown metric {key!r}")


def _export_state(metric: Metric) -> Tuple[int, Dict[str, torch.Tensor]]:
    return metric.update_count, {name: t.detach().cpu().clone() for name, t in metric.metric_state.items()}


def _merge_state(metric: Metric, count: int, tensors: Dict[str, torch.Tensor]) -> None:
    metric.merge_state(tensors)
    # merge_state leaves the update count alone; without it compute() would warn that update never ran.
    metric._update_count += count


def _rebuilt_metric(key: str, num_classes: Optional[int], count: int, tensors: Dict[str, torch.Tensor]) -> Metric:
    metric = _fresh_metric(key, num_classes)
    _merge_state(metric, count, tensors)
    return metric


def _classification_metrics(num_classes: int) -> Dict[str, Metric]:
    # average="micro": the fraction of samples; torchmetrics' default "macro" averages per class.
    def acc() -> Metric:
        return MulticlassAccuracy(num_classes=num_classes, average="micro", validate_args=False, **_LOCAL_ONLY)

    return {
        "top1_agreement": acc(),
        "top1_agreement_strict": acc(),
        "accuracy_reference": acc(),
        "accuracy_fused": acc(),
    }


def _gate(failures: List[str], name: str, value: float, op: str, threshold: float, key: str) -> None:
    # Written so that NaN fails: NaN compares False both ways.
    ok = value <= threshold if op == "<=" else value >= threshold
    if not ok:
        bad = ">" if op == "<=" else "<"
        failures.append(f"{name} = {value:.6g} {bad} parity.{key} = {threshold:.6g}")


def _note_once(notes: List[str], note: str) -> None:
    if note not in notes:
        notes.append(note)
