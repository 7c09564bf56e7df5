"""Branches on tensor values in the model's own forward (fair-esm's ESM2: ``if not padding_mask.any(): padding_mask =
None``): torch.export captures the way the example takes, and each branch is then decided on the observed calls
(signature/value_guards.py): needless where the graph computes the other way's calls as the model does, kept as a
guard program every artifact runs first where no call took the other way, refused where the calls take both ways and
the graph differs."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import lightning_helpers as H
from fx_lightning import ExportError, FXFuseCallback, load_fused
from fx_lightning.errors import ModelError

PAD = 0
FORMATS = ["graph_module", "pt2", "onnx"]


class Tokens(nn.Module):
    """A token model branching on whether the batch holds padding at all, as ESM2 does in its forward."""

    def __init__(self, vocab: int = 12, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width, padding_idx=PAD)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> Dict[str, torch.Tensor]:
        padding_mask = tokens.eq(PAD)
        if not padding_mask.any():
            padding_mask = None
        x = self.emb(tokens)
        if padding_mask is not None:
            x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))
        x = x + self.attn(x, x, x, key_padding_mask=padding_mask, need_weights=False)[0]
        return {"logits": self.out(self.norm(x))}


class TokenLit(pl.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, tokens: torch.Tensor, index: int) -> torch.Tensor:
        return F.cross_entropy(self.model(tokens)["logits"].flatten(0, 1), tokens.flatten())

    def validation_step(self, tokens: torch.Tensor, index: int) -> None:
        self.log("val_loss", F.cross_entropy(self.model(tokens)["logits"].flatten(0, 1), tokens.flatten()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), 1e-3)


def token_batches(count: int, seed: int, padded: bool, rows: int = 4, lengths: Tuple[int, int] = (6, 14)
                  ) -> List[torch.Tensor]:
    """Batches of tokens of random lengths; with ``padded``, every other batch ends its first row in padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        length = int(torch.randint(*lengths, (1,), generator=g))
        tokens = torch.randint(1, 12, (rows, length), generator=g)
        if padded and i % 2 == 0:
            tokens[0, length - 2:] = PAD
        out.append(tokens)
    return out


def _fit(tmp_path: Path, padded: bool, model: nn.Module = None, **callback: Any) -> Tuple[TokenLit, FXFuseCallback]:
    torch.manual_seed(0)
    lit = TokenLit(model if model is not None else Tokens())
    cb = FXFuseCallback(export={"formats": FORMATS}, **callback)
    trainer = pl.Trainer(max_epochs=1, default_root_dir=tmp_path, callbacks=[cb], enable_progress_bar=False,
                         logger=False, enable_checkpointing=False, enable_model_summary=False,
                         num_sanity_val_steps=2)
    trainer.fit(lit, DataLoader(token_batches(6, 0, padded), batch_size=None),
                DataLoader(token_batches(4, 1, padded), batch_size=None))
    return lit, cb


def _held_out(padded: bool) -> List[torch.Tensor]:
    """Calls never observed: batch 1 and 7, lengths outside the training range."""
    calls = [torch.randint(1, 12, (1, 5)), torch.randint(1, 12, (7, 17))]
    if padded:
        for t in calls:
            t[-1, -2:] = PAD
    return calls


def _assert_right(fused: nn.Module, reference: nn.Module, tokens: torch.Tensor) -> None:
    with torch.no_grad():
        got, want = fused(tokens), reference(tokens)
    assert type(got) is dict and list(got) == ["logits"]
    assert got["logits"].shape == want["logits"].shape and got["logits"].dtype == torch.float32
    assert H.rel_err(got["logits"], want["logits"]) < 1e-5


def _fp64(lit: TokenLit) -> nn.Module:
    return H.fp64_copy(lit.model)


def _signature(export_dir: Path) -> Dict[str, Any]:
    return json.loads((Path(export_dir) / "manifest.json").read_text())["signature"]


def test_a_branch_on_values_that_the_calls_take_both_ways_alike_serves_both_ways(tmp_path: Path) -> None:
    """Observed calls with and without padding: the graph captured without padding in view gives the model's
    outputs on the padded calls too (masking with a mask of no true entry is not masking), so the assertion is
    needless and every format serves both ways at sizes never trained on."""
    lit, cb = _fit(tmp_path, padded=True)
    reference = _fp64(lit)
    assert any(n.kind.name == "value_branches_proven" for n in cb.result.report.notes)
    assert "value_guards" not in _signature(cb.export_dir)
    assert not (Path(cb.export_dir) / "value_guards.pt2").exists()
    for fmt in FORMATS:
        fused = load_fused(cb.export_dir, format=fmt)
        for tokens in _held_out(padded=True) + _held_out(padded=False):
            _assert_right(fused, reference, tokens)


