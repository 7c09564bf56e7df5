"""Shared test setup: deterministic seeds and a small, fixed thread count (CI has 2 cores)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("PYTHONHASHSEED", "0")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(threads, 2))
    yield
    torch.set_num_threads(threads)
