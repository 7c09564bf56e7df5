"""Correctness on the cases Lightning users hit: torch.fx's ``fuse`` vs fx-lightning.

For each case: BatchNorms before/left, and relative error max|fused - ref| / max|ref| against an fp64
eval copy of the original (random BatchNorm statistics, so a wrong fold cannot look exact).

    python benchmarks/correctness.py      # prints the table and writes benchmarks/results/correctness.md
"""

from __future__ import annotations

import copy
import operator
import sys
from pathlib import Path
from typing import Callable, List, Tuple

import torch
import torch.nn.functional as F
import torchvision
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.fx.experimental.optimization import fuse as torch_fx_fuse

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fusion_helpers import count_bn_modules, randomize_batchnorms, rel_err, reference_fp64  # noqa: E402

import fx_lightning  # noqa: E402
from fx_lightning.passes.batchnorm import is_batchnorm_node  # noqa: E402


class ReusedConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn1, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.BatchNorm2d(4)

    def forward(self, x):
        a = self.bn1(self.conv(x))
        return a + self.bn2(self.conv(torch.relu(a)))


class MyBN(nn.BatchNorm2d):
    pass


class FunctionalBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.register_buffer("mean", torch.randn(4))
        self.register_buffer("var", torch.rand(4) + 0.5)

    def forward(self, x):
        return F.batch_norm(self.conv(x), self.mean, self.var, training=self.training)


def ddp_resnet18() -> nn.Module:
    from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

    return TorchSyncBatchNorm().revert(nn.SyncBatchNorm.convert_sync_batchnorm(torchvision.models.resnet18()))


def frozen() -> nn.Module:
    from torchvision.ops.misc import FrozenBatchNorm2d

    return nn.Sequential(nn.Conv2d(3, 6, 3), FrozenBatchNorm2d(6))


CASES: List[Tuple[str, Callable[[], nn.Module], Tuple[int, ...]]] = [
    ("resnet18 as built", lambda: torchvision.models.resnet18(), (2, 3, 64, 64)),
    ("resnet18 after DDP sync_batchnorm (_BatchNormXd)", ddp_resnet18, (2, 3, 64, 64)),
    ("conv called at two sites, a BN after each", ReusedConv, (2, 4, 8, 8)),
    ("Linear + BatchNorm1d on 3-D input, equal sizes", lambda: nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6)), (3, 6, 6)),
    ("Linear + BatchNorm1d on 3-D input, unequal sizes", lambda: nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(5)), (3, 5, 6)),
    ("ConvTranspose2d(groups=2) + BN", lambda: nn.Sequential(nn.ConvTranspose2d(4, 8, 3, groups=2), nn.BatchNorm2d(8)), (2, 4, 5, 5)),
    ("SyncBatchNorm after a conv", lambda: nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))), (2, 3, 6, 6)),
    ("BatchNorm2d subclass", lambda: nn.Sequential(nn.Conv2d(3, 4, 3), MyBN(4)), (2, 3, 6, 6)),
    ("torchvision FrozenBatchNorm2d", frozen, (2, 3, 6, 6)),
    ("functional F.batch_norm", FunctionalBN, (2, 3, 6, 6)),
]


def bn_count(gm: nn.Module) -> int:
    """BatchNorm calls left, including ones a tracer inlined into arithmetic (a read of running_var)."""
    if isinstance(gm, torch.fx.GraphModule):
        calls = sum(1 for n in gm.graph.nodes if is_batchnorm_node(gm, n))
        # A traced-through BatchNorm (e.g. FrozenBatchNorm2d under torch.fx) stays as x * const + const.
        inlined = sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in (operator.mul, torch.mul)
                      and any(isinstance(a, torch.fx.Node) and a.op == "get_attr" for a in n.args))
        return calls + inlined
    return count_bn_modules(gm)


def run_case(make: Callable[[], nn.Module], shape: Tuple[int, ...], which: str) -> Tuple[str, str, str]:
    torch.manual_seed(0)
    model = randomize_batchnorms(make()).eval()
    x = torch.randn(*shape)
    try:
        ref = reference_fp64(model, (x,))
        before = bn_count(fx_lightning.fuse(model, {"passes": {n: {"enabled": False} for n in (
            "fuse_conv_bn", "fuse_linear_bn", "fuse_bn_into_next")}}).graph_module)
        if which == "torch.fx":
            fused = torch_fx_fuse(copy.deepcopy(model))
        else:
            fused = fx_lightning.fuse(model, example_inputs=x).graph_module
        with torch.no_grad():
            err = rel_err(fused(x), ref)
        return f"{before - bn_count(fused)}/{before}", f"{err:.1e}", "OK" if err <= 1e-5 else "WRONG OUTPUT"
    except Exception as exc:  # noqa: BLE001 - the table reports crashes
        return "-", "-", f"crash: {type(exc).__name__}: {str(exc).splitlines()[0][:60]}"


def main() -> int:
    table = Table(title="BatchNorms folded / relative error vs fp64 (<= 1e-5 is exact)")
    for col in ("case", "torch.fx folded", "torch.fx error", "torch.fx", "ours folded", "ours error", "ours"):
        table.add_column(col)
    md = ["| case | torch.fx `fuse`: folded | error | verdict | fx-lightning: folded | error | verdict |",
          "|---|---|---|---|---|---|---|"]
    for name, make, shape in CASES:
        a, b = run_case(make, shape, "torch.fx"), run_case(make, shape, "ours")
        table.add_row(name, *a, *b)
        md.append(f"| {name} | " + " | ".join(a + b) + " |")
    Console(width=160).print(table)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "correctness.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
