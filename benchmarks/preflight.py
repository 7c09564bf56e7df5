"""What the preflight costs before training, against what it protects: one training step and the work at
the end of fit. Each row is one real ``Trainer.fit`` (one epoch) with FXFuseCallback, on CPU.

    python benchmarks/preflight.py                    # the README table: the main job's model, resnet50 at 224x224
    python benchmarks/preflight.py --models stripes   # quick look

Columns: ``preflight`` (the callback's own measurement, ``callback.preflight.seconds``) for ``full`` and
``capture``; a training step (median over the epoch's steps); the end-of-fit work (fuse + parity + export,
from on_fit_end's start to its end); and the preflight as a fraction of one training epoch of the row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fx_lightning import FXFuseCallback
from machine import cpu_description  # benchmarks/machine.py

RESULTS = Path(__file__).resolve().parent / "results"


class Timer(pl.Callback):
    """Step times and the time on_fit_end took for the callbacks after it (FXFuseCallback)."""

    def __init__(self) -> None:
        self.steps: List[float] = []
        self._start = 0.0
        self.fit_end_started = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.steps.append(time.perf_counter() - self._start)

    def on_fit_end(self, *args: Any) -> None:
        self.fit_end_started = time.perf_counter()


class Classifier(pl.LightningModule):
    def __init__(self, backbone: nn.Module, features: int, classes: int) -> None:
        super().__init__()
        self.backbone, self.head = backbone, nn.Linear(features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def build(name: str) -> Dict[str, Any]:
    if name == "stripes":  # the README's main job (examples/train.py): its model, data and batch size
        from examples.data import StripesDataModule
        from examples.models import StripesClassifier

        data = StripesDataModule(num_train=2048, num_val=512, seed=0)
        data.setup("fit")
        return {"model": StripesClassifier(width=16), "train": data.train_dataloader(), "val": data.val_dataloader(),
                "input": "batch 64, 1x32x32"}
    import torchvision

    backbone = torchvision.models.get_model(name, weights=None)
    features = backbone.fc.in_features
    backbone.fc = nn.Identity()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, 224, 224, generator=g), torch.randint(0, 10, (64,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    return {"model": Classifier(backbone, features, 10), "train": loader, "val": loader, "input": "batch 16, 3x224x224"}


def run(name: str, preflight: str, root: Path) -> Dict[str, Any]:
    torch.manual_seed(0)
    spec = build(name)
    timer, fuse_cb = Timer(), FXFuseCallback(preflight=preflight, parity={"max_batches": 2},
                                            export={"formats": ["graph_module", "pt2"]})
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
                         callbacks=[timer, fuse_cb], num_sanity_val_steps=0)
    fit_start = time.perf_counter()
    trainer.fit(spec["model"], spec["train"], spec["val"])
    end = time.perf_counter()
    report = fuse_cb.preflight
    return {
        "model": name, "input": spec["input"], "preflight_mode": preflight,
        "preflight_s": report.seconds if report is not None else 0.0,
        "stages": report.stages if report is not None else [],
        "train_step_s": statistics.median(timer.steps), "epoch_steps": len(timer.steps),
        "end_of_fit_s": end - timer.fit_end_started, "fit_s": end - fit_start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["stripes", "resnet50"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--root", default="runs/preflight_bench")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [run(m, mode, Path(args.root)) for m in args.models for mode in ("full", "capture")]
    table = Table(title=f"preflight cost, torch {torch.__version__}, {args.threads} threads, {cpu_description()}")
    for col in ("model", "input", "preflight", "seconds", "one training step s", "end of fit s", "x epoch"):
        table.add_column(col)
    for r in rows:
        epoch = r["train_step_s"] * r["epoch_steps"]
        table.add_row(r["model"], r["input"], r["preflight_mode"], f"{r['preflight_s']:.2f}",
                      f"{r['train_step_s']:.3f}", f"{r['end_of_fit_s']:.2f}", f"{r['preflight_s'] / epoch:.3f}")
    Console(width=140).print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "preflight.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / "preflight.md").write_text(markdown(rows, args.threads))


def markdown(rows: List[Dict[str, Any]], threads: int) -> str:
    lines = [
        "| model | input | preflight | preflight s | one training step s | end of fit s | preflight / one epoch |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        epoch = r["train_step_s"] * r["epoch_steps"]
        lines.append(f"| {r['model']} | {r['input']} | {r['preflight_mode']} | {r['preflight_s']:.2f} | "
                     f"{r['train_step_s']:.3f} | {r['end_of_fit_s']:.2f} | {r['preflight_s'] / epoch:.2f} |")
    lines.append(f"\ntorch {torch.__version__}, {threads} threads, {cpu_description()}, CPU only; "
                 "end of fit = fuse + parity (2 batches) + export (graph_module, pt2).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