def test_a_branch_on_values_every_call_took_one_way_refuses_the_other_by_name_in_every_artifact(tmp_path: Path
                                                                                                 ) -> None:
    """No observed call had padding: the artifacts compute the unpadded way only, and a padded call is refused by
    name by every format (the guard program runs before ONNX Runtime, which has no assertions), by the fused model
    the callback holds, and by the Triton repository. The advice (train or validate on calls taking the other way
    too) is the case above, which then serves both ways."""
    lit, cb = _fit(tmp_path, padded=False)
    reference = _fp64(lit)
    signature = _signature(cb.export_dir)
    source, first = inspect.getsourcelines(Tokens.forward)
    line = first + next(i for i, text in enumerate(source) if "if not padding_mask.any()" in text)
    assert signature["value_guards"] == [f"test_value_branches.py:{line}: if not padding_mask.any():"]
    assert "value_guards.pt2" in json.loads((Path(cb.export_dir) / "manifest.json").read_text())["files"]
    fused_models = [load_fused(cb.export_dir, format=fmt) for fmt in FORMATS] + [cb.result.module]
    for fused in fused_models:
        for tokens in _held_out(padded=False):
            _assert_right(fused, reference, tokens)
        for tokens in _held_out(padded=True):
            with pytest.raises(ExportError, match="if not padding_mask.any()") as refused:
                fused(tokens)
            assert "Train or validate on calls that take it too" in str(refused.value)
    from fx_lightning.serve.triton import write_triton_repository

    with pytest.raises(ExportError, match="branch on tensor values"):
        write_triton_repository(cb.export_dir, tmp_path / "triton", formats=["onnx"])


class WeightGated(Tokens):
    """A branch on a value the weights compute: which way a call takes may change with training."""

    def forward(self, tokens: torch.Tensor) -> Dict[str, torch.Tensor]:
        out = super().forward(tokens)
        if out["logits"][0, 0, 0] > 0:
            return {"logits": out["logits"] * 2}
        return out


def test_a_branch_on_values_the_weights_compute_does_not_stop_training(tmp_path: Path) -> None:
    """Calls taking both ways of a branch computed from the weights at random initialisation prove nothing about the
    trained weights: the preflight does not stop training; the end of fit decides (here the trained weights still
    take both ways, and the refusal names the line)."""
    model = WeightGated()
    with torch.no_grad():
        ways = {bool(model(t)["logits"][0, 0, 0] > 0) for t in token_batches(4, 1, False)}
    assert ways == {True, False}
    lit = TokenLit(model)
    trainer = pl.Trainer(max_epochs=1, default_root_dir=tmp_path, callbacks=[FXFuseCallback()], logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, num_sanity_val_steps=2)
    with pytest.raises(ModelError, match="no one graph answers both ways"):  # the end of fit decides: both ways still
        trainer.fit(lit, DataLoader(token_batches(6, 0, False), batch_size=None),
                    DataLoader(token_batches(4, 1, False), batch_size=None))
    assert lit.global_step == 6  # trained


class TwoBranches(nn.Module):
    """Two branches on values: padding (both ways alike) and a special token (the other way computes otherwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 8, padding_idx=PAD)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        padding_mask = tokens.eq(PAD)
        if not padding_mask.any():
            padding_mask = None
        x = self.emb(tokens)
        if padding_mask is not None:
            x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))
        if tokens.eq(11).any():  # a special token
            x = x * 2
        return x


def test_each_branch_on_values_is_decided_alone(tmp_path: Path) -> None:
    """Observed calls took the padding branch both ways but never met the special token: the padding branch is
    needless, the special token's stays guarded (one branch shown needless proves nothing about another)."""
    from fx_lightning import fuse
    from fx_lightning.common.calls import Call

    model = TwoBranches().eval()
    plain, padded = torch.randint(1, 11, (3, 7)), torch.randint(1, 11, (3, 7))
    padded[0, -2:] = PAD
    result = fuse(model, example_inputs=(plain,), observed_inputs=[Call((padded,))])
    assert result.value_branches.other_way == 1 and len(result.value_branches.kept) == 1
    assert "tokens.eq(11).any()" in result.value_branches.kept[0]
    reference = H.fp64_copy(model)
    for tokens in (torch.randint(1, 11, (1, 7)), padded):  # fuse() alone keeps only the batch dynamic
        assert H.rel_err(result.module(tokens), reference(tokens)) < 1e-6
    special = torch.randint(1, 11, (2, 7))
    special[1, 1] = 11
    with pytest.raises(ExportError, match=r"tokens\.eq\(11\)\.any\(\)"):
        result.module(special)


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


class GatedConv(nn.Module):
    """A branch on values inside a submodule, which symbolic tracing can keep whole."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.gate = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.bn(self.conv(x)))


def test_a_branch_keeping_whole_serves_both_ways_is_kept_whole_rather_than_guarded() -> None:
    """Every observed call took one way of a branch in a submodule: torch.export's capture would compute that way only
    and refuse the other, keeping the submodule whole serves both, so it is kept whole (the BatchNorm still folds)."""
    from fx_lightning import fuse

    model = H.randomize_batchnorms(GatedConv()).eval()
    result = fuse(model, example_inputs=(torch.rand(2, 3, 6, 6),))
    assert result.report.capture_mode == "fx" and H.count_batchnorms(result.graph_module) == 0
    assert any(n.kind.name == "captured_keeping_whole" for n in result.report.notes)
    reference, ways = H.fp64_copy(model), set()
    for scale in (1, -1, 10, -10):
        x = scale * torch.rand(3, 3, 7, 7)
        with torch.no_grad():
            ways.add(bool(model.bn(model.conv(x)).sum() > 0))
        assert H.rel_err(result.module(x), reference(x.double())) < 1e-6
    assert ways == {True, False}
