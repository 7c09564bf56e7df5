"""Shared test setup: deterministic seeds and a small, fixed thread count (CI has 2 cores)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

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


# Every test runs on a faked CPU with VNNI and AVX512-BF16, whatever the machine (CI's has been AVX2-only and
# AVX-512 with both): the lossy variants are made everywhere. Tests of the other CPUs set their own
# (tests/test_machine.py writes the file this names).
FAKE_CPUINFO = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
                "model name\t: Faked EPYC with VNNI and BF16\nflags\t\t: avx2 fma avx512f avx512_vnni avx512_bf16\n")


# Set for the whole session, so module- and session-scoped fixtures (exports shared by a module's tests) see it too.
_FAKE_CPUINFO_FILE = Path(tempfile.mkdtemp(prefix="fx_lightning_cpuinfo_")) / "cpuinfo_vnni_bf16"
_FAKE_CPUINFO_FILE.write_text(FAKE_CPUINFO)
os.environ["FX_LIGHTNING_CPUINFO"] = str(_FAKE_CPUINFO_FILE)


@pytest.fixture(autouse=True)
def _fake_cpu(monkeypatch):
    from fx_lightning.common.machine import CPUINFO_ENV

    monkeypatch.setenv(CPUINFO_ENV, str(_FAKE_CPUINFO_FILE))
    yield



def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Under ``-n 2`` (``--dist loadfile``, pyproject's addopts: a module's tests run on one worker, so a module-scoped
    fixture, an export built once or a server started once, is built once rather than once per worker; xdist's
    ``loadgroup`` would do it per module, but with pytest 9 its group never reaches the node id) the modules whose tests
    share such a fixture go first, so that no long module starts last while the other worker idles."""
    def shares_a_fixture(item: pytest.Item) -> bool:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}).values()
        return any(d and d[-1].scope == "module" for d in defs)

    first = {item.module.__name__ for item in items if shares_a_fixture(item)}
    items.sort(key=lambda item: item.module.__name__ not in first)  # stable: the order within each part is kept
