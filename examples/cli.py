"""LightningCLI entry point; FXFuseCallback is configured in YAML like any other callback.

    python examples/cli.py fit --config configs/cli/train.yaml
    python examples/cli.py fit --config configs/cli/train.yaml --trainer.max_epochs=2

In the YAML: `trainer.callbacks: [{class_path: fx_lightning.FXFuseCallback, init_args: {...}}]`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning.pytorch.cli import LightningCLI

from examples.data import StripesDataModule
from examples.models import StripesClassifier


def main(args: Optional[List[str]] = None, run: bool = True) -> LightningCLI:
    return LightningCLI(
        StripesClassifier,
        StripesDataModule,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
