"""User passes for the DDP scenarios, named by import path ("ddp_passes:...") in the callback's config."""

from __future__ import annotations

import torch.distributed as dist
import torch.fx as fx


def raise_on_rank_1(gm: fx.GraphModule, options: dict, ctx: object) -> None:
    """Raises on rank 1 only: a failure the other ranks cannot see unless the callback tells them."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() == 1:
        raise ValueError("boom from a user pass on rank 1")
