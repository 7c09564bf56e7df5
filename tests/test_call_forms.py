"""Call forms (issue 37, held-out RAFT and FrEIA): the served call is one argument away from every observed call
(forward's default where the steps passed another value; the other value of a bool flag such as ``rev=True``). Each
form is captured, proven on the observed inputs against the model called that way, and exported beside the
artifact; ``load_fused`` sends each call to its form. Before, such calls were refused by name."""

from __future__ import annotations

import gc
import pickle
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any, List, Optional

import pytest
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

import lightning_helpers as H
from fx_lightning import FXFuseCallback, load_fused
from fx_lightning.cli import main as cli_main
from fx_lightning.common.calls import Call
from fx_lightning.errors import ExportError
from fx_lightning.export.manifest import read_manifest
from fx_lightning.pipeline import export_step as forms_step_export, forms_step
from fx_lightning.pipeline.steps import fuse_target
from fx_lightning.signature.forms import CallForm, call_forms, own_defaults


def _loaders() -> Any:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 4, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8), torch.utils.data.DataLoader(data, batch_size=8)


class Refining(pl.LightningModule):
    """RAFT: forward's default is 2 refinement steps; training and validation pass 6 (the predict call a user
    writes leaves it out)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        self.step = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, steps: int = 2) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(steps):
            h = torch.tanh(self.step(h)) + h
        return self.out(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch[0], steps=6), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.mse_loss(self(batch[0], steps=6), batch[1]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Invertible(pl.LightningModule):
    """FrEIA's ``SequenceINN``: trained and validated forward only (``rev`` never passed); sampling calls
    ``inn(z, rev=True)``, the inverse. ``broken``: the inverse raises (a form that cannot be captured)."""

    def __init__(self, broken: bool = False) -> None:
        super().__init__()
        self.broken = broken
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor, c: Optional[torch.Tensor] = None, rev: bool = False) -> torch.Tensor:
        if rev:
            if self.broken:
                raise NotImplementedError("no inverse")
            scale = (self.bn.running_var + self.bn.eps).sqrt() / self.bn.weight
            h = (x - self.bn.bias) * scale + self.bn.running_mean
            return torch.linalg.solve(self.lin.weight, (h - self.lin.bias).T).T
        return self.bn(self.lin(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_forwards_default_left_out_is_served_by_its_own_form(tmp_path) -> None:
    """Every observed call passed steps=6: the call leaving steps out (forward's default 2) was refused by name.
    Now the steps=2 form answers it, and steps=6 is still the artifact's own."""
    cb = FXFuseCallback(export={"formats": ["pt2", "graph_module"]})
    model = Refining()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, *_loaders())
    forms = cb.outcome.manifest.signature.forms
    assert [(f.argument, f.value, f.default, f.directory) for f in forms] == [("steps", 2, True, "forms/steps=2")]
    assert read_manifest(cb.export_dir / "forms" / "steps=2").signature.constants[0].value == 2
    assert any(n.kind.name == "call_form_exported" for n in cb.outcome.notes)
    assert [t.depth for t in cb.outcome.times if t.name == "export of call form steps=2"] == [1]  # its own line
    reference, x = H.fp64_copy(model), torch.randn(3, 4)
    for fmt in ("pt2", "graph_module"):
        fused = load_fused(cb.export_dir, fmt)
        for kwargs in ({}, {"steps": 2}, {"steps": 6}):
            got, want = fused(x, **kwargs), reference(x.double(), **kwargs)
            assert got.shape == want.shape == (3, 4) and H.rel_err(got, want) < 1e-5, (fmt, kwargs)
        got = fused(x, 2)  # by position, as forward takes it
        assert H.rel_err(got, reference(x.double())) < 1e-5
        # The form is loaded with the artifact, a submodule of it (.to() moves it; its first call waits for no load)
        assert any(m is fused.form_of(Call((x,), {})) for m in fused.exported.modules())
        with pytest.raises(ExportError, match=r"steps is 3; the artifact was built with steps=6 .*; the export's call "
                                              r"forms take: steps=2 \(or left out\)"):
            fused(x, steps=3)  # no observed call and no form: refused by name, naming the forms there are
    again = pickle.loads(pickle.dumps(load_fused(cb.export_dir, "graph_module")))  # a worker process's copy
    for kwargs in ({}, {"steps": 6}):
        assert H.rel_err(again(x, **kwargs), reference(x.double(), **kwargs)) < 1e-5, kwargs
    # A form whose files fail their check is left out, named: the artifact's own calls are still answered.
    for artifact in (cb.export_dir / "forms" / "steps=2").glob("*.pt2"):
        artifact.write_bytes(b"damaged")
    with pytest.warns(UserWarning, match=r"call form steps=2 \(or left out\) .* could not be loaded"):
        damaged = load_fused(cb.export_dir, "pt2")
    assert H.rel_err(damaged(x, steps=6), reference(x.double(), 6)) < 1e-5
    with pytest.raises(ExportError, match="steps"):
        damaged(x)


