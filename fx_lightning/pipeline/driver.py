"""The one driver: :func:`run_pipeline` runs the steps (:mod:`.steps`) for every caller: the callback at the end of
fit, the preflight before training (the same steps on a copy of the untrained model, into a temporary directory:
``Mode.rehearsal``) and the command line (:func:`fuse_verify_export`).

In several processes every rank makes the same collective calls in the same order, whatever happens to it:

  -- local: the caller's source (weights, batches, loaded by the caller: :func:`load_source`), fuse, measure
     parity on this rank's share (errors are caught)
  1. exchange   (all_gather: every rank's skip reason, error or parity measurements)
  -- any error: every rank returns the lowest failing rank's, named; any skip: every rank skips
  2. verdict    (broadcast from rank zero, which merges the measurements and judges them once)
  -- parity failed: every rank raises or warns alike, nothing is written
  3. export     (broadcast from rank zero, which writes: no rank returns before the export is complete or failed)

In one process (:data:`~fx_lightning.pipeline.collectives.LOCAL`) these calls cost nothing.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, Union

from torch import nn

from fx_lightning.common.batches import loader_sample_counts
from fx_lightning.config import ConfigLike, FuseConfig, OnError, load_config
from fx_lightning.pipeline.engine import FuseResult
from fx_lightning.errors import ERROR_CLASSES, FXLightningError, ParityError, first_line, require_inputs
from fx_lightning.export.manifest import Manifest
from fx_lightning.export.progress import Progress, StepTime, log_lines, quiet_libraries, times_text
from fx_lightning.export.write.report_html import REPORT_NAME
from fx_lightning.common.notes import Note, NoteKind
from fx_lightning.parity.gate import ALL_STOCHASTIC, ParityState, merge_parity_states
from fx_lightning.parity.report import ParityReport
from fx_lightning.pipeline.collectives import LOCAL, Collectives
from fx_lightning.pipeline.export_step import export
from fx_lightning.pipeline.forms_step import fuse_forms
from fx_lightning.pipeline.records import Batches, Exported, Fused, Source
from fx_lightning.pipeline.steps import (
    Step,
    fuse_target,
    judge,
    measure,
)
from fx_lightning.pipeline.targets import deterministic_inside, refuse_protected, resolve_device
from fx_lightning.common.provenance import Provenance

__all__ = [
    "Mode",
    "Destination",
    "Failure",
    "Outcome",
    "ErrorInfo",
    "load_source",
    "run_pipeline",
    "run_locally",
    "LocalShare",
    "exchange_failure",
    "fuse_verify_export",
    "fuse_and_export",
    "summary_text",
    "PARITY_FAILED",
    "NO_EXPORT_DIRECTORY",
    "PARITY_MERGED",
    "BUFFERS_DIFFERED",
]

PARITY_FAILED = NoteKind("parity_failed", "parity failed: nothing was exported")
NO_EXPORT_DIRECTORY = NoteKind("no_export_directory", "export skipped: no export directory (set export.dir)")
PARITY_MERGED = NoteKind("parity_merged", "parity merged over {ranks} ranks, each on its own share of the data "
                                          "(batches per rank, in rank order: {batches})")
BUFFERS_DIFFERED = NoteKind("buffers_differed", "buffers (BatchNorm running statistics) on ranks {ranks} differed "
                                                "from rank 0's (no sync_batchnorm): every rank fused rank 0's, the "
                                                "weights that are exported")


class Mode(str, Enum):
    """``final``: the real run. ``rehearsal``: the preflight's run on the untrained model; the parity gate is
    measured but not applied, and any format, variant or selection that cannot run is an error."""

    final = "final"
    rehearsal = "rehearsal"


@dataclass
class Destination:
    """Where the export goes: ``directory`` (None: nowhere, with a note saying so), files it must never replace
    (checkpoints), what the manifest records about the model's origin, and ``dry_run`` (write nothing, quietly)."""

    directory: Optional[Path]
    protected: Sequence[Union[str, Path]] = ()
    provenance: Provenance = field(default_factory=Provenance)
    dry_run: bool = False


