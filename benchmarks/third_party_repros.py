"""Minimal reproductions of what the third-party matrix (``third_party.py``, docs/third-party-matrix.md) found, each
in a few lines of torch + lightning + fx_lightning (no third-party library), each named after the library that
showed it. Each prints what happened; none is a test (the fix decides what should happen).

    benchmarks/results/cache/venv-third-party/bin/python benchmarks/third_party_repros.py            # all
    benchmarks/results/cache/venv-third-party/bin/python benchmarks/third_party_repros.py fixed_sizes
"""

from __future__ import annotations

import dataclasses
import enum
import json
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn

from fx_lightning import FXFuseCallback, load_fused

REPROS: Dict[str, Callable[[Path], None]] = {}


def repro(fn: Callable[[Path], None]) -> Callable[[Path], None]:
    REPROS[fn.__name__] = fn
    return fn


def fit(module: L.LightningModule, train: Any, val: Any, root: Path) -> FXFuseCallback:
    callback = FXFuseCallback()
    trainer = L.Trainer(max_epochs=1, callbacks=[callback], default_root_dir=str(root), enable_progress_bar=False,
                        enable_model_summary=False, logger=False, enable_checkpointing=False)
    trainer.fit(module, train, val)
    return callback


def loader(items: Any, batch_size: Optional[int] = 1, **kwargs: Any) -> Any:
    return torch.utils.data.DataLoader(items, batch_size=batch_size, **kwargs)


def images(n: int, size: int) -> Any:
    return torch.utils.data.TensorDataset(torch.randn(n, 3, size, size), torch.randint(0, 3, (n,)))


class Classifier(L.LightningModule):
    """A CNN with BatchNorm and global pooling: runs at any image size."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, i: int) -> None:
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@repro
def fixed_sizes(root: Path) -> None:
    """timm, torchgeo, lightly, speechbrain: every training and validation image is 32x32, so H and W are recorded
    as fixed and the pt2 artifact is specialised to 32x32; a 48x48 image (the model runs it) fails with torch's
    own guard, not the documented refusal naming the input and dimension."""
    model = Classifier()
    cb = fit(model, loader(images(32, 32), 8), loader(images(16, 32), 8), root)
    fused = load_fused(cb.export_dir)
    manifest = json.loads((cb.export_dir / "manifest.json").read_text())
    print("signature input shape:", manifest["signature"]["inputs"][0]["shape"])
    print("batch 1 at 32x32:", tuple(fused(torch.randn(1, 3, 32, 32)).shape))
    fused(torch.randn(2, 3, 48, 48))


class DirectForward(Classifier):
    """smp's example module, torch-uncertainty's routines: the steps call ``self.forward(x)`` (not ``self(x)``)
    and a loss that is a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.loss_fn = nn.CrossEntropyLoss()

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        return self.loss_fn(self.forward(batch[0]), batch[1])

    def validation_step(self, batch: Any, i: int) -> None:
        self.log("val_loss", self.loss_fn(self.forward(batch[0]), batch[1]))


@repro
def forward_called_directly(root: Path) -> None:
    """The root's pre-hook never fires (self.forward bypasses __call__); the steps call ``loss_fn`` and ``net``, so
    the preflight refuses and suggests ``target: loss_fn`` (the first name in sorted order)."""
    fit(DirectForward(), loader(images(32, 32), 8), loader(images(16, 32), 8), root)


