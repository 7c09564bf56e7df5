"""Hydra version of the main example, configured by ../configs (train.yaml and its groups).

    python examples/hydra_app.py
    python examples/hydra_app.py fx_fuse=strict trainer.max_epochs=2
    python examples/hydra_app.py fx_fuse=no_export callbacks.fx_fuse.parity.max_batches=4

The callback comes from configs/callbacks/fx_fuse.yaml (`_target_: fx_lightning.FXFuseCallback`), the
file a Hydra user drops into their own `callbacks/` group.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, List

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
import lightning.pytorch as pl
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig

from fx_lightning import FXFuseCallback

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


def instantiate_callbacks(cfg: DictConfig) -> List[Any]:
    """Every node of the `callbacks` group that has a `_target_` (the lightning-hydra-template convention)."""
    return [instantiate(node) for node in (cfg or {}).values() if isinstance(node, DictConfig) and "_target_" in node]


def train(cfg: DictConfig) -> FXFuseCallback:
    pl.seed_everything(cfg.seed, verbose=False)
    data = instantiate(cfg.data)
    model = instantiate(cfg.model)
    callbacks = instantiate_callbacks(cfg.get("callbacks"))
    trainer: pl.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=CSVLogger(cfg.trainer.default_root_dir))
    trainer.fit(model, datamodule=data)
    fuse_cb = next(cb for cb in callbacks if isinstance(cb, FXFuseCallback))
    print(f"Fused model: {fuse_cb.export_dir or 'not exported'}")
    return fuse_cb


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
