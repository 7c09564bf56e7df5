"""FXFuseCallback under DDP (2 CPU ranks, gloo) and the pieces it is built from.

Lightning's DDP launcher re-runs the *script* for rank 1, so each scenario runs ``tests/ddp_scripts/run_ddp.py``
in a subprocess (its own session, under a wall-clock limit: a hang fails the test instead of freezing CI) and
asserts on the JSON each rank writes. The rest are single-process tests of the merge, the refusal of sharded
strategies and the absence of hidden torchmetrics collectives.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch.utils.data import DataLoader

import lightning_helpers as H
from fx_lightning import ConfigError, FXFuseCallback, load_fused
from fx_lightning.export import read_manifest
from fx_lightning.parity.gate import check_parity, judge_parity, measure_parity, merge_parity_states
from fx_lightning.parity.gate import CLASS_WIDTHS_DISAGREE, NO_BATCHES
from fx_lightning.pipeline.driver import BUFFERS_DIFFERED, PARITY_MERGED

SCRIPT = Path(__file__).resolve().parent / "ddp_scripts" / "run_ddp.py"
WALL_LIMIT_S = 180  # a limit, not a timing assertion: a scenario takes ~15 s on 2 cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_scenario(name: str, out: Path) -> Dict[int, Dict[str, Any]]:
    """Run one DDP scenario; return each rank's record. Fails (never hangs) when a rank does not finish."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK", "PL_GLOBAL_SEED")}
    env.update(CUDA_VISIBLE_DEVICES="", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::DeprecationWarning")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), name, str(out)], env=env, cwd=out,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # rank 1 joins this session: one killpg ends both
    try:
        log, _ = proc.communicate(timeout=WALL_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"DDP scenario {name!r} did not finish within {WALL_LIMIT_S} s (a rank hangs):\n{log[-6000:]}")
    records = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("rank_*.json")}
    assert proc.returncode == 0 and set(records) == {0, 1}, f"rc={proc.returncode}, ranks={sorted(records)}\n{log[-6000:]}"
    return records


def _split_writes(writes: List[str]) -> Tuple[List[str], List[str]]:
    """(the preflight's temporary exports, the real ones)."""
    preflight = [w for w in writes if "fx_fused_preflight_" in w]
    return preflight, [w for w in writes if w not in preflight]


def _same_on_both(records: Dict[int, Dict[str, Any]], *keys: str) -> None:
    for key in keys:
        assert records[0][key] == records[1][key], f"{key}: rank 0 {records[0][key]!r} != rank 1 {records[1][key]!r}"


# ------------------------------------------------------------------------------------------ DDP scenarios


@pytest.mark.ddp
def test_ddp_happy_path_every_rank_checks_its_shard_rank_zero_exports(tmp_path: Path) -> None:
    r = run_scenario("happy", tmp_path)
    # sync_batchnorm: Lightning reverted SyncBatchNorm before on_fit_end, and the reverted layers were folded.
    assert r[0]["norm_types"] == r[1]["norm_types"] == ["_BatchNormXd"]
    for rank in (0, 1):
        assert r[rank]["raised"] is None and r[rank]["error"] is None, r[rank]
        assert r[rank]["passed"] is True and r[rank]["batchnorms_folded"] == 2
    # One verdict, from the merged measurements of both shards (2 + 2 batches, 32 distinct samples).
    _same_on_both(r, "parity", "notes", "export_dir", "fused_hash")
    assert r[0]["parity"]["batches"] == 4 and r[0]["parity"]["metrics"]["samples"] == 32
    # Each rank read its own shard: 32 validation samples / 2 ranks / batch 8.
    assert any(n["kind"] == PARITY_MERGED.name and n["facts"]["ranks"] == 2
               and n["facts"]["batches"] == [2, 2] for n in r[0]["notes"]), r[0]["notes"]
    # Only rank 0 wrote (its preflight's temporary export before training, then the export), into the log_dir
    # every rank agreed on; the export is complete and loads.
    preflight, real = _split_writes(r[0]["export_writes"])
    assert len(preflight) == 1 and len(real) == 1 and r[1]["export_writes"] == []
    export_dir = Path(r[0]["export_dir"])
    assert export_dir == Path(r[0]["log_dir"]) / "fx_fused" and export_dir.is_dir()
    assert read_manifest(export_dir).provenance.world_size == 2
    x = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        assert load_fused(export_dir)(x).shape == (3, 8)
    metrics_rows = (Path(r[0]["log_dir"]) / "metrics.csv").read_text().splitlines()
    header = metrics_rows[0].split(",")
    passed_col = header.index("fx_fuse/parity_passed")
    assert [row.split(",")[passed_col] for row in metrics_rows[1:] if row.split(",")[passed_col]] == ["1.0"]


