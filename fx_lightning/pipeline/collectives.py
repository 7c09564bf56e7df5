"""The collective calls the driver makes between processes, as a small object: a no-op in one process
(:data:`LOCAL`); under DDP the callback plugs in the strategy's own (``fx_lightning.callback.ranks``).

Every rank makes the same calls in the same order whatever happens to it locally, so no rank can wait forever
for one that took another path (see :func:`fx_lightning.pipeline.driver.run_pipeline`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Protocol, TypeVar

__all__ = ["Collectives", "LocalCollectives", "LOCAL"]

T = TypeVar("T")


class Collectives(Protocol):
    """``rank`` of ``world_size`` processes; ``broadcast`` returns rank ``src``'s object on every rank;
    ``all_gather`` every rank's object, in rank order, on every rank."""

    rank: int
    world_size: int

    def broadcast(self, obj: T, src: int = 0) -> T: ...

    def all_gather(self, obj: T) -> List[T]: ...


@dataclass(frozen=True)
class LocalCollectives:
    """One process: every collective returns what it is given."""

    rank: int = 0
    world_size: int = 1

    def broadcast(self, obj: T, src: int = 0) -> T:
        return obj

    def all_gather(self, obj: T) -> List[T]:
        return [obj]


LOCAL = LocalCollectives()
