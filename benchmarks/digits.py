"""Trained benchmark models on real data that a package ships: scikit-learn's handwritten digits (1797 8x8
images, 10 classes), upsampled to the benchmark's input size, split 80/20 (stratified, seeded) into training
and held-out images. Lossy variants (int8, bf16) are judged on the held-out split: accuracy against the labels and
top-1 agreement with the fp32 model, which random weights cannot test (their logits are near-tied).

A model is trained once per (name, size, epochs) and cached under ``benchmarks/results/cache/`` (ignored by git);
delete the file to train again.

    python benchmarks/digits.py --models resnet18 mobilenet_v3_large   # train (or load) and print accuracy
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Tuple

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

CACHE = Path(__file__).parent / "results" / "cache"
MEAN, STD = 0.5, 0.25  # of the upsampled images, so the inputs are roughly centred


@dataclass
class Split:
    images: torch.Tensor  # (N, 1, 8, 8) in [0, 1]
    labels: torch.Tensor  # (N,)

    def batches(self, batch_size: int, size: int, shuffle: bool = False, seed: int = 0
                ) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(len(self.labels), generator=torch.Generator().manual_seed(seed)) if shuffle \
            else torch.arange(len(self.labels))
        for start in range(0, len(order), batch_size):
            index = order[start:start + batch_size]
            yield to_model_input(self.images[index], size), self.labels[index]


def to_model_input(images: torch.Tensor, size: int) -> torch.Tensor:
    """8x8 grey digits -> (N, 3, size, size) normalised images, as a camera pipeline would give them."""
    up = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    return ((up - MEAN) / STD).expand(-1, 3, -1, -1).contiguous()


def digits_splits(seed: int = 0) -> Tuple[Split, Split]:
    """(training, held-out): 80/20, stratified by class."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    train_idx: List[int] = []
    held_idx: List[int] = []
    for c in range(10):
        idx = (labels == c).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        cut = int(round(0.8 * len(idx)))
        train_idx += idx[:cut].tolist()
        held_idx += idx[cut:].tolist()
    return (Split(images[train_idx], labels[train_idx]), Split(images[held_idx], labels[held_idx]))


def trained_model(name: str, size: int = 224, epochs: int = 3, batch_size: int = 32, log=print) -> nn.Module:
    """``torchvision.models.<name>(num_classes=10)`` trained on the digits' training split (cached)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"digits_{name}_{size}px_{epochs}ep.pt"
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, num_classes=10)
    if path.exists():
        model.load_state_dict(torch.load(path, weights_only=True))
        return model.eval()
    train, _ = digits_splits()
    steps = epochs * ((len(train.labels) + batch_size - 1) // batch_size)
    optimiser = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=2e-3, total_steps=steps)
    model.train()
    start = time.perf_counter()
    for epoch in range(epochs):
        for x, y in train.batches(batch_size, size, shuffle=True, seed=epoch):
            loss = F.cross_entropy(model(x), y)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            schedule.step()
        log(f"{name}: epoch {epoch + 1}/{epochs}, loss {loss.item():.3f}, {time.perf_counter() - start:.0f} s")
    recalibrate_batchnorm(model, train, size, batch_size)
    torch.save(model.state_dict(), path)
    return model


@torch.no_grad()
def recalibrate_batchnorm(model: nn.Module, train: Split, size: int, batch_size: int = 32) -> nn.Module:
    """BatchNorm running statistics as the average over one pass of the training data: torchvision's MobileNetV3
    keeps them with momentum 0.01, far from converged after a few hundred steps (its eval accuracy was 10%)."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average
    model.train()
    for x, _ in train.batches(batch_size, size):
        model(x)
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    return model.eval()


@torch.no_grad()
def accuracy(model: nn.Module, split: Split, size: int, batch_size: int = 64) -> float:
    correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in split.batches(batch_size, size))
    return correct / len(split.labels)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v3_large"])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    _, held_out = digits_splits()
    for name in args.models:
        model = trained_model(name, args.size, args.epochs)
        print(f"{name}: held-out accuracy {accuracy(model, held_out, args.size):.4f} ({len(held_out.labels)} images)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
