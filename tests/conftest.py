"""Shared test setup: deterministic seeds and a small, fixed thread count (CI has 2 cores)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("PYTHONHASHSEED", "0")

try:  # CI explores a fixed set of examples so a red run can be reproduced; locally, new ones each run.
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
    settings.register_profile("dev", deadline=None)
    settings.load_profile("ci" if os.environ.get("CI") else "dev")
except ImportError:  # hypothesis is a dev extra
    pass


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(threads, 2))
    yield
    torch.set_num_threads(threads)