class LossAndLogits(L.LightningModule):
    """transformers as Lightning users wrap it: forward(**inputs) -> {loss, logits}, labels among the inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 3)

    def forward(self, **inputs: torch.Tensor) -> Dict[str, Optional[torch.Tensor]]:
        logits = self.head(self.norm(self.embed(inputs["input_ids"]).mean(1)))
        labels = inputs.get("labels")
        return {"loss": F.cross_entropy(logits, labels) if labels is not None else None, "logits": logits}

    def training_step(self, batch: Dict[str, torch.Tensor], i: int) -> torch.Tensor:
        return self(**batch)["loss"]

    def validation_step(self, batch: Dict[str, torch.Tensor], i: int) -> None:
        self.log("val_loss", self(**batch)["loss"])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def tokens(n: int, length: int) -> List[Dict[str, torch.Tensor]]:
    return [{"input_ids": torch.randint(0, 50, (length,)), "labels": torch.randint(0, 3, ())} for _ in range(n)]


@repro
def loss_output_fixes_the_batch(root: Path) -> None:
    """The scalar loss does not follow the batch, so no sample axis is proven and the artifact is built for the
    validation batch size (8); the labels are a required input, so predict-time calls without them are refused."""
    cb = fit(LossAndLogits(), loader(tokens(32, 16), 8), loader(tokens(16, 16), 8), root)
    fused = load_fused(cb.export_dir)
    for call in ({"input_ids": torch.randint(0, 50, (8, 16)), "labels": torch.zeros(8, dtype=torch.long)},
                 {"input_ids": torch.randint(0, 50, (8, 16))},
                 {"input_ids": torch.randint(0, 50, (1, 16)), "labels": torch.zeros(1, dtype=torch.long)}):
        try:
            out = fused(**call)
            print(f"{ {k: tuple(v.shape) for k, v in call.items()} }: ok {type(out).__name__}")
        except Exception as exc:  # noqa: BLE001
            print(f"{ {k: tuple(v.shape) for k, v in call.items()} }: {type(exc).__name__}: {str(exc).splitlines()[0]}")


class Stage(enum.Enum):
    TRAIN = "train"
    VAL = "val"
    PREDICT = "pred"


class LoopStage(str, enum.Enum):  # darts' ModuleStage is a str Enum
    TRAIN = "train"
    VALIDATE = "val"
    PREDICT = "pred"


@dataclasses.dataclass
class ModuleInput:  # darts' PLModuleInput: the tensors and the loop's stage
    x: torch.Tensor
    stage: LoopStage


class StageModel(Classifier):
    """darts: the module's input carries the loop's stage; this forward does not compute with it."""

    def forward(self, x_in: ModuleInput) -> torch.Tensor:
        return self.net(x_in.x)

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        return F.cross_entropy(self(ModuleInput(batch[0], LoopStage.TRAIN)), batch[1])

    def validation_step(self, batch: Any, i: int) -> None:
        self.log("val_loss", F.cross_entropy(self(ModuleInput(batch[0], LoopStage.VALIDATE)), batch[1]))


@repro
def enum_constant_refused(root: Path) -> None:
    """darts: the stage is VALIDATE in every validation call, so it is built in as a constant, and the call darts
    makes at predict time (stage=PREDICT) is refused although forward never reads it; so is a call with VALIDATE
    itself: the manifest keeps the constant as the str 'val', and interface.py compares types."""
    cb = fit(StageModel(), loader(images(32, 32), 8), loader(images(16, 32), 8), root)
    fused = load_fused(cb.export_dir)
    try:
        fused(ModuleInput(torch.randn(2, 3, 32, 32), LoopStage.VALIDATE))
        print("stage=VALIDATE (the value it was built with): ran")
    except Exception as exc:  # noqa: BLE001
        print(f"stage=VALIDATE (the value it was built with): {type(exc).__name__}: {str(exc).splitlines()[0]}")
    fused(ModuleInput(torch.randn(2, 3, 32, 32), LoopStage.PREDICT))


class PlainEnumModel(Classifier):
    """A forward that computes with a plain Enum argument (not a str/int Enum)."""

    def forward(self, x: torch.Tensor, stage: Stage = Stage.PREDICT) -> torch.Tensor:
        return self.net(x) * (2.0 if stage is Stage.PREDICT else 1.0)

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0], Stage.TRAIN), batch[1])

    def validation_step(self, batch: Any, i: int) -> None:
        self.log("val_loss", F.cross_entropy(self(batch[0], Stage.VAL), batch[1]))


@repro
def enum_constant_ignored(root: Path) -> None:
    """WRONG ANSWER: a plain Enum argument is a constant of the graph (VAL), but signature.py keeps only None, int,
    float, bool and str constants in signature.constants, so nothing checks it: called with PREDICT the artifact
    returns the VAL result (half the model's) and raises nothing."""
    model = PlainEnumModel()
    cb = fit(model, loader(images(32, 32), 8), loader(images(16, 32), 8), root)
    x = torch.randn(2, 3, 32, 32)
    got, want = load_fused(cb.export_dir)(x, Stage.PREDICT), model.eval()(x, Stage.PREDICT)
    manifest = json.loads((cb.export_dir / "manifest.json").read_text())
    print(f"signature.constants: {manifest['signature']['constants']}; artifact(x, PREDICT) vs the model's: "
          f"rel err {float((got - want).abs().max() / want.abs().max()):.3f}")


class TupleScale(Classifier):
    """A forward with a tuple argument (a size, a scale: common in image and signal code)."""

    def forward(self, x: torch.Tensor, scale: Tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        return self.net(x) * scale[0] * scale[1]

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0], (1.0, 1.0)), batch[1])

    def validation_step(self, batch: Any, i: int) -> None:
        self.log("val_loss", F.cross_entropy(self(batch[0], (1.0, 1.0)), batch[1]))


class DtypeArgument(Classifier):
    """A forward with a torch.dtype argument."""

    def forward(self, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.net(x).to(dtype) * (2 if dtype == torch.float64 else 1)

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0], torch.float32), batch[1])

    def validation_step(self, batch: Any, i: int) -> None:
        self.log("val_loss", F.cross_entropy(self(batch[0], torch.float32), batch[1]))


@repro
def other_constants_ignored(root: Path) -> None:
    """WRONG ANSWER, as enum_constant_ignored, for a tuple and a torch.dtype argument: both built in, neither in
    signature.constants, another value silently computes with the built-in one."""
    for model, other in ((TupleScale(), (2.0, 2.0)), (DtypeArgument(), torch.float64)):
        cb = fit(model, loader(images(32, 32), 8), loader(images(16, 32), 8), root / type(model).__name__)
        x = torch.randn(2, 3, 32, 32)
        got, want = load_fused(cb.export_dir)(x, other), model.eval()(x, other)
        manifest = json.loads((cb.export_dir / "manifest.json").read_text())
        print(f"{type(model).__name__}({other}): signature.constants {manifest['signature']['constants']}; artifact "
              f"{got.dtype} vs model {want.dtype}, rel err {float((got.double() - want.double()).abs().max() / want.abs().max()):.3f}")


