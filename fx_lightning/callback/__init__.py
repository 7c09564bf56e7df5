"""The Lightning callback: hooks (:mod:`.fx_fuse`), checks before training (:mod:`.preflight`), the end of fit
on every rank (:mod:`.ranks`) and what is read from the Trainer (:mod:`.trainer_data`)."""

from fx_lightning.callback.fx_fuse import FXFuseCallback

__all__ = ["FXFuseCallback"]