@dataclass
class ErrorInfo:
    """An error as it travels between ranks: its rank, type name, cause and step (never the object: it may not
    pickle, and its class may not exist on the other side)."""

    rank: int
    type_name: str
    message: str
    step: Optional[str] = None
    fix: Optional[str] = None  # the error's own advice ("": none works), so every rank gives the same

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> "ErrorInfo":
        if isinstance(exc, FXLightningError):
            return cls(rank, type(exc).__name__, exc.message, exc.step, exc.fix)
        return cls(rank, type(exc).__name__, str(exc))

    def rebuild(self) -> FXLightningError:
        """The same fx_lightning error class when it is one of ours, else :class:`FXLightningError`."""
        error = ERROR_CLASSES.get(self.type_name, FXLightningError)(self.message)
        error.step, error.fix = self.step, self.fix
        return error


@dataclass
class Failure:
    """What failed: ``error`` (this process's own, or rebuilt from another rank's when ``remote``), always one of
    ours (a foreign exception is wrapped once, its type kept in ``type_name`` and as the ``__cause__``), and
    ``where`` it happened (" on rank 1 of 2")."""

    error: FXLightningError
    where: str = ""
    type_name: Optional[str] = None
    remote: bool = False

    @classmethod
    def of(cls, exc: BaseException, where: str = "") -> "Failure":
        """This process's own ``exc``: ours as it is, anything else wrapped once."""
        if isinstance(exc, FXLightningError):
            return cls(exc, where, type(exc).__name__)
        wrapped = FXLightningError(f"{type(exc).__name__}: {exc}")
        wrapped.__cause__ = exc
        return cls(wrapped, where, type(exc).__name__)


@dataclass
class Outcome:
    """What the pipeline did. ``result`` is None when it failed before a verdict; ``failure`` says what failed
    (the caller raises or warns); ``steps`` are the steps that completed, in order."""

    target: str = ""
    result: Optional[FuseResult] = None
    fused_model: Optional[nn.Module] = None
    parity: Optional[ParityReport] = None
    export_dir: Optional[Path] = None
    manifest: Optional[Manifest] = None
    notes: List[Note] = field(default_factory=list)
    skipped: Optional[str] = None
    failure: Optional[Failure] = None
    steps: List[str] = field(default_factory=list)
    times: List[StepTime] = field(default_factory=list)  # how long each step took here, as the progress saw it


@dataclass
class _RankReport:
    """What each rank sends in the exchange (1)."""

    rank: int
    skip: Optional[str] = None
    error: Optional[ErrorInfo] = None
    state: Optional[ParityState] = None
    buffers_differ: bool = False
    batches: int = 0


@dataclass
class _Verdict:
    """Rank zero's decision (2): the merged parity report, the outcome's notes and steps. Rank zero broadcasts it,
    or the ErrorInfo of what failed; the export (3) travels as the step's own record, ``Exported``, or an
    ErrorInfo likewise."""

    parity: Optional[ParityReport]
    notes: List[Note] = field(default_factory=list)
    steps: List[str] = field(default_factory=list)


@dataclass
class LocalShare:
    """This rank's share before the exchange: its source, fused target, parity state, or what it raised."""

    source: Optional[Source] = None
    fused: Optional[Fused] = None
    state: Optional[ParityState] = None
    error: Optional[Exception] = None


def load_source(load: Callable[[], Source], progress: Progress) -> Union[Source, Exception]:
    """``load()`` (the caller's own code: it reads weights and batches) as a step, or what it raised, for
    :func:`run_pipeline` to exchange with the other ranks."""
    try:
        with progress.step("load the model and its calls"):
            return load()
    except Exception as exc:  # noqa: BLE001 - carried to every rank by the exchange, raised by the caller
        return exc


