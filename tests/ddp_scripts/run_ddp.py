"""One DDP scenario for tests/test_ddp.py: ``python run_ddp.py SCENARIO OUT_DIR``.

Lightning's DDP launcher re-runs this script for rank 1 (so it cannot run inside pytest). Both ranks train a
tiny model for one epoch on CPU (gloo) with FXFuseCallback, then write ``OUT_DIR/rank_<r>.json`` with what the
callback saw and did; the test asserts on those files. Every rank exits 0 after writing its file (a non-zero
child would make Lightning's process observer kill rank 0 before it writes), and rank 0 waits for its child.

Scenarios:
  happy          sync_batchnorm, validation data: both ranks pass, rank 0 exports.
  pass_rank1     a user pass raises on rank 1 only (on_error=raise): both ranks raise, nothing exported.
  export_rank0   the export write fails on rank 0 only (on_error=warn), no sync_batchnorm, no validation
                 (parity on training shards, BatchNorm statistics differ per rank): both ranks warn and return.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # ddp_passes, lightning_helpers

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

import dataclasses  # noqa: E402

from fx_lightning.export import FORMATS  # noqa: E402
import lightning_helpers as H  # noqa: E402
from fx_lightning import FXFuseCallback  # noqa: E402

SCENARIOS: Dict[str, Dict[str, Any]] = {
    "happy": dict(sync_batchnorm=True, val=True, fuse={}),
    "pass_rank1": dict(sync_batchnorm=True, val=True,
                       fuse={"passes": {"extra": ["ddp_passes:raise_on_rank_1"]}, "preflight": "off"}),
    "export_rank0": dict(sync_batchnorm=False, val=False, fuse={"on_error": "warn", "preflight": "off"},
                         break_export_on_rank0=True),
    # The default preflight: the pass raising on rank 1 stops both ranks before their first training step.
    "preflight_rank1": dict(sync_batchnorm=True, val=True, fuse={"passes": {"extra": ["ddp_passes:raise_on_rank_1"]}}),
}


def _hash_tensors(tensors: List[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Probe(pl.Callback):
    """Placed before FXFuseCallback: what on_fit_end receives (module types, this rank's BatchNorm buffers)."""

    def __init__(self) -> None:
        self.seen: Dict[str, Any] = {}

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen = {
            "norm_types": sorted({type(m).__name__ for m in pl_module.modules() if "Norm" in type(m).__name__}),
            "buffers_hash": _hash_tensors([b for _, b in sorted(pl_module.named_buffers())]),
        }


def _allow_sync_batchnorm_on_cpu() -> None:
    """torch refuses SyncBatchNorm on CPU (in DDP's constructor and in its forward). Run its forward as a
    plain BatchNorm here, so that Lightning's conversions happen exactly as on GPUs: BatchNorm -> SyncBatchNorm
    in setup, SyncBatchNorm -> _BatchNormXd in teardown, which is what on_fit_end sees."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.parallel import DistributedDataParallel

    torch.nn.SyncBatchNorm.forward = _BatchNorm.forward  # type: ignore[method-assign]
    DistributedDataParallel._passing_sync_batchnorm_handle = lambda self, module: None  # type: ignore[method-assign]


def main(scenario: str, out: Path) -> None:
    spec = SCENARIOS[scenario]
    if spec["sync_batchnorm"]:
        _allow_sync_batchnorm_on_cpu()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    writes: List[str] = []
    real_write = FORMATS["graph_module"].write

    def counting(root: Path, ctx: Any) -> Dict[str, Any]:  # records which rank actually writes an export
        writes.append(str(root))
        return real_write(root, ctx)

    FORMATS["graph_module"] = dataclasses.replace(FORMATS["graph_module"], write=counting)
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # one node: local rank is the global rank
    if spec.get("break_export_on_rank0") and rank == 0:
        def failing_writer(root: Path, ctx: Any) -> Dict[str, Any]:
            writes.append(str(root))
            (root / "model.pt").write_bytes(b"partial")  # half-written, then the disk is full
            raise OSError(28, "No space left on device (simulated)")

        FORMATS["graph_module"] = dataclasses.replace(FORMATS["graph_module"], write=failing_writer)

    probe = Probe()
    fuse_cb = FXFuseCallback(export={"formats": ["graph_module"]}, **spec["fuse"])
    train, val = H.loaders(batch_size=8, n_train=64, n_val=32)
    trainer = H.make_trainer(
        out / "run",
        [probe, fuse_cb],
        strategy=DDPStrategy(timeout=timedelta(seconds=60)),  # a lost rank fails a collective, not the CI job
        devices=2,
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=2 if spec["val"] else 0,
        sync_batchnorm=spec["sync_batchnorm"],
    )
    model = H.LitClassifier()
    raised = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, train, val if spec["val"] else None)
        except Exception as exc:  # noqa: BLE001 - the outcome is the test's to judge
            raised = {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
    rank = trainer.global_rank
    result = fuse_cb.result
    report = fuse_cb.parity_report
    record = {
        "rank": rank,
        "world_size": trainer.world_size,
        "raised": raised,
        "error_type": type(fuse_cb.error).__name__ if fuse_cb.error is not None else None,
        "error": str(fuse_cb.error) if fuse_cb.error is not None else None,
        "warnings": [str(w.message) for w in caught if "FXFuseCallback" in str(w.message)],
        "skipped": fuse_cb.skipped,
        "passed": report.passed if report is not None else None,
        "parity": report.to_dict() if report is not None else None,
        # Each note as its JSON view: {"kind", "facts", "text"}.
        "notes": [n.to_dict() for n in fuse_cb.outcome.notes] if fuse_cb.outcome is not None else [],
        "export_dir": str(fuse_cb.export_dir) if fuse_cb.export_dir is not None else None,
        "export_writes": writes,
        "fused_hash": _hash_tensors(list(result.graph_module.state_dict().values())) if result is not None else None,
        "batchnorms_folded": result.report.batchnorms_folded if result is not None else None,
        "log_dir": trainer.log_dir if raised is None else None,
        "global_step": trainer.global_step,
        "training_steps": model.training_steps,
        **probe.seen,
    }
    (out / f"rank_{rank}.json").write_text(json.dumps(record, indent=1))
    if rank == 0:
        launcher = trainer.strategy.launcher
        for proc in getattr(launcher, "procs", []):
            proc.wait(timeout=120)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]).resolve())