@pytest.mark.ddp
def test_ddp_user_pass_raising_on_rank_1_only_raises_on_every_rank(tmp_path: Path) -> None:
    r = run_scenario("pass_rank1", tmp_path)
    for rank in (0, 1):
        raised = r[rank]["raised"]
        assert raised is not None and raised["type"] == "PassError", r[rank]
        assert "on rank 1 of 2" in raised["message"] and "boom from a user pass on rank 1" in raised["message"]
        assert "checkpoints are intact" in raised["message"]
        assert r[rank]["export_dir"] is None and r[rank]["export_writes"] == []
    assert r[0]["raised"]["message"] == r[1]["raised"]["message"]  # the same error text on both ranks
    assert not list(tmp_path.rglob("fx_fused")) and not list(tmp_path.rglob(".fx_fused*"))


@pytest.mark.ddp
def test_ddp_preflight_failure_on_rank_1_stops_every_rank_before_training(tmp_path: Path) -> None:
    r = run_scenario("preflight_rank1", tmp_path)
    for rank in (0, 1):
        raised = r[rank]["raised"]
        assert raised is not None and raised["type"] == "PassError", r[rank]
        assert "on rank 1 of 2" in raised["message"] and "boom from a user pass on rank 1" in raised["message"]
        assert "stage 'passes'" in raised["message"] and "before the first optimizer step" in raised["message"]
        assert r[rank]["global_step"] == 0 and r[rank]["training_steps"] <= 1  # its forward observed, no step
        # Rank 0's own preflight got as far as its temporary export; nothing real was written anywhere.
        assert r[rank]["export_dir"] is None and _split_writes(r[rank]["export_writes"])[1] == []
    assert r[0]["raised"]["message"] == r[1]["raised"]["message"]  # the same error text on both ranks
    assert not list(tmp_path.rglob("fx_fused")) and not list(tmp_path.rglob(".fx_fused*"))


@pytest.mark.ddp
def test_ddp_export_failure_on_rank_0_warns_on_every_rank_leaves_nothing(tmp_path: Path) -> None:
    r = run_scenario("export_rank0", tmp_path)
    for rank in (0, 1):
        assert r[rank]["raised"] is None, r[rank]  # on_error=warn: fit returned on both ranks
        assert r[rank]["error_type"] == "ExportError" and "No space left on device" in r[rank]["error"]
        assert len(r[rank]["warnings"]) == 1 and "on rank 0 of 2" in r[rank]["warnings"][0]
        assert r[rank]["passed"] is True and r[rank]["export_dir"] is None
    _same_on_both(r, "error", "warnings", "parity", "notes")
    assert len(r[0]["export_writes"]) == 1 and r[1]["export_writes"] == []
    # The half-written staging directory was removed: nothing partial on disk.
    assert not list(tmp_path.rglob("fx_fused")) and not list(tmp_path.rglob(".fx_fused*"))
    # No sync_batchnorm and no validation after the last step: the ranks' BatchNorm statistics differ, yet both
    # ranks fused (and checked) rank 0's weights, the ones that would have been exported.
    assert r[0]["norm_types"] == ["BatchNorm2d"]
    assert r[0]["buffers_hash"] != r[1]["buffers_hash"]
    _same_on_both(r, "fused_hash")
    assert any(n["kind"] == BUFFERS_DIFFERED.name for n in r[0]["notes"]), r[0]["notes"]
    assert r[0]["parity"]["source"] == "train" and r[0]["parity"]["batches"] == 8


# ------------------------------------------------------------------------------- sharded strategies


def _sharded_strategies() -> Dict[str, Any]:
    from lightning.pytorch import strategies

    out: Dict[str, Any] = {"fsdp": strategies.FSDPStrategy()}
    # DeepSpeed is not installed here; its class (a DDPStrategy subclass!) is what the check is against.
    out["deepspeed"] = strategies.DeepSpeedStrategy.__new__(strategies.DeepSpeedStrategy)
    out["model_parallel"] = strategies.ModelParallelStrategy()
    return out


@pytest.mark.parametrize("name", ["fsdp", "deepspeed", "model_parallel"])
def test_sharded_strategies_are_refused_in_setup(name: str) -> None:
    # FSDP refuses accelerator="cpu" in the Trainer itself, so setup gets a stand-in trainer holding a real
    # Lightning strategy object.
    trainer = SimpleNamespace(strategy=_sharded_strategies()[name])
    model = H.LitClassifier()
    cb = FXFuseCallback()
    with pytest.raises(ConfigError) as info:
        cb.setup(trainer, model, "fit")  # type: ignore[arg-type]
    message = str(info.value)
    assert type(trainer.strategy).__name__ in message and "shards the weights" in message
    assert "before the first training step" in message and "strategy='ddp'" in message


