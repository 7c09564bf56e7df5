"""What each server worker serves and how it proves it: the server's options (:class:`ServeOptions`), the artifact
they pick (:func:`artifact_for`), loading it with its sha256 and ``check.pt`` self-check (:func:`load_checked`),
and the :class:`StatusBoard` through which the workers tell the HTTP process how that went (``/health``)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from fx_lightning.config import Strategy, Traffic
from fx_lightning.errors import ConfigError, ExportError
from fx_lightning.formats.batching import BatchPieces
from fx_lightning.export.load.loader import load_artifact, preferred_format, runtime_for, selection_for
from fx_lightning.formats import FORMATS
from fx_lightning.export.manifest import Manifest, read_manifest, verify_files
from fx_lightning.export.select.selection import check_entry
from fx_lightning.parity.report import ArtifactCheck
from fx_lightning.export.select.sweep import recorded_batching
from fx_lightning.export.check import read_check_file
from fx_lightning.serve.contract import DEFAULT_MAX_BODY_MB, DEFAULT_MAX_REQUEST_BATCH
from fx_lightning.serve.triton_config import int_at_least, model_name_at
from fx_lightning.common.rows import with_rows

# Without a recorded sweep: requests batched into one run, and seconds a batch waits to fill (0: none; a batch is
# what waited while the worker ran the one before, as with the sweep's batching: export/select/sweep.py).
DEFAULT_MAX_BATCH_SIZE = 8
DEFAULT_BATCH_TIMEOUT = 0.0
SWEPT = "the export's throughput sweep"  # ServeOptions.batching when both settings came from it

__all__ = ["ServeOptions", "DEFAULT_MAX_BATCH_SIZE", "DEFAULT_BATCH_TIMEOUT", "WorkerStatus", "StatusBoard", "load_checked", "artifact_for", "warm_up",
           "serving_batch_sizes"]


@dataclass
class ServeOptions:
    """The server's settings (the ``fx-lightning serve`` flags), checked in one place by :meth:`check`."""

    format: Optional[str] = None  # None: the artifact the export selected for the batching
    # Requests batched into one run (1: no batching) and seconds a batch waits to fill. None: from the export's
    # throughput sweep (export/select/sweep.py: recorded_batching), which also picks its max-throughput artifact; else
    # DEFAULT_MAX_BATCH_SIZE and DEFAULT_BATCH_TIMEOUT. with_batching() fills them and says where from.
    max_batch_size: Optional[int] = None
    batch_timeout: Optional[float] = None
    workers: int = 1
    threads: Optional[int] = None  # per worker; None: the CPU cores / workers
    max_request_batch: int = DEFAULT_MAX_REQUEST_BATCH  # samples in one request
    max_body_mb: float = float(DEFAULT_MAX_BODY_MB)
    top_k: int = 5  # labels per row in a response, when the export has labels
    timeout: float = 30.0  # seconds a request may wait in the queue
    model_name: Optional[str] = None  # the Open Inference Protocol's model name; None: the export directory's
    batching: str = ""  # where max_batch_size and batch_timeout came from (with_batching)

    def check(self) -> None:
        int_at_least("serve max_batch_size", self.max_batch_size, 1, ", or None for the export's throughput sweep")
        for key, minimum in (("workers", 1), ("max_request_batch", 1), ("top_k", 0)):
            int_at_least(f"serve {key}", getattr(self, key), minimum)
        int_at_least("serve threads", self.threads, 1, ", or None for the cores per worker")
        wait = self.batch_timeout
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float))
                                 or not 0 <= wait < math.inf):
            raise ConfigError(f"serve batch_timeout: {wait!r}; allowed: a number of seconds >= 0 (0: a batch is what "
                              "waits when the worker is free), or None for the export's sweep.")
        for key in ("max_body_mb", "timeout"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"serve {key}: {value!r}; allowed: a number > 0.")
        model_name_at("serve model_name", self.model_name, "the name a Triton repository would give it")
        if self.batch_timeout is not None and self.batch_timeout >= self.timeout:
            raise ConfigError(f"serve batch_timeout: {self.batch_timeout!r}; allowed: less than timeout "
                              f"({self.timeout!r} s, how long a request may wait).")

    def with_batching(self, manifest: Manifest) -> "ServeOptions":
        """These options with ``max_batch_size`` and ``batch_timeout`` filled where None: from the export's
        throughput sweep of ``format`` (None: of its max-throughput pick, which is then served) when it recorded
        one, else the defaults; ``batching`` says which."""
        if self.max_batch_size is not None and self.batch_timeout is not None:
            return self if self.batching else dataclasses.replace(self, batching="given")
        recorded = recorded_batching(manifest, self.format) if manifest.call_signature().batched else None
        if recorded is None:
            return dataclasses.replace(
                self, max_batch_size=DEFAULT_MAX_BATCH_SIZE if self.max_batch_size is None else self.max_batch_size,
                batch_timeout=DEFAULT_BATCH_TIMEOUT if self.batch_timeout is None else self.batch_timeout,
                batching=self.batching or "defaults (the export recorded no throughput sweep of the artifact)")
        timeout = min(recorded.queue_delay_s, self.timeout / 2)
        return dataclasses.replace(
            self, max_batch_size=recorded.max_batch_size if self.max_batch_size is None else self.max_batch_size,
            batch_timeout=timeout if self.batch_timeout is None else self.batch_timeout,
            batching=(SWEPT + (" (batch_timeout given)" if self.batch_timeout is not None else "")
                      if self.max_batch_size is None else f"batch_timeout from {recorded.why}"))

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))

    def threads_per_worker(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // self.workers)


@dataclass
class WorkerStatus:
    """A worker's artifact (which one, with which runtime settings), its :class:`ArtifactCheck` on ``check.pt`` (the
    one judgement the export and the selection made too) and the seconds its warm-up took; ``reason``: why it is not
    ready."""

    ready: bool
    artifact: str = ""
    runtime: str = ""
    check: Optional[ArtifactCheck] = None
    reason: str = ""
    warmup_s: float = 0.0  # running it once at every batch size the batcher can form

    @property
    def relative_error(self) -> Optional[float]:
        return self.check.relative_error if self.check is not None else None

    def to_dict(self) -> Dict[str, object]:
        return {"ready": self.ready, "artifact": self.artifact, "runtime": self.runtime,
                "relative_error": self.relative_error, "reason": self.reason, "warmup_s": self.warmup_s,
                "check": self.check.to_dict() if self.check is not None else None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "WorkerStatus":
        check = data.get("check")
        return cls(bool(data["ready"]), str(data.get("artifact", "")), str(data.get("runtime", "")),
                   ArtifactCheck.from_dict(check) if isinstance(check, Mapping) else None,
                   str(data.get("reason", "")), float(data.get("warmup_s", 0.0)))


def load_checked(directory: Any, options: ServeOptions) -> Tuple[nn.Module, WorkerStatus]:
    """The artifact to serve, loaded (sha256 checked) and judged on ``check.pt`` with the export's thresholds
    (:func:`~fx_lightning.export.select.selection.check_entry`); raises ExportError when it cannot be served, with the
    reason."""
    root = Path(directory)
    manifest = read_manifest(root)
    options = options.with_batching(manifest)
    name, runtime = artifact_for(manifest, options)
    module = load_artifact(root, manifest, name, verify=True, device="cpu", runtime=runtime)
    entry = manifest.formats[name]
    if manifest.check_file is None:  # an export written before check.pt existed
        return module, WorkerStatus(True, name, runtime, reason="the export has no check.pt: loaded, not checked")
    verify_files(root, dataclasses.replace(manifest, formats={"check": dataclasses.replace(
        entry, files=[manifest.check_file])}), "check")  # its sha256 too: a swapped check.pt proves nothing
    saved = read_check_file(root)
    if saved is None:
        raise ExportError(f"{root / manifest.check_file}: missing (the manifest lists it)")
    check = check_entry(module, manifest, name, saved)
    if not check.passed:
        raise ExportError(f"{root / entry.path}: the {name} artifact failed its self-check on check.pt: "
                          f"{check.reason}")
    signature = manifest.call_signature()
    if not signature.batched:  # no sample axis: each request runs whole, as check.pt did
        return module, WorkerStatus(True, name, runtime, check, warmup_s=warm_up(module, saved.inputs, [1], None))
    axes = signature.input_axes()
    sizes = serving_batch_sizes(entry.batch_sizes, options.max_batch_size or 1)
    if not entry.batch_sizes:  # any size: run only the warmed ones (OpenVINO compiles, and keeps, a few shapes)
        module = BatchPieces({str(size): module for size in sizes}, axes, signature.output_axes(),
                             what=f"{name} artifact", warn=False)
    return module, WorkerStatus(True, name, runtime, check, warmup_s=warm_up(module, saved.inputs, sizes, axes))


def serving_batch_sizes(built: Optional[Sequence[int]], max_batch_size: int) -> List[int]:
    """The batch sizes a worker runs: those an artifact is built for, else the powers of two up to the server's
    ``max_batch_size`` and that size itself (any batch runs as pieces of those, largest first: 13 -> 8 + 4 + 1).
    Few shapes, each warmed once, instead of a compile for every size a batch happens to have."""
    if built:
        return sorted(built)
    sizes = [1 << i for i in range(max_batch_size.bit_length()) if 1 << i <= max_batch_size]
    return sizes + ([max_batch_size] if max_batch_size not in sizes else [])


def warm_up(module: nn.Module, inputs: Sequence[Any], batch_sizes: Iterable[int],
            axes: Optional[Sequence[Optional[int]]]) -> float:
    """Run ``module`` once at each batch size (``inputs`` cut or repeated along the sample ``axes``; None: no sample
    axis, the inputs as they are), so that no request pays a runtime's first run at a new shape (OpenVINO and
    Inductor compile per shape: 0.3 s at resnet18's batch sizes; that was the served p99)."""
    start = time.perf_counter()
    with torch.no_grad():
        for size in batch_sizes:
            module(*(with_rows(inputs, axes, size) if axes is not None else inputs))
    return time.perf_counter() - start


def artifact_for(manifest: Manifest, options: ServeOptions) -> Tuple[str, str]:
    """The format (or variant) and runtime settings to serve: ``options.format``, else the export's selection:
    its max-throughput pick when the batching came from its sweep, else its fastest for the batch size the server
    forms and the traffic batching makes; else the first format available."""
    options = options.with_batching(manifest)
    max_batch = options.max_batch_size or 1
    traffic = "back_to_back" if max_batch > 1 and manifest.call_signature().batched else None
    if options.format is not None:  # with the runtime settings the selection recorded for it
        return options.format, runtime_for(manifest, options.format, max_batch, traffic)
    pick = (selection_for(manifest, traffic=Traffic.back_to_back.value, strategy=Strategy.max_throughput.value)
            if options.batching.startswith(SWEPT) else selection_for(manifest, max_batch, traffic))
    if pick is not None:
        return pick.format, pick.runtime
    if not manifest.formats:
        raise ExportError("the manifest lists no formats")
    if not any(name in manifest.formats for name in FORMATS):
        return next(iter(manifest.formats)), ""
    return preferred_format(manifest), ""


class StatusBoard:
    """Each worker's :class:`WorkerStatus`, written as a file the HTTP process reads (they are separate processes)."""

    def __init__(self, directory: Path, workers: int) -> None:
        self.directory, self.workers = directory, workers
        self.all_ready: Optional[List[WorkerStatus]] = None  # once every worker is ready, no more file reads

    def write(self, worker: str, status: WorkerStatus) -> None:
        path = self.directory / f"worker-{worker}.json"
        path.with_suffix(".tmp").write_text(json.dumps(status.to_dict()), encoding="utf-8")
        os.replace(path.with_suffix(".tmp"), path)

    def read(self) -> Tuple[bool, List[WorkerStatus]]:
        if self.all_ready is not None:
            return True, self.all_ready
        statuses = []
        for path in sorted(self.directory.glob("worker-*.json")):
            try:
                statuses.append(WorkerStatus.from_dict(json.loads(path.read_text(encoding="utf-8"))))
            except (OSError, ValueError, TypeError, KeyError):
                continue  # being replaced: read again next time
        ready = len(statuses) >= self.workers and all(s.ready for s in statuses)
        self.all_ready = statuses if ready else None
        return ready, statuses