def run_pipeline(
    config: FuseConfig,
    source: Union[Source, Exception, None],
    destination: Destination,
    *,
    collectives: Collectives = LOCAL,
    mode: Mode = Mode.final,
    skip: Optional[str] = None,
    progress: Optional[Progress] = None,
) -> Outcome:
    """Fuse the target of ``source`` (the caller loaded it: :func:`load_source`; an exception: what loading raised
    on this rank; None: skipped), verify parity and export, with the collective protocol above. Raises nothing: the
    outcome's ``failure`` says what failed, and every rank gets the same. ``skip``: a reason not to run on this
    rank (every rank then skips). ``progress``: where each step
    says it started and ended (default: plain lines through the ``fx_lightning.progress`` logger); the outcome
    keeps their times. The libraries' own INFO lines are kept out meanwhile (:func:`quiet_libraries`)."""
    if callable(source):  # the load function earlier versions took: it would fail below as an attribute error
        raise TypeError("run_pipeline() takes the loaded Source (or what loading raised): pass "
                        "load_source(load, progress), not the load function")
    progress = progress if progress is not None else log_lines()
    try:
        with quiet_libraries():
            outcome = _run(config, source, destination, collectives, mode, skip, progress)
    finally:
        progress.close()
    outcome.times = list(progress.times)
    return outcome


def _run(config: FuseConfig, source: Union[Source, Exception, None], destination: Destination, collectives: Collectives,
         mode: Mode, skip: Optional[str], progress: Progress) -> Outcome:
    rank = collectives.rank
    local = run_locally(config, source, progress) if skip is None else LocalShare()
    mine = _RankReport(rank, skip, ErrorInfo.of(rank, local.error) if local.error is not None else None, local.state,
                       local.source.buffers_differ if local.source is not None else False,
                       len(local.fused.steps) if local.fused is not None else 0)
    everyone: List[_RankReport] = collectives.all_gather(mine)  # 1.
    failed = [r.error for r in everyone if r.error is not None]
    if failed:
        return Outcome(failure=_failure_of(collectives, failed, local.error))
    skipped = next((r.skip for r in everyone if r.skip is not None), None)
    if skipped is not None:
        return Outcome(skipped=skipped)
    fused, source = local.fused, local.source
    assert fused is not None and source is not None  # no rank skipped or failed, so this one fused
    verdict, decide_error = _decide(collectives, config, fused, source, everyone) if rank == 0 else (None, None)
    verdict = collectives.broadcast(verdict, src=0)  # 2.
    if isinstance(verdict, ErrorInfo):
        return Outcome(failure=_failure_of(collectives, [verdict], decide_error))
    outcome = Outcome(fused.target, fused.result, fused.fused_model, verdict.parity, notes=list(verdict.notes),
                      steps=list(verdict.steps))
    if mode is Mode.final and outcome.parity is not None and not outcome.parity.passed:
        # The same report everywhere: the same failure (or warning) on every rank, and nothing exported.
        outcome.failure = _parity_failure(outcome, config, fused)
        outcome.notes.append(PARITY_FAILED())
        return outcome
    if mode is Mode.rehearsal and _fails_whatever_the_weights(outcome.parity, config):
        outcome.failure = _parity_failure(outcome, config, fused)  # what the end of fit raises, raised before it
        return outcome
    if not config.export.enabled or destination.dry_run:
        return outcome
    if destination.directory is None:
        outcome.notes.append(NO_EXPORT_DIRECTORY())
        return outcome
    written, export_error = (_write(config, fused, source, outcome.parity, destination, mode, progress) if rank == 0
                             else (None, None))
    written = collectives.broadcast(written, src=0)  # 3.
    if isinstance(written, ErrorInfo):
        outcome.failure = _failure_of(collectives, [written], export_error)
        return outcome
    outcome.export_dir, outcome.manifest = written.directory, written.manifest
    outcome.notes += written.notes
    outcome.steps += written.steps
    return outcome


