"""The README's main job: train a small CNN on synthetic stripes, fuse it with FXFuseCallback, load it back.

    python examples/train.py            # ~3 epochs on CPU, well under two minutes

Prints the fusion summary (passes, BatchNorms folded, parity figures) and where the fused model went.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from examples.data import StripesDataModule
from examples.models import StripesClassifier
from fx_lightning import FXFuseCallback


def main(argv: Optional[List[str]] = None) -> FXFuseCallback:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--root", default="runs/stripes", help="logs, checkpoints and the fused model go here")
    parser.add_argument("--num-train", type=int, default=2048)
    parser.add_argument("--num-val", type=int, default=512)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights", choices=("last", "best"), default="last")
    args = parser.parse_args(argv)

    pl.seed_everything(args.seed, verbose=False)
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    data = StripesDataModule(num_train=args.num_train, num_val=args.num_val, seed=args.seed)
    model = StripesClassifier(width=args.width)
    fuse_cb = FXFuseCallback(weights=args.weights)  # the one line this project is about
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        default_root_dir=args.root,
        logger=CSVLogger(args.root),
        callbacks=[ModelCheckpoint(monitor="val_acc", mode="max"), fuse_cb],
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=10,
    )
    trainer.fit(model, datamodule=data)

    # FXFuseCallback has printed its summary (rank zero); here is what a user does next.
    if fuse_cb.export_dir is not None:
        from fx_lightning import load_fused

        # What a serving process does: no training code, no Lightning.
        served = load_fused(fuse_cb.export_dir)
        x, y = next(iter(data.val_dataloader()))
        with torch.no_grad():
            features = served(x)
            accuracy = (model.head(features).argmax(-1) == y).float().mean().item()
        print(f"fused backbone reloaded from {fuse_cb.export_dir}: features {tuple(features.shape)}, "
              f"accuracy with the trained head on one validation batch: {accuracy:.3f}")
        print(f"Fused model: {fuse_cb.export_dir}")
    return fuse_cb


if __name__ == "__main__":
    main()
