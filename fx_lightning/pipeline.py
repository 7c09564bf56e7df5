"""The fusion pipeline shared by ``FXFuseCallback`` and the command line: fuse -> parity -> export.

Independent of Lightning's Trainer: it takes a model, a :class:`~fx_lightning.config.FuseConfig` (already
loaded: the callers normalise config where it enters) and batches. The model passed in is never changed;
every step works on copies. The steps are :func:`fuse_and_measure` (per process), :func:`judge`,
:func:`parity_verdict` and :func:`export_outcome`; a multi-process caller runs them with its collectives in
between, :func:`fuse_verify_export` runs them in one go.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from fx_lightning.batches import (
    InputRule,
    as_args,
    as_example_inputs,
    detached,
    extract_input,
    identity_rule,
    model_device_dtype,
    record_calls,
    to_model,
)
from fx_lightning.capture import eval_copy, set_eval
from fx_lightning.config import FuseConfig, OnError, Selection
from fx_lightning.engine import FuseResult, fuse
from fx_lightning.errors import ConfigError, ExportError, ParityError
from fx_lightning.parity import ParityReport, ParityState, judge_parity, measure_parity
from fx_lightning.passes import PassContext, Stage, plan_passes, run_pass

__all__ = [
    "Batches",
    "Measured",
    "Outcome",
    "resolve_target",
    "whole_model_with",
    "target_example_inputs",
    "own_rng",
    "resolve_device",
    "fuse_and_measure",
    "judge",
    "parity_verdict",
    "export_outcome",
    "fuse_verify_export",
    "summary_text",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass
class Batches:
    """Data batches for parity and where they came from."""

    items: List[Any]
    source: str = "given"  # val | train | example | given
    note: Optional[str] = None  # why this source (e.g. "no validation data: parity used training batches")


@dataclass
class Measured:
    """One process's share of the pipeline before any verdict: the fused model and its parity measurements.

    Under torch.distributed every rank builds one on its own data; the ranks' ``parity_state`` merge into
    the one :func:`judge` takes (see ``FXFuseCallback``).
    """

    config: FuseConfig
    result: FuseResult
    target: str  # dotted path of the fused submodule; "" when the whole model was fused
    fused_model: nn.Module  # the whole model (eval mode) with the fused target in place
    parity_state: Optional[ParityState]  # None when parity is disabled
    target_inputs: Optional[tuple]  # the target's example inputs (the exporter traces with them)
    notes: List[str] = field(default_factory=list)
    reference: Optional[nn.Module] = None  # the unfused target (eval copy): the eager baseline when timing
    data: List[Any] = field(default_factory=list)  # the parity batches, and the rule taking inputs out of them
    input_rule: InputRule = None
    calibration: List[tuple] = field(default_factory=list)  # the target's inputs on calibration batches


@dataclass
class Outcome:
    """The judged result: the fusion, the parity verdict and where the export went (None: not exported)."""

    result: FuseResult
    parity: Optional[ParityReport]
    export_dir: Optional[Path]
    target: str
    fused_model: nn.Module
    notes: List[str] = field(default_factory=list)


def resolve_target(module: nn.Module, target: Optional[str]) -> Tuple[str, nn.Module]:
    """``(dotted path, submodule)`` to fuse. ``None``: ``backbone`` when the module has one, else the module.

    Raises :class:`ConfigError` naming the target and listing the module's children when it is missing.
    """
    if target is None:
        backbone = getattr(module, "backbone", None) if "backbone" in dir(module) else None
        if isinstance(backbone, nn.Module):
            return "backbone", backbone
        return "", module
    if target == "":
        return "", module
    current: Any = module
    walked: List[str] = []
    for part in target.split("."):
        parent = current
        current = getattr(parent, part, None) if isinstance(parent, nn.Module) else None
        if not isinstance(current, nn.Module):
            where = ".".join(walked) or "<root>"
            children = ", ".join(f"{n} ({type(c).__name__})" for n, c in parent.named_children()) or "none"
            what = "is not a submodule" if current is None else f"is a {type(current).__name__}, not a torch.nn.Module"
            raise ConfigError(
                f"target: {target!r}: {part!r} {what} of {where} ({type(parent).__name__}). "
                f"Children of {where}: {children}."
            )
        walked.append(part)
    return target, current


def whole_model_with(model: nn.Module, path: str, replacement: nn.Module) -> nn.Module:
    """A copy of ``model`` whose submodule at ``path`` is ``replacement``; ``model`` is not changed.

    Parameters and buffers are shared with ``model`` rather than copied (neither side is ever trained),
    so this costs module objects, not weights.
    """
    if not path:
        return replacement
    original = model.get_submodule(path)
    memo: Dict[int, Any] = {id(original): replacement}
    for t in itertools.chain(model.parameters(), model.buffers()):
        memo[id(t)] = t
    whole = copy.deepcopy(model, memo)
    set_eval(whole)  # not .eval(): a torch.export-captured replacement refuses it
    return whole


def target_example_inputs(whole: nn.Module, target: nn.Module, inputs: Tuple[Any, ...]) -> Tuple[tuple, dict]:
    """The ``(args, kwargs)`` ``target`` receives when ``whole`` runs on ``inputs`` (first call)."""
    if whole is target:
        return inputs, {}
    with torch.no_grad(), record_calls(target) as calls:
        whole(*inputs)
    if not calls:
        raise ConfigError(
            "target: the target module is never called by the model's forward, so it cannot be fused "
            "in place; point `target` at a module that forward uses."
        )
    return calls[0][0], calls[0][1]


def resolve_device(setting: str, auto: Optional[torch.device]) -> Optional[torch.device]:
    """``device`` from the config as a torch.device (``auto``: ``auto``, e.g. where training ran; None: where
    the model is). Raises :class:`ConfigError` when that device is not available in this process."""
    if setting == "auto":
        return auto
    device = torch.device(setting)
    available = True
    if device.type == "cuda":
        available = torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    elif device.type == "mps":
        available = torch.backends.mps.is_available()
    if not available:
        raise ConfigError(
            f"device: {setting!r} is not available in this process (cuda available: {torch.cuda.is_available()}, "
            f"{torch.cuda.device_count()} device(s)); use auto (where training ran) or cpu."
        )
    return device


@contextlib.contextmanager
def own_rng(module: nn.Module, device: Optional[torch.device] = None) -> Iterator[None]:
    """Run a block without touching the caller's RNG streams (CPU, and the CUDA devices in use): parity
    runs forward passes, and shuffled loaders may draw."""
    cuda = {t.device.index or 0 for t in module.parameters() if t.is_cuda}
    if device is not None and device.type == "cuda":
        cuda.add(device.index or 0)
    with torch.random.fork_rng(devices=sorted(cuda)):
        yield


def fuse_and_measure(
    model: nn.Module,
    config: FuseConfig,
    batches: Batches,
    *,
    example_inputs: Any = None,
    notes: Sequence[str] = (),
    buffers: Optional[Mapping[str, torch.Tensor]] = None,
    device: Optional[torch.device] = None,
    calibration: Optional[Batches] = None,
) -> Measured:
    """Fuse ``config.target`` of a copy of ``model`` and measure parity on ``batches`` (no verdict, no collective).

    When there are no batches, ``example_inputs`` (forward's arguments of the whole model) are used instead.
    ``buffers`` (name -> tensor, as ``model.named_buffers()``) are loaded into the working copy before fusing:
    under DDP the callback passes rank zero's, since BatchNorm statistics can differ between ranks. ``device``:
    where the copy is moved to be fused, checked and exported (default: where ``model`` is). ``calibration``:
    batches for the variant passes (int8), default the parity batches.
    """
    path, _ = resolve_target(model, config.target)
    out_notes = list(notes) + ([batches.note] if batches.note else [])
    with own_rng(model, device), torch.no_grad():
        reference_whole = eval_copy(model, device)
        if buffers:
            _load_buffers(reference_whole, buffers)
        reference = reference_whole.get_submodule(path) if path else reference_whole
        data, rule, source = _parity_data(config, batches, example_inputs, out_notes)
        target_inputs = _first_target_inputs(reference_whole, reference, data, rule, out_notes)
        result = fuse(reference, config, example_inputs=target_inputs)
        fused = result.graph_module
        whole_candidate = whole_model_with(reference_whole, path, fused)
        state: Optional[ParityState] = None
        if config.parity.enabled:
            _, dtype = model_device_dtype(reference_whole)
            precise = copy.deepcopy(reference).double() if dtype in _LOW_PRECISION else None
            state = measure_parity(
                reference, fused, data, config.parity,
                whole_reference=reference_whole if path else None,
                whole_candidate=whole_candidate if path else None,
                input_rule=rule, source=source, precise_reference=precise,
            )
        else:
            out_notes.append("parity check disabled (parity.enabled: false): the fused model was not verified")
        calibration_inputs = _calibration_inputs(config, reference_whole, reference, calibration, data, rule)
    return Measured(config, result, path, whole_candidate, state, target_inputs, out_notes, reference, data, rule,
                    calibration_inputs)


def _calibration_inputs(config: FuseConfig, whole: nn.Module, target: nn.Module, calibration: Optional[Batches],
                        data: List[Any], rule: InputRule) -> List[tuple]:
    """The target's inputs on the calibration batches, when a variant pass (int8) is enabled."""
    wanted = [options for spec, options in plan_passes(config.passes) if spec.stage is Stage.variant]
    if not wanted:
        return []
    count = max(getattr(options, "calibration_batches", 8) for options in wanted)
    items = calibration.items if calibration is not None and calibration.items else data
    rule = config.parity.input if calibration is not None and calibration.items else rule
    device, dtype = model_device_dtype(whole)
    return [target_example_inputs(whole, target, as_args(to_model(extract_input(b, rule), device, dtype)))[0]
            for b in items[:count]]


def _parity_data(
    config: FuseConfig, batches: Batches, example_inputs: Any, notes: List[str]
) -> Tuple[List[Any], InputRule, str]:
    """The batches parity reads, the rule that takes forward's inputs out of them, and their source."""
    wanted = config.parity.max_batches if config.parity.enabled else 1
    data = list(itertools.islice(iter(batches.items), wanted))
    if isinstance(example_inputs, Mapping):
        # Lightning allows a dict of keyword arguments here; capture and export take positional ones.
        notes.append("example_inputs is a dict (keyword arguments): not used")
        example_inputs = None
    model_inputs = as_example_inputs(example_inputs)
    if not data and model_inputs is not None:
        if batches.source != "example":
            notes.append("no data batches: used the example inputs instead")
        return [model_inputs], identity_rule, "example"
    return data, config.parity.input, batches.source


def _first_target_inputs(
    whole: nn.Module, target: nn.Module, data: List[Any], rule: InputRule, notes: List[str]
) -> Optional[tuple]:
    """The target's arguments on the first batch (what capture and export trace with)."""
    if not data:
        return None
    device, dtype = model_device_dtype(whole)
    first = as_args(to_model(extract_input(data[0], rule), device, dtype))
    args, kwargs = target_example_inputs(whole, target, first)
    if kwargs:
        notes.append(
            f"the target is called with keyword arguments ({', '.join(kwargs)}); they are not part of "
            "the example inputs given to capture"
        )
    return args


def judge(measured: Measured, parity_state: Optional[ParityState] = None) -> Outcome:
    """The outcome of ``measured`` with its parity verdict; ``parity_state`` (default: ``measured``'s own)
    is what the gate sees, e.g. the merge of every rank's. Nothing is exported yet."""
    state = parity_state if parity_state is not None else measured.parity_state
    parity = judge_parity(state, measured.config.parity) if state is not None else None
    return Outcome(measured.result, parity, None, measured.target, measured.fused_model, list(measured.notes))


def parity_verdict(outcome: Outcome, config: FuseConfig) -> Optional[ParityError]:
    """What a failed parity check means under ``parity.on_failure``: the :class:`ParityError` to raise
    (``raise``), or None after a warning (``warn``) or when parity passed. Adds the note to ``outcome``."""
    parity = outcome.parity
    if parity is None or parity.passed:
        return None
    message = (
        f"parity FAILED for target {outcome.target or '<whole model>'!r}: " + "; ".join(parity.failures)
        + ". Nothing was exported."
    )
    outcome.notes.append("parity failed: nothing was exported")
    if config.parity.on_failure is OnError["raise"]:
        error = ParityError(message + " (set parity.on_failure: warn to only warn)")
        error.report = parity  # type: ignore[attr-defined]
        error.outcome = outcome  # type: ignore[attr-defined]
        return error
    warnings.warn(message, UserWarning, stacklevel=3)
    return None


def export_outcome(
    outcome: Outcome,
    measured: Measured,
    *,
    export_dir: Union[str, Path, None] = None,
    protected_paths: Sequence[Union[str, Path]] = (),
    extra: Optional[Dict[str, Any]] = None,
) -> Outcome:
    """Write the fused model of a judged ``outcome`` (parity passed or disabled) to ``export_dir`` (default
    ``export.dir``) when export is enabled; sets ``outcome.export_dir``. Raises :class:`ExportError`."""
    config = measured.config
    directory = export_dir if export_dir is not None else config.export.dir
    if not config.export.enabled:
        return outcome
    if directory is None:
        outcome.notes.append("export skipped: no export directory (set export.dir)")
        return outcome
    directory = Path(directory)
    _refuse_protected(directory, protected_paths)
    if measured.target_inputs is None:
        raise ExportError(
            f"export to {directory}: no example inputs (no data batches and no example_inputs); the "
            "exporter needs them to write the fused model"
        )
    from fx_lightning.export import export_fused  # late: pulls in the writers

    outcome.export_dir = export_fused(
        measured.result.graph_module,
        directory,
        example_inputs=tuple(detached(measured.target_inputs)),
        config=config,
        report=measured.result.report,
        parity=outcome.parity.to_dict() if outcome.parity is not None else None,
        extra={"target": outcome.target, **(extra or {})},
    )
    from fx_lightning.export import read_manifest

    for name, reason in read_manifest(outcome.export_dir).get("failed_formats", {}).items():
        outcome.notes.append(f"format {name} not exported ({reason.split(': ', 1)[-1]})")
    outcome.notes.extend(_export_variants(outcome, measured))
    if config.export.select is Selection.fastest:
        outcome.notes.append(_select_fastest(outcome.export_dir, measured))
    return outcome


def _export_variants(outcome: Outcome, measured: Measured) -> List[str]:
    """Make each enabled variant (int8) of the verified fused model, write it beside the fp32 artifacts and keep
    the artifacts that pass the variant's gate; the notes say what each did."""
    from fx_lightning.export.variants import add_variant

    notes = []
    config = measured.config
    ctx = PassContext(capture_mode=measured.result.report.capture_mode, example_inputs=measured.target_inputs,
                      calibration=measured.calibration)
    for spec, options in plan_passes(config.passes):
        if spec.stage is not Stage.variant:
            continue
        made = run_pass(spec, measured.result.graph_module, options, ctx)
        gate_config = dataclasses.replace(
            config.parity, min_cosine=options.min_cosine, min_top1_agreement=options.min_top1_agreement,
            max_accuracy_drop=options.max_accuracy_drop)
        results = add_variant(outcome.export_dir, made.variant_name, made.variant, tuple(measured.target_inputs),
                              config, lambda loaded: _gate_variant(measured, loaded, gate_config, f"passes.{spec.name}"),
                              imports=made.variant_imports)
        for name, report in results.items():
            verdict = "passed its gate" if report.get("passed") else "missed its gate: " + "; ".join(report.get("failures", []))
            figures = {k: v for k, v in (report.get("metrics") or {}).items()
                       if k in ("top1_agreement", "accuracy_drop", "cosine_similarity_min")}
            notes.append(f"{name} {verdict} {figures}" + ("" if report.get("passed") else "; the fp32 artifacts stand"))
    return notes


def _gate_variant(measured: Measured, loaded: nn.Module, cfg: Any, config_key: str) -> ParityReport:
    """A lossy variant against the fp32 fused model on the parity batches: top-1 agreement, accuracy drop."""
    path = measured.target
    whole = whole_model_with(measured.fused_model, path, loaded) if path else loaded
    state = measure_parity(measured.result.graph_module, loaded, measured.data, cfg,
                           whole_reference=measured.fused_model if path else None,
                           whole_candidate=whole if path else None, input_rule=measured.input_rule,
                           source="val")
    return judge_parity(state, cfg, lossy=True, config_key=config_key)


def _select_fastest(directory: Path, measured: Measured) -> str:
    """Time the export's artifacts against the unfused target (eager), record the fastest that passed."""
    from fx_lightning.export import bench_export, record_selection, select_fastest

    size = measured.config.export.select_batch_size
    baselines = {"eager": measured.reference} if measured.reference is not None else {}
    table = bench_export(directory, batch_sizes=sorted({1, size}), baselines=baselines, rounds=15, warmup=3)
    selected = select_fastest(table, size)
    record_selection(directory, table, selected)
    if selected is None:
        return "export.select: fastest: no artifact passed its check; load_fused falls back to the order of preference"
    eager = table.median("eager", size)
    speedup = f", {eager / selected['median_ms']:.2f}x eager" if eager else ""
    return f"load_fused selects {selected['format']}: {selected['why']}{speedup}"


def fuse_verify_export(
    model: nn.Module,
    config: FuseConfig,
    batches: Batches,
    *,
    example_inputs: Any = None,
    export_dir: Union[str, Path, None] = None,
    write: bool = True,
    protected_paths: Sequence[Union[str, Path]] = (),
    extra: Optional[Dict[str, Any]] = None,
) -> Outcome:
    """Fuse ``config.target`` of ``model``, check parity on ``batches``, export when parity passed.

    ``export_dir``: where to write (default ``config.export.dir``; nothing is written when both are None or
    ``write`` is false). ``protected_paths``: files (checkpoints) the export must never replace: an export
    directory equal to or containing one of them is refused. A failed parity check raises
    :class:`ParityError` (with ``.report`` and ``.outcome``) when ``parity.on_failure`` is ``raise``;
    otherwise it warns. Either way nothing is exported.
    """
    device = resolve_device(config.device, None)
    measured = fuse_and_measure(model, config, batches, example_inputs=example_inputs, device=device)
    outcome = judge(measured)
    error = parity_verdict(outcome, config)
    if error is not None:
        raise error
    if write and (outcome.parity is None or outcome.parity.passed):
        export_outcome(outcome, measured, export_dir=export_dir, protected_paths=protected_paths, extra=extra)
    return outcome


def summary_text(outcome: Outcome) -> str:
    """What happened, for people: the target, the fuse report, the parity verdict, notes and the export."""
    report = outcome.result.report
    lines = [
        f"target: {outcome.target or '<the whole LightningModule>'}",
        str(report),
        f"BatchNorms folded: {report.batchnorms_folded}, left: {report.after.batchnorms}",
    ]
    if outcome.parity is not None:
        lines.append(str(outcome.parity))
    lines += [f"note: {note}" for note in outcome.notes]
    lines.append(f"fused model exported to {outcome.export_dir}" if outcome.export_dir is not None
                 else "fused model not exported")
    return "\n".join(lines)


def _load_buffers(module: nn.Module, buffers: Mapping[str, torch.Tensor]) -> None:
    own = dict(module.named_buffers())
    for name, value in buffers.items():
        mine = own.get(name)
        if mine is not None and mine.shape == value.shape:
            mine.copy_(value.to(device=mine.device, dtype=mine.dtype))


def _refuse_protected(directory: Path, protected: Sequence[Union[str, Path]]) -> None:
    """An export replaces its directory atomically: it must never be (or contain) a checkpoint."""
    target = directory.resolve()
    for item in protected:
        p = Path(item).resolve()
        if p == target or target in p.parents:
            raise ExportError(
                f"export.dir: {str(directory)!r} is or contains {str(item)!r}; exporting there could replace a "
                "checkpoint. Choose another export.dir."
            )