def test_sharded_strategy_with_on_error_warn_skips_fusion() -> None:
    trainer = SimpleNamespace(strategy=_sharded_strategies()["fsdp"])
    cb = FXFuseCallback(on_error="warn")
    with pytest.warns(UserWarning, match="FSDPStrategy shards the weights"):
        cb.setup(trainer, H.LitClassifier(), "fit")  # type: ignore[arg-type]
    assert cb.skipped is not None and "unsupported strategy" in cb.skipped


def test_ddp_family_and_single_device_strategies_are_accepted() -> None:
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    from fx_lightning.callback.ranks import unsupported_strategy as _unsupported_strategy

    assert _unsupported_strategy(DDPStrategy()) is None
    assert _unsupported_strategy(DDPStrategy(start_method="spawn")) is None
    assert _unsupported_strategy(SingleDeviceStrategy(device=torch.device("cpu"))) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP needs a GPU in Lightning")
def test_fsdp_trainer_fit_is_refused_before_training(tmp_path: Path) -> None:
    model = H.LitClassifier()
    trainer = H.make_trainer(tmp_path, [FXFuseCallback()], accelerator="gpu", devices=1, strategy="fsdp")
    with pytest.raises(ConfigError, match="FSDPStrategy shards the weights"):
        trainer.fit(model, *H.loaders())
    assert model.training_steps == 0


# ------------------------------------------------------------------------------------ merging parity


def _batches(n: int, seed: int = 1) -> list:
    return list(DataLoader(H.tiny_dataset(n, seed), batch_size=8))


def test_merged_parity_of_two_shards_equals_one_pass_over_all_the_data() -> None:
    model = H.randomize_batchnorms(H.LitClassifier()).eval()
    noisy = H.LitClassifier(backbone=H.NoisyBackbone()).eval()  # non-zero errors, so max/sum/min matter
    noisy.load_state_dict(model.state_dict())
    data = _batches(32)
    torch.manual_seed(0)
    whole = check_parity(model, noisy, data, {"max_batches": 8})
    torch.manual_seed(0)
    shards = [measure_parity(model, noisy, data[:1], {"max_batches": 8}),
              measure_parity(model, noisy, data[1:], {"max_batches": 8})]
    merged = judge_parity(merge_parity_states(shards), {"max_batches": 8})
    assert merged.batches == whole.batches == 4
    assert merged.passed == whole.passed is False
    assert merged.metrics.keys() == whole.metrics.keys()
    for key, value in whole.metrics.items():
        assert merged.metrics[key] == pytest.approx(value, rel=1e-12), key
    # Each output's samples' errors too: the ranks' samples gathered, the same distribution as one pass.
    assert [(o.name, o.samples, o.counts, o.zeros) for o in merged.outputs] == \
        [(o.name, o.samples, o.counts, o.zeros) for o in whole.outputs] and whole.outputs
    for m, w in zip(merged.outputs, whole.outputs):
        assert m.quantiles == pytest.approx(w.quantiles, rel=1e-12) and m.relative_max_error > 0


def test_a_rank_with_no_batches_merges_without_changing_the_verdict() -> None:
    model = H.randomize_batchnorms(H.LitClassifier()).eval()
    data = _batches(16)
    alone = check_parity(model, model, data)
    empty = measure_parity(model, model, [])
    merged = judge_parity(merge_parity_states([empty, measure_parity(model, model, data)]))
    assert merged.passed and merged.batches == alone.batches == 2
    assert merged.metrics == alone.metrics
    # Every rank empty: a failure, not a silent pass.
    nothing = judge_parity(merge_parity_states([empty, empty]))
    assert not nothing.passed and nothing.failures[0].kind == NO_BATCHES


def test_ranks_with_different_class_counts_fail_instead_of_mixing_accuracies() -> None:
    model = H.LitClassifier().eval()
    a = measure_parity(model, model, _batches(8))
    b = measure_parity(model, model, _batches(8))
    b.num_classes = 5
    report = judge_parity(merge_parity_states([a, b]))
    assert not report.passed and any(f.kind == CLASS_WIDTHS_DISAGREE for f in report.failures), report.failures


def test_parity_never_makes_a_torchmetrics_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under DDP a rank computing alone (or in a different order) would wait forever in torchmetrics' sync.
    import torchmetrics.metric as tm

    def no_collectives(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torchmetrics tried to sync metric states across processes")

    monkeypatch.setattr(tm, "jit_distributed_available", lambda: True)
    monkeypatch.setattr(tm, "gather_all_tensors", no_collectives)
    model = H.randomize_batchnorms(H.LitClassifier()).eval()
    report = check_parity(model.backbone, model.backbone, _batches(16), whole_reference=model,
                          whole_candidate=model)
    assert report.passed and report.batches == 2