def test_a_bool_flags_other_value_is_served_by_its_own_form(tmp_path, capsys, monkeypatch) -> None:
    """``rev=True`` (never passed: every call computed the forward transform) was refused by name; now its form,
    proven on the observed inputs against the model's own inverse, answers it, by name and by position."""
    cb = FXFuseCallback(export={"formats": ["pt2", "graph_module"]})
    model = Invertible()
    H.make_trainer(tmp_path, [cb], max_epochs=2).fit(model, *_loaders())
    forms = cb.outcome.manifest.signature.forms
    assert [(f.name, f.directory) for f in forms] == [("c=None", ""), ("rev=False", ""), ("rev=True", "forms/rev=True")]
    assert cli_main(["inspect", str(cb.export_dir)]) == 0  # what a user sees: the form and where it is
    shown = [line for line in capsys.readouterr().out.splitlines() if "call form" in line]
    assert len(shown) == 1 and "rev=True: " in shown[0], shown
    reference, x = H.fp64_copy(model), torch.randn(5, 4)
    for fmt in ("pt2", "graph_module"):
        fused = load_fused(cb.export_dir, fmt)
        z = fused(x)
        assert H.rel_err(z, reference(x.double())) < 1e-5
        assert H.rel_err(fused(x, rev=False), reference(x.double())) < 1e-5  # the default given: the artifact's
        assert H.rel_err(fused(x, None, False), reference(x.double())) < 1e-5  # both defaults, by position
        for back in (fused(z, rev=True), fused(z, None, True)):
            want = reference(z.double(), rev=True)
            assert back.shape == want.shape == (5, 4) and H.rel_err(back, want) < 1e-5, fmt
            assert H.rel_err(back, x) < 1e-3  # the inverse of the forward: x again
    monkeypatch.setattr(torch, "compile", lambda module: module)  # compile=True's wrapper, without compiling
    compiled = load_fused(cb.export_dir, compile=True)
    assert H.rel_err(compiled(z, rev=True), reference(z.double(), rev=True)) < 1e-5


def test_a_form_that_cannot_be_made_is_left_out_saying_why_and_never_stops_training(tmp_path) -> None:
    """The inverse raises on every call: the form is left out with a note (in the preflight too, which must not stop
    the training), the artifact stands, and ``rev=True`` is refused by name."""
    cb = FXFuseCallback(export={"formats": ["graph_module"]})
    model = Invertible(broken=True)
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, *_loaders())
    assert cb.outcome.failure is None and not [f for f in cb.outcome.manifest.signature.forms if f.directory]
    (note,) = [n for n in cb.outcome.notes if n.kind.name == "call_form_not_exported"]
    assert "rev=True" in str(note) and "no inverse" in str(note), str(note)
    fused, x = load_fused(cb.export_dir), torch.randn(3, 4)
    assert H.rel_err(fused(x), H.fp64_copy(model)(x.double())) < 1e-5
    with pytest.raises(ExportError, match=r"keyword argument\(s\) rev, which no call the export was built from "):
        fused(x, rev=True)


class RefiningBackwards(Refining):
    """Two forms: forward's default ``steps`` (trained and validated with 6) and ``backwards=True`` (never passed)."""

    def forward(self, x: torch.Tensor, steps: int = 2, backwards: bool = False) -> torch.Tensor:
        out = super().forward(x, steps)
        return out.flip(-1) if backwards else out