def run_locally(config: FuseConfig, source: Union[Source, Exception, None], progress: Progress) -> LocalShare:
    """This rank's share: fuse a copy of the source, measure parity on this rank's batches (``source`` an
    exception: what loading raised). Public as the seam a caller wraps to run ranks its own way (the tests run them
    as threads, one at a time through torch.fx)."""
    if source is None or isinstance(source, Exception):
        return LocalShare(error=source if source is not None else FXLightningError("no source was loaded"))
    local = LocalShare(source)
    try:
        with progress.step("capture and passes") as end:
            local.fused = fuse_target(local.source, config)
            report = local.fused.result.report
            end.result = (f"{report.batchnorms_folded} BatchNorm(s) folded, {report.after.batchnorms} left; "
                          f"capture: {report.capture_mode}")
        with progress.step("parity") as end:
            local.state = measure(local.fused, config)
            end.result = "measured" if local.state is not None else "disabled (parity.enabled: false)"
    except Exception as exc:  # noqa: BLE001 - carried to every rank by the exchange, raised by the caller
        local.error = exc
    return local


def _decide(collectives: Collectives, config: FuseConfig, fused: Fused, source: Source,
            everyone: List[_RankReport]) -> Tuple[Union[_Verdict, ErrorInfo], Optional[Exception]]:
    """Rank zero: merge every rank's parity measurements and judge them once."""
    try:
        states = [r.state for r in everyone]
        if config.parity.enabled and any(s is None for s in states):
            raise FXLightningError("a rank sent no parity measurements (ranks disagree on parity.enabled)")
        parity = judge(merge_parity_states([s for s in states if s is not None]) if config.parity.enabled else None,
                       config)
        notes = list(fused.notes)
        if collectives.world_size > 1:
            notes.append(PARITY_MERGED(ranks=collectives.world_size, batches=tuple(r.batches for r in everyone)))
            differ = tuple(r.rank for r in everyone if r.buffers_differ)
            if differ:
                notes.append(BUFFERS_DIFFERED(ranks=differ))
        steps = list(dict.fromkeys([*source.checked, Step.parity_input.value, Step.capture.value, Step.passes.value,
                                    *([Step.parity.value] if parity is not None else [])]))  # each once, in order
        return _Verdict(parity, notes, steps), None
    except Exception as exc:  # noqa: BLE001 - carried to every rank by the verdict broadcast
        return ErrorInfo.of(0, exc), exc


def _write(config: FuseConfig, fused: Fused, source: Source, parity: Optional[ParityReport],
           destination: Destination, mode: Mode, progress: Progress
           ) -> Tuple[Union[Exported, ErrorInfo], Optional[Exception]]:
    """Rank zero: the export step (atomically: complete or not at all)."""
    assert destination.directory is not None
    try:
        refuse_protected(destination.directory, destination.protected)
        # The manifest's provenance: the caller's, with the target and the weights this process fused.
        provenance = dataclasses.replace(destination.provenance, target=fused.target,
                                         weights=source.weights or destination.provenance.weights)
        forms = fuse_forms(config, fused, source, final=mode is Mode.final, progress=progress)
        with progress.step("export", str(destination.directory)) as end:
            exported = export(fused, config, parity, destination.directory, provenance,
                              rehearsal=mode is Mode.rehearsal, progress=progress, forms=forms)
            end.result = f"{len(exported.manifest.formats) if exported.manifest else 0} artifact(s)"
        return exported, None
    except Exception as exc:  # noqa: BLE001 - carried to every rank by the export broadcast
        if isinstance(exc, FXLightningError):
            exc.step = exc.step or Step.export.value
        return ErrorInfo.of(0, exc), exc


def exchange_failure(collectives: Collectives, error: Optional[Exception]) -> Optional[Failure]:
    """Every rank's ``error`` (None: it had none) gathered: the lowest failing rank's failure on every rank, or None
    when no rank failed. A collective: every rank calls it."""
    mine = ErrorInfo.of(collectives.rank, error) if error is not None else None
    failed = [e for e in collectives.all_gather(mine) if e is not None]
    return _failure_of(collectives, failed, error) if failed else None


