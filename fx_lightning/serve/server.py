"""``fx-lightning serve DIR``: an HTTP server for a verified export, on Lightning's LitServe.

One LitServe worker process (or ``workers``) loads the artifact the export selected for the batch size the server
forms (or ``format``), checks each file's sha256 and runs it on ``check.pt`` against the saved fp64 outputs before
it reports ready. Requests are decoded and checked against the input contract in the HTTP process
(:mod:`fx_lightning.serve.contract`), so a bad request gets its 4xx there and never reaches a batch of good ones;
the worker batches what passed (LitServe's dynamic batching), runs the artifact and splits the outputs back.

Endpoints: ``POST /predict``, ``GET /health`` (503 with the reason until the artifact is loaded and has passed its
self-check), ``GET /info`` (the manifest summary and the contract; LitServe's own endpoint), and the Open Inference
Protocol (KServe v2, as Triton speaks it): ``GET /v2``, ``/v2/health/live``, ``/v2/health/ready``,
``/v2/models/{name}[/versions/1]`` with ``/ready``, ``/config``, ``/stats`` and ``POST .../infer`` (JSON and the
binary tensor extension; :mod:`fx_lightning.serve.oip`). The model's name is the export directory's name unless
``model_name`` says otherwise: the name ``fx-lightning triton`` gives the repository's model of the same artifact.
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Union

from fx_lightning.common.imports import missing_modules
from fx_lightning.errors import ExportError
from fx_lightning.export.manifest import Manifest, read_manifest
from fx_lightning.serve.artifact import ServeOptions, StatusBoard, artifact_for
from fx_lightning.serve.contract import Contract
from fx_lightning.serve.triton_config import TritonModel, contract_model, default_model_name

__all__ = ["ServeOptions", "build_server", "serve", "info_summary", "served_model", "stop_on_sigterm"]

INSTALL_HINT = "pip install 'fx-lightning[serve]'"


def info_summary(directory: Any, manifest: Manifest, contract: Contract, options: ServeOptions) -> Dict[str, object]:
    """What ``/info`` says about the model: the artifact served, the formats, the parity verdict, the contract
    and the versions."""
    name, runtime = artifact_for(manifest, options)
    entry = manifest.formats.get(name)
    return {
        "export": str(Path(directory).resolve()),
        "artifact": {"name": name, "runtime": runtime, "path": entry.path if entry else None,
                     "batch_sizes": entry.batch_sizes if entry else None,
                     "lossy": bool(entry and entry.variant)},
        "formats": sorted(manifest.formats),
        "selected": dataclasses.asdict(manifest.selected) if manifest.selected else None,
        "parity": {"passed": manifest.parity.passed, "metrics": manifest.parity.metrics}
        if manifest.parity is not None else None,
        "contract": contract.to_dict(),
        "versions": manifest.versions,
        "options": dataclasses.asdict(options),
    }


def served_model(directory: Any, contract: Contract, options: ServeOptions, artifact: str) -> TritonModel:
    """The model as the Open Inference Protocol states it (``/v2/models/{name}/config``): named after the export
    directory (or ``model_name``); it batches where the export has a sample axis, up to ``max_request_batch``
    samples a request (Triton's ``max_batch_size``: what one request may hold), the server joining requests for up
    to ``batch_timeout``. ``artifact``: the entry the workers serve."""
    name = options.model_name or default_model_name(Path(directory))
    return contract_model(name, contract, artifact, "fx-lightning", Path(directory),
                          max_batch_size=options.max_request_batch,
                          dynamic_batching=options.max_batch_size > 1,
                          max_queue_delay_us=int(options.batch_timeout * 1e6))


def build_server(directory: Any, options: Optional[ServeOptions] = None) -> Any:
    """A ``litserve.LitServer`` for the export in ``directory`` (call ``.run(host=, port=)`` on it). Raises
    ConfigError for bad options and ExportError for an export that cannot be served (checked here, before any
    process starts: the manifest, the contract and the artifact's presence; its sha256 and self-check run in the
    worker and show in ``/health``)."""
    options = options or ServeOptions()
    options.check()
    if missing_modules(("litserve",)):
        raise ExportError(f"fx-lightning serve needs litserve: {INSTALL_HINT}.")
    root = Path(directory).resolve()
    manifest = read_manifest(root)
    options = options.with_batching(manifest)
    name, _ = artifact_for(manifest, options)
    if name not in manifest.formats:
        raise ExportError(f"{root}: format {name!r} was not exported; available: {', '.join(manifest.formats)}.")
    try:
        contract = Contract.of(manifest, max_request_batch=options.max_request_batch,
                               max_body_bytes=options.max_body_bytes)
    except ValueError as exc:
        raise ExportError(f"{root}: cannot be served: {exc}.") from None
    try:
        model: Union[TritonModel, str] = served_model(root, contract, options, name)
    except ValueError as exc:  # an output the protocol has no datatype for: /predict serves, /v2 says why not
        model = f"the Open Inference Protocol cannot state this model: {exc}"
    if not contract.batched:  # no sample axis to batch requests along: each runs whole, alone
        options = dataclasses.replace(options, max_batch_size=1)
    board = StatusBoard(Path(tempfile.mkdtemp(prefix="fxl-serve-")), options.workers)
    from fx_lightning.serve.app import make_server  # imports litserve

    server = make_server(root, options, contract, board, info_summary(root, manifest, contract, options),
                         model, f"fx-lightning:{name}")
    server.fxl_status_dir = board.directory  # the workers' status files: serve() removes them at exit
    return server


def serve(directory: Any, options: Optional[ServeOptions] = None, *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "warning") -> None:
    """Build the server and run it until interrupted (Ctrl+C or SIGTERM: LitServe stops its HTTP and worker
    processes; without the handler a SIGTERM would leave them running)."""
    server = build_server(directory, options)
    stop_on_sigterm()
    try:
        server.run(host=host, port=port, generate_client_file=False, log_level=log_level, num_api_servers=1)
    finally:
        shutil.rmtree(server.fxl_status_dir, ignore_errors=True)


def stop_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread, which LitServe turns into a graceful shutdown."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