def test_each_form_is_fused_after_the_artifact_and_let_go_before_the_next(tmp_path, monkeypatch) -> None:
    """Forms were all fused (a model copy each, up to four) before the artifact's own export and held through it:
    now each is fused as its export begins, after the artifact's, and freed before the next is fused."""
    fused_forms: List[weakref.ref] = []
    order: List[str] = []

    def fuse_and_watch(source: Any, config: Any) -> Any:
        gc.collect()
        assert all(ref() is None for ref in fused_forms), "a form's fused copy outlived its export"
        order.append("form fused")
        result = fuse_target(source, config)
        fused_forms.append(weakref.ref(result))
        return result

    monkeypatch.setattr(forms_step, "fuse_target", fuse_and_watch)
    real_write = forms_step_export.write_formats

    def write_and_say(staging: Path, *args: Any, **kwargs: Any) -> Any:
        order.append("forms' formats" if "forms" in staging.parts else "artifact's formats")
        return real_write(staging, *args, **kwargs)

    monkeypatch.setattr(forms_step_export, "write_formats", write_and_say)
    cb = FXFuseCallback(export={"formats": ["graph_module"]})
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(RefiningBackwards(), *_loaders())
    assert [f.directory for f in cb.outcome.manifest.signature.forms if f.directory] == [
        "forms/steps=2", "forms/backwards=True"]
    each_export = ["artifact's formats", "form fused", "forms' formats", "form fused", "forms' formats"]
    assert order == each_export * 2, order  # the preflight's, then the end of fit's


def test_call_forms_off_makes_none(tmp_path) -> None:
    cb = FXFuseCallback(export={"formats": ["graph_module"], "call_forms": False})
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(Invertible(), *_loaders())
    assert not cb.outcome.manifest.signature.forms and not (cb.export_dir / "forms").exists()
    with pytest.raises(ExportError, match=r"keyword argument\(s\) rev, which no call"):
        load_fused(cb.export_dir)(torch.randn(3, 4), rev=True)


def test_forms_are_read_from_forwards_signature_and_the_calls() -> None:
    """Only forward's own defaults: another value the calls all had (its default is a form), a bool the calls all
    left at one value (the other value is a form); a value that varies across the calls, or an int at its
    default, is no form."""

    class M(nn.Module):
        def forward(self, x: Any, k: int = 3, flag: bool = True, mode: str = "a", varies: int = 1,
                    mask: Any = None, never: Any = None, stood_in: Any = None, *, keyword: bool = False) -> Any:
            return x

    mask = torch.ones(2, 3)
    calls = [Call((1, 5), {"mode": "a", "varies": 1, "mask": mask, "stood_in": mask}),
             Call((2, 5), {"varies": 2, "mask": mask, "stood_in": mask})]
    forms = call_forms(M(), calls, calls[:1], covered={"stood_in"})
    assert [(f.argument, f.position, f.value, f.default) for f in forms] == [  # varies: only forward's default
        ("k", 1, 3, True), ("flag", 2, False, False), ("mask", 5, None, True), ("keyword", -1, True, False)]
    k, flag, mask, keyword = forms
    assert not [f for f in call_forms(M(), calls, calls[:1], run=lambda c: 1 / 0) if f.argument == "never"]
    assert "mask" not in [f.argument for f in call_forms(M(), [Call((1,), {"mask": 0})])]  # a constant: no form
    import numpy as np
    assert "mask" not in [f.argument for f in call_forms(M(), [Call((1,), {"mask": np.arange(3)})])]  # no ==
    assert [(f.argument, f.value) for f in own_defaults(M(), calls)] == [
        ("flag", True), ("never", None), ("keyword", False)]
    assert mask.takes(Call((1,))) and mask.takes(Call((1,), {"mask": None})) and not mask.takes(Call((1,), {"mask": 0}))
    assert set(mask.applied(calls[0]).kwargs) == {"mode", "varies", "stood_in"}
    assert k.takes(Call((1,))) and k.takes(Call((1, 3))) and not k.takes(Call((1, 5)))
    assert flag.takes(Call((1,), {"flag": False})) and not flag.takes(Call((1,))) and not flag.takes(Call((1, 3, 0)))
    assert keyword.applied(Call((1,))) == Call((1,), {"keyword": True}) and k.applied(Call((1, 5))) == Call((1, 3))
    assert CallForm.from_dict(flag.to_dict()) == flag