def _failure_of(collectives: Collectives, failed: List[ErrorInfo], local: Optional[Exception]) -> Failure:
    """Every rank gets the same error: the lowest failing rank's, naming it."""
    first = failed[0]
    where = ""
    if collectives.world_size > 1:
        where = f" on rank {first.rank} of {collectives.world_size}"
        if len(failed) > 1:
            where += " (also on " + ", ".join(f"rank {f.rank}: {f.type_name}" for f in failed[1:]) + ")"
    if local is not None and first.rank == collectives.rank:
        return Failure.of(local, where)
    return Failure(first.rebuild(), where, first.type_name, remote=True)


def _fails_whatever_the_weights(parity: Optional[ParityReport], config: FuseConfig) -> bool:
    """Whether the rehearsal's parity shows a failure training cannot change, which the end of fit raises: every
    output drawn at random in eval mode (a guide sampling its posterior) leaves nothing to compare at any weights.
    The gate's thresholds are not judged here: the untrained model's errors say nothing of the trained one's."""
    return (parity is not None and config.parity.on_failure is OnError["raise"]
            and any(f.kind == ALL_STOCHASTIC for f in parity.failures))


def _inner_target_fix(parity: ParityReport, fused: Fused) -> Optional[str]:
    """Where every output is drawn at random, the advice to fuse the deterministic module inside that holds the
    weights (:func:`deterministic_inside`), when there is one; else None (the stage's advice)."""
    if not any(f.kind == ALL_STOCHASTIC for f in parity.failures) or not fused.steps:
        return None
    found = deterministic_inside(fused.reference, fused.steps[0].target)
    if found is None:
        return None
    inner, held, total = found
    return (f"set target: {'.'.join(filter(None, (fused.target, inner)))} (it holds {held:,} of the {total:,} "
            "parameters, and its calls inside give the same outputs run after run: a model sampling around it "
            "calls it as the artifact would be called)")


def _parity_failure(outcome: Outcome, config: FuseConfig, fused: Fused) -> Optional[Failure]:
    """A failed gate under ``parity.on_failure``: the :class:`ParityError` to raise (``raise``), or None after a
    warning (``warn``). Either way nothing is exported."""
    assert outcome.parity is not None
    message = (f"parity FAILED for target {outcome.target or '<whole model>'!r}: "
               + "; ".join(str(f) for f in outcome.parity.failures) + ". Nothing was exported.")
    if config.parity.on_failure is OnError["raise"]:
        error = ParityError(message + " (set parity.on_failure: warn to only warn)", report=outcome.parity,
                            outcome=outcome)
        error.step = Step.parity.value
        error.fix = _inner_target_fix(outcome.parity, fused)
        return Failure.of(error)
    warnings.warn(message, UserWarning, stacklevel=4)
    return None


def fuse_verify_export(
    model: nn.Module,
    config: FuseConfig,
    batches: Batches,
    *,
    example_inputs: object = None,
    export_dir: Union[str, Path, None] = None,
    write: bool = True,
    protected_paths: Sequence[Union[str, Path]] = (),
    extra: Union[Provenance, dict, None] = None,
    progress: Optional[Progress] = None,
) -> Outcome:
    """The pipeline in this process: fuse ``config.target`` of ``model``, check parity on ``batches``, export
    when parity passed, and raise what failed.

    ``export_dir``: where to write (default ``config.export.dir``; nothing is written when both are None or
    ``write`` is false). ``protected_paths``: files (checkpoints) the export must never replace. ``extra``:
    where the model came from (a Provenance or its dict), for the manifest. A failed parity check raises
    :class:`ParityError` (with ``.report`` and ``.outcome``) when ``parity.on_failure`` is ``raise``; otherwise
    it warns. Either way nothing is exported. ``progress``: where each step is shown (default: plain lines
    through the ``fx_lightning.progress`` logger).
    """
    directory = export_dir if export_dir is not None else config.export.dir
    provenance = extra if isinstance(extra, Provenance) else Provenance.from_dict(extra)
    destination = Destination(Path(directory) if directory is not None else None, protected_paths, provenance,
                              dry_run=not write)

    progress = progress if progress is not None else log_lines()
    source = load_source(lambda: Source(model, batches, example_inputs, device=resolve_device(config.device, None)),
                         progress)
    outcome = run_pipeline(config, source, destination, progress=progress)
    if outcome.failure is not None:
        raise outcome.failure.error
    return outcome


