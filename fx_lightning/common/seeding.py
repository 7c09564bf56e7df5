"""Python's and numpy's random streams seeded for one run of a model, as they were after: a forward that draws with
``random.random()`` (denoising-diffusion-pytorch's self-conditioning) then draws alike run after run, as torch's
stream does under :func:`fx_lightning.common.calls.run_seeded`."""

from __future__ import annotations

import contextlib
import random
import sys
from typing import Any, Iterator

__all__ = ["python_random_seeded"]


@contextlib.contextmanager
def python_random_seeded(seed: int) -> Iterator[None]:
    """Python's stream (and numpy's, where numpy is imported) seeded with ``seed`` inside the block, restored after."""
    numpy: Any = sys.modules.get("numpy")
    state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)