class ActorCritic(pl.LightningModule):
    """Lightning's fabric PPO example: training passes the actions the rollout took; the rollout's own call
    ``agent(obs)`` leaves ``action`` out and samples one."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
        self.actor = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor, action: Optional[torch.Tensor] = None) -> Any:
        logits = self.actor(x)
        dist = torch.distributions.Categorical(logits=logits)
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.critic(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        obs, actions, returns = batch
        _, logprob, entropy, value = self(obs, actions)
        return -(logprob * returns).mean() - 0.01 * entropy.mean() + F.mse_loss(value.squeeze(-1), returns)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        obs, actions, returns = batch
        self.log("val_loss", F.mse_loss(self(obs, actions)[3].squeeze(-1), returns))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_an_optional_input_every_call_passed_left_out_is_served_by_its_own_form(tmp_path) -> None:
    """The rollout call ``agent(obs)`` (never observed: training always passes the actions) was refused by name.
    Its form samples the action as the model does: with the same seed, the same actions and the same values."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g),
                                          torch.randn(32, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    cb = FXFuseCallback(export={"formats": ["pt2", "graph_module"]})
    model = ActorCritic()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    assert [f.name for f in cb.outcome.manifest.signature.forms] == ["action=None"]
    reference, obs, actions = H.fp64_copy(model), torch.randn(5, 4), torch.randint(0, 3, (5,))
    for fmt in ("pt2", "graph_module"):
        fused = load_fused(cb.export_dir, fmt)
        got, want = fused(obs, actions), reference(obs.double(), actions)  # the training call: the artifact's own
        assert all(H.rel_err(a, b) < 1e-5 for a, b in zip(got[1:], want[1:])) and torch.equal(got[0], want[0])
        torch.manual_seed(7)
        got = fused(obs)
        torch.manual_seed(7)
        want = reference(obs.double())
        assert type(got) is tuple and len(got) == 4 and got[0].dtype == torch.int64 and got[0].shape == (5,)
        assert torch.equal(got[0], want[0]), fmt  # the same draw
        assert all(g.shape == w.shape and H.rel_err(g, w) < 1e-5 for g, w in zip(got[1:], want[1:])), fmt


class CharLSTM(pl.LightningModule):
    """A char-RNN as tutorials write it: trained on whole sequences (``hidden`` never passed); generation feeds each
    step the state the previous call returned, ``model(x_t, hidden)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.lstm = nn.Embedding(30, 16), nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.norm, self.head = nn.BatchNorm1d(32), nn.Linear(32, 30)

    def forward(self, x: torch.Tensor, hidden: Optional[Any] = None) -> Any:
        out, hidden = self.lstm(self.embed(x), hidden)
        return self.head(self.norm(out.transpose(1, 2)).transpose(1, 2)), hidden

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0])[0].reshape(-1, 30), batch[1].reshape(-1))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.cross_entropy(self(batch[0])[0].reshape(-1, 30), batch[1].reshape(-1)))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_a_state_no_call_passed_is_fed_the_models_own_output_in_its_own_form(tmp_path) -> None:
    """The generation step ``model(x_t, hidden)`` was refused by name (no call passed ``hidden``). The one output
    that runs in its place, the LSTM's ``(h, c)``, is fed back on the observed calls: that form answers the
    recurrent calls, at other batch sizes and one token at a time."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 30, (32, 12), generator=g),
                                          torch.randint(0, 30, (32, 12), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    cb, model = FXFuseCallback(), CharLSTM()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    (form,) = [f for f in cb.outcome.manifest.signature.forms if f.directory]
    assert (form.argument, form.feedback, form.directory) == ("hidden", 1, "forms/hidden=output1")
    reference, fused = H.fp64_copy(model), load_fused(cb.export_dir)
    for batch in (1, 3):
        x = torch.randint(0, 30, (batch, 7))
        got, want = fused(x, None), reference(x)  # a generation loop's first step: hidden = None
        assert H.rel_err(got[0], want[0]) < 1e-5 and H.rel_err(fused(x, hidden=None)[0], want[0]) < 1e-5
        for _ in range(3):  # greedy generation, one token at a time, each step fed the state it returned
            assert type(got[1]) is tuple and len(got[1]) == 2 and got[1][0].shape == (2, batch, 32)
            assert H.rel_err(got[0], want[0]) < 1e-5 and all(H.rel_err(a, b) < 1e-5 for a, b in zip(got[1], want[1]))
            step = want[0][:, -1:].argmax(-1)
            got, want = fused(step, got[1]), reference(step, want[1])
        assert got[0].shape == (batch, 1, 30) and H.rel_err(got[0], want[0]) < 1e-5


class TinySeq2Seq(pl.LightningModule):
    """transformers' seq2seq models (T5, BART, Whisper) as their fine-tuning scripts train them: ``labels`` alone,
    the decoder's inputs made from them inside forward; generation passes ``decoder_input_ids`` instead."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.encoder = nn.Embedding(20, 16), nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
        self.decoder, self.head = nn.GRU(16, 16, batch_first=True), nn.Linear(16, 20)

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        shifted = torch.zeros_like(labels)
        shifted[:, 1:] = labels[:, :-1].clamp(min=0)
        return shifted

    def decoder_inputs(self, labels: torch.Tensor) -> torch.Tensor:
        return self.prepare_decoder_input_ids_from_labels(labels)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                decoder_input_ids: Optional[torch.Tensor] = None) -> Any:
        if decoder_input_ids is None:
            if labels is None:
                raise ValueError("You have to specify either decoder_input_ids or labels")
            decoder_input_ids = self.decoder_inputs(labels)
        memory = self.encoder(self.embed(input_ids)).mean(1, keepdim=True)
        out, _ = self.decoder(self.embed(decoder_input_ids) + memory)
        logits = self.head(out)
        if labels is None:
            return {"logits": logits}
        return {"loss": F.cross_entropy(logits.reshape(-1, 20), labels.reshape(-1)), "logits": logits}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0], labels=batch[1])["loss"]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self(batch[0], labels=batch[1])["loss"])

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def shift_tokens_right(input_ids: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """transformers' function beside Whisper's and BART's classes (their forward shifts labels with it)."""
    shifted = input_ids.new_zeros(input_ids.shape)
    shifted[:, 1:] = input_ids[:, :-1].clone()
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)


class ShiftedSeq2Seq(TinySeq2Seq):
    """Whisper: no ``prepare_decoder_input_ids_from_labels``; forward shifts the labels with the function declared
    beside its class, with its config's pad and start ids."""

    prepare_decoder_input_ids_from_labels = None  # type: ignore[assignment]  # Whisper has none

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(pad_token_id=0, decoder_start_token_id=3)

    def decoder_inputs(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)


class Seq2SeqSteps(pl.LightningModule):
    """Whisper's fine-tuning as its users write it: ``forward(self, **batch)`` passes the batch on to the model."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinySeq2Seq()

    def forward(self, **batch: Any) -> Any:
        return self.model(**batch)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(input_ids=batch[0], labels=batch[1])["loss"]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self(input_ids=batch[0], labels=batch[1])["loss"])

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("steps", [TinySeq2Seq, Seq2SeqSteps, ShiftedSeq2Seq], ids=["model", "keywords", "shift"])
def test_a_seq2seq_model_trained_on_labels_is_served_the_decoders_inputs_in_its_own_form(tmp_path, steps) -> None:
    """T5, BART and Whisper (held-out checks 5 and 7): every call passed labels, so the generation call
    ``model(input_ids, decoder_input_ids=...)`` was refused by name. The model's own
    ``prepare_decoder_input_ids_from_labels`` (Whisper has none: the ``shift_tokens_right`` beside its class, with its
    config's ids) makes the decoder's inputs of the observed calls, shown to give the
    labelled call's logits: that form answers generation's calls, one token at a time too."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(1, 20, (32, 9), generator=g),
                                          torch.randint(1, 20, (32, 6), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    cb, model = FXFuseCallback(export={"formats": ["pt2", "graph_module"]}), steps()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    forms = [f for f in cb.outcome.manifest.signature.forms if f.replaces]
    assert [(f.argument, f.directory) for f in forms] == [("decoder_input_ids", "forms/decoder_input_ids=from_labels")]
    reference = H.fp64_copy(model)
    fused = load_fused(cb.export_dir)
    ids = torch.randint(1, 20, (2, 7))
    decoder = torch.zeros(2, 1, dtype=torch.long)
    for _ in range(3):  # greedy decoding
        got = fused(input_ids=ids, decoder_input_ids=decoder)
        want = reference(input_ids=ids, decoder_input_ids=decoder)
        assert type(got) is dict and list(got) == ["logits"] and H.rel_err(got["logits"], want["logits"]) < 1e-5
        decoder = torch.cat([decoder, want["logits"][:, -1:].argmax(-1)], 1)
    labels = torch.randint(1, 20, (2, 5))  # the labelled call: the artifact's own
    got, want = fused(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    assert H.rel_err(got["loss"], want["loss"]) < 1e-5 and H.rel_err(got["logits"], want["logits"]) < 1e-5