def fuse_and_export(
    model: nn.Module,
    directory: Union[str, Path],
    *,
    batches: Optional[Iterable[object]] = None,
    example_inputs: object = None,
    config: ConfigLike = None,
) -> Outcome:
    """Fuse ``model``, prove on your data that it gives the same answers, and export it to ``directory``: the
    callback's pipeline without Lightning.

    ``batches``: data batches (a DataLoader or any iterable; up to ``parity.max_batches`` are read), from which
    ``parity.input`` takes forward's inputs (automatically: a tensor, the first item of a tuple, an ``x``/``input``/
    ``image``... key). ``example_inputs``: forward's arguments (a tensor or a tuple), used when there are no
    batches. ``config``: a FuseConfig, a dict or a DictConfig of the same shape (``export.dir`` is ``directory``).
    ``model`` is never changed. Raises :class:`ParityError` when the fused model disagrees (nothing is written), or
    the error of the step that failed; returns the :class:`Outcome` (``export_dir``, ``parity``, ``result``...)::

        outcome = fx_lightning.fuse_and_export(model, "fused", batches=val_loader)
        served = fx_lightning.load_fused("fused")
    """
    cfg = config if isinstance(config, FuseConfig) else load_config(config)
    require_inputs(batches is not None or example_inputs is not None, "checking and exporting the fused model",
                   "batches (data to verify on) or example_inputs (forward's arguments)", key="fuse_and_export()")
    items = list(itertools.islice(iter(batches), cfg.parity.max_batches)) if batches is not None else []
    counts = loader_sample_counts(batches, len(items)) if batches is not None else []
    return fuse_verify_export(model, cfg, Batches(items, "given", samples=counts), example_inputs=example_inputs,
                              export_dir=directory)


def summary_text(outcome: Outcome, also: Sequence[str] = ()) -> str:
    """What happened, for people. First what they decide on: BatchNorms folded and left, the parity verdict, what
    is served and how fast, where the export and its report are; then the details (the target, the fuse report,
    the parity figures, notes), ``also`` (the preflight's report), and last the time each step took."""
    lines = _decisions(outcome)
    lines.append(f"target: {outcome.target or '<the whole LightningModule>'}")
    if outcome.result is not None:
        lines.append(str(outcome.result.report))
    if outcome.parity is not None:
        lines.append(str(outcome.parity))
    lines += [f"note: {note}" for note in outcome.notes]
    lines += list(also)
    return "\n".join(lines + times_text(outcome.times))


def _decisions(outcome: Outcome) -> List[str]:
    """The summary's first lines."""
    lines = []
    if outcome.failure is not None:
        lines.append(f"FAILED{outcome.failure.where}: {first_line(outcome.failure.error)}")
    if outcome.result is not None:
        report = outcome.result.report
        lines.append(f"BatchNorms: {report.batchnorms_folded} folded, {report.after.batchnorms} left"
                     + (" (each with its reason below)" if report.after.batchnorms else ""))
    if outcome.parity is not None:
        worst = outcome.parity.metrics.get("relative_max_error")
        lines.append(f"parity: {'PASSED' if outcome.parity.passed else 'FAILED'}"
                     + (f" (worst relative error {worst:.3g})" if worst is not None else ""))
    selected = outcome.manifest.selected if outcome.manifest is not None else None
    if selected is not None:
        lines.append(f"served: {selected.format} at batch {selected.batch_size} ({selected.traffic}): "
                     f"{selected.median_ms:.3g} ms median")
    if outcome.export_dir is not None:
        lines.append(f"fused model exported to {outcome.export_dir} (open {outcome.export_dir / REPORT_NAME})")
    else:
        lines.append("fused model not exported")
    return lines