@dataclasses.dataclass
class Graphs:
    """chemprop's BatchMolGraph: a dataclass of tensors and, in a private field, the number of molecules."""

    V: torch.Tensor
    batch: torch.Tensor
    __size: int = 0  # a dataclass field named _Graphs__size

    def __len__(self) -> int:
        return self.__size


class GraphModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 1)

    def forward(self, g: Graphs) -> torch.Tensor:
        h = self.lin(g.V)  # chemprop's MeanAggregation sizes its output from the batch vector, not len(bmg)
        pooled = torch.zeros(int(g.batch.max()) + 1, 8, dtype=h.dtype).index_add(0, g.batch, h)
        return self.out(self.bn(pooled))

    def training_step(self, g: Graphs, i: int) -> torch.Tensor:
        return self(g).pow(2).mean()

    def validation_step(self, g: Graphs, i: int) -> None:
        self.log("val", self(g).pow(2).mean(), batch_size=len(g))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def graphs(molecules: int) -> Graphs:
    atoms = torch.randint(2, 6, (molecules,))  # atoms per molecule: the node count varies from batch to batch
    return Graphs(torch.randn(int(atoms.sum()), 4), torch.arange(molecules).repeat_interleave(atoms), molecules)


@repro
def private_size_constant(root: Path) -> None:
    """Every validation batch holds 8 molecules, so ``g._Graphs__size`` (an int) is built in; one molecule is
    refused."""
    one = {"batch_size": None, "collate_fn": lambda g: g}  # each item is already a batch
    cb = fit(GraphModel(), loader([graphs(8) for _ in range(4)], **one), loader([graphs(8) for _ in range(2)], **one),
             root)
    load_fused(cb.export_dir)(graphs(1))


@dataclasses.dataclass
class LossOutput:
    loss: torch.Tensor
    n_obs_minibatch: int


class CountingOutput(Classifier):
    """scvi-tools: forward returns a dataclass with the batch's row count as a plain int."""

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, LossOutput]:
        logits = self.net(x)
        return logits, LossOutput(logits.pow(2).mean(), x.shape[0])

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0])[0], batch[1])

    def validation_step(self, batch: Any, i: int) -> None:
        self.log("val_loss", F.cross_entropy(self(batch[0])[0], batch[1]))


@repro
def int_output_varies(root: Path) -> None:
    """The preflight sees one call and passes; after training, calls of batch 8 and 4 differ in the int, which is
    compared as structure: ModelError 'the model's outputs change structure from call to call' at end of fit."""
    fit(CountingOutput(), loader(images(32, 32), 8), loader(images(12, 32), 8), root)


class MemoryBank(L.LightningModule):
    """anomalib's Padim: training collects features; eval forward needs the statistics that fill at epoch end."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
            self.register_buffer("mean", torch.empty(0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            f = self.features(x).mean((2, 3))
            return f if self.training else (f - self.mean).pow(2).sum(1)

    def __init__(self) -> None:
        super().__init__()
        self.model = self.Model()
        self.seen: List[torch.Tensor] = []

    def training_step(self, batch: Any, i: int) -> None:
        self.seen.append(self.model(batch[0]).detach())

    def on_train_epoch_end(self) -> None:
        self.model.mean = torch.cat(self.seen).mean(0)

    def validation_step(self, batch: Any, i: int) -> None:
        self.log("score", self.model(batch[0]).mean())

    def configure_optimizers(self) -> None:
        return None


@repro
def memory_bank_preflight(root: Path) -> None:
    """No sanity check (anomalib's Engine turns it off for these models); the preflight runs the observed training
    call through an eval copy, which raises (empty statistics): stopped at stage 'parity input', not taken for a
    condition of the model (ModelError) as docs/third-party.md says."""
    callback = FXFuseCallback()
    trainer = L.Trainer(max_epochs=1, callbacks=[callback], default_root_dir=str(root), enable_progress_bar=False,
                        logger=False, enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(MemoryBank(), loader(images(16, 16), 8), loader(images(8, 16), 8))


def main(argv: List[str]) -> int:
    warnings.filterwarnings("ignore")
    for name in argv or list(REPROS):
        print(f"=== {name}: {REPROS[name].__doc__.split(chr(10))[0].strip()}")
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as tmp:
            try:
                REPROS[name](Path(tmp))
                print("--> no error")
            except Exception as exc:  # noqa: BLE001
                frames = [f for f in traceback.extract_tb(exc.__traceback__)]
                fx = [f for f in frames if "/fx_lightning/" in f.filename]
                where = f"{fx[-1].filename.split('/fx_lightning/')[-1]}:{fx[-1].lineno} ({fx[-1].name})" if fx \
                    else f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}"
                lines = [line for line in str(exc).splitlines() if line.strip()]
                print(f"--> {type(exc).__name__} at {where}:")
                print("    " + "\n    ".join(lines[:4]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
