"""``FuseReport``: what the pipeline did, JSON-safe via ``to_dict()`` and readable via ``str()``."""

from __future__ import annotations

import io
import itertools
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Tuple, Union

import torch.fx as fx

from fx_lightning.common.json_views import json_safe
from fx_lightning.common.notes import Note
from fx_lightning.passes.base import Change, RemainingBatchNorm, Skip
from fx_lightning.passes.batchnorm import is_batchnorm_node
from fx_lightning.passes.dropout import is_dropout_node
from fx_lightning.passes.graph_utils import is_batchnorm_like, looks_like_batchnorm

__all__ = ["GraphStats", "PassReport", "FuseReport", "graph_stats", "batchnorms_in_leaves", "reason_kind"]


@dataclass
class GraphStats:
    nodes: int
    batchnorms: int
    dropouts: int
    parameters: int  # elements of all parameters and buffers (BatchNorm statistics included)


def graph_stats(gm: fx.GraphModule) -> GraphStats:
    """Nodes, BatchNorms (those the graph calls, and those inside the modules it keeps whole), dropouts, and the
    elements of every parameter and buffer."""
    bns, dropouts = len(batchnorms_in_leaves(gm)), 0
    for node in gm.graph.nodes:
        if is_batchnorm_node(gm, node):
            bns += 1
        elif is_dropout_node(gm, node):
            dropouts += 1
    unique = {id(t): t for t in itertools.chain(gm.parameters(), gm.buffers())}  # a tensor shared: counted once
    return GraphStats(len(gm.graph.nodes), bns, dropouts, sum(t.numel() for t in unique.values()))


def batchnorms_in_leaves(gm: fx.GraphModule) -> List[RemainingBatchNorm]:
    """The BatchNorms inside the modules the graph calls whole (leaf modules: configured, or kept opaque because
    their forward does not trace): in the export, and never folded."""
    out: List[RemainingBatchNorm] = []
    for target in dict.fromkeys(str(n.target) for n in gm.graph.nodes if n.op == "call_module"):
        leaf = gm.get_submodule(target)
        if is_batchnorm_like(leaf) or looks_like_batchnorm(leaf):
            continue  # a BatchNorm itself: counted as a node
        for name, sub in leaf.named_modules():
            if name and (is_batchnorm_like(sub) or looks_like_batchnorm(sub)):
                out.append(RemainingBatchNorm(f"{target}.{name}",
                                              f"inside {type(leaf).__qualname__} '{target}', a module the graph "
                                              "calls whole (a leaf: not traced into), so not folded"))
    return out


@dataclass
class PassReport:
    name: str
    preserves_computation: bool
    changed: List[Change] = field(default_factory=list)
    skipped: List[Skip] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> Dict[str, object]:
        # Field by field, not asdict(): asdict would turn each record into its fields (details nested), while
        # manifests hold each as one flat object (its to_dict()).
        return {"name": self.name, "preserves_computation": self.preserves_computation,
                "changed": [c.to_dict() for c in self.changed], "skipped": [s.to_dict() for s in self.skipped],
                "seconds": self.seconds}


@dataclass
class FuseReport:
    capture_mode: str
    before: GraphStats
    after: GraphStats
    passes: List[PassReport] = field(default_factory=list)
    remaining_batchnorms: List[RemainingBatchNorm] = field(default_factory=list)
    notes: List[Note] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def batchnorms_folded(self) -> int:
        return self.before.batchnorms - self.after.batchnorms

    def pass_report(self, name: str) -> PassReport:
        for p in self.passes:
            if p.name == name:
                return p
        raise KeyError(f"no pass named {name!r} ran; ran: {', '.join(p.name for p in self.passes)}")

    def to_dict(self) -> Dict[str, Any]:
        """JSON-safe, in the shape manifests have always had: each record one flat object."""
        return json_safe({
            "capture_mode": self.capture_mode,
            "before": asdict(self.before),
            "after": asdict(self.after),
            "passes": [p.to_dict() for p in self.passes],
            "remaining_batchnorms": [r.to_dict() for r in self.remaining_batchnorms],
            "notes": [n.to_dict() for n in self.notes],
            "seconds": self.seconds,
        }) | {"batchnorms_folded": self.batchnorms_folded}

    def __str__(self) -> str:
        from rich.console import Console
        from rich.table import Table

        buf = io.StringIO()
        console = Console(file=buf, width=110, force_terminal=False, color_system=None)
        console.print(f"fx-lightning fuse report  (capture: {self.capture_mode}, {self.seconds:.2f}s)")
        stats = Table("", "nodes", "BatchNorms", "dropouts", "parameters", box=None)
        for label, s in (("before", self.before), ("after", self.after)):
            stats.add_row(label, str(s.nodes), str(s.batchnorms), str(s.dropouts), f"{s.parameters:,}")
        console.print(stats)
        passes = Table("pass", "changed", "skipped", "exact", "seconds", box=None)
        for p in self.passes:
            passes.add_row(p.name, str(len(p.changed)), str(len(p.skipped)),
                           "yes" if p.preserves_computation else "no", f"{p.seconds:.3f}")
        console.print(passes)
        skipped = [(f"[{p.name}] ", s) for p in self.passes for s in p.skipped]
        if skipped:
            console.print("left alone:")
            _print_grouped(console, skipped)
        if self.remaining_batchnorms:
            console.print(f"BatchNorms still in the graph: {len(self.remaining_batchnorms)}")
            _print_grouped(console, [("", r) for r in self.remaining_batchnorms])
        for note in self.notes:
            console.print(f"note: {note}", markup=False)
        return buf.getvalue().rstrip()


# "conv_3 (Conv2d 'layer1.0.conv')" / "add_2 (add)" -> "<Conv2d>" / "<add>": what stays the same across modules.
_NODE = re.compile(r"\b[\w.]+ \(([\w.]+)(?: '[^']*')?\)")


def reason_kind(reason: str) -> str:
    """A reason with its node names taken out, so that the same reason for many modules reads as one."""
    return _NODE.sub(lambda m: f"<{m.group(1)}>", reason)


def _print_grouped(
    console: Any, entries: List[Tuple[str, Union[Skip, RemainingBatchNorm]]], examples: int = 3
) -> None:
    """One line per distinct reason: how many, a few of the nodes, and the reason."""
    groups: Dict[Tuple[str, str], List[str]] = {}
    for prefix, entry in entries:
        # str(): a user pass's skip() is not type-checked and may give a node or reason of another type.
        groups.setdefault((prefix, reason_kind(str(entry.reason))), []).append(str(entry.node))
    for (prefix, kind), nodes in groups.items():
        more = f", ... ({len(nodes) - examples} more)" if len(nodes) > examples else ""
        console.print(f"  {prefix}{len(nodes)} x {kind}  [{', '.join(nodes[:examples])}{more}]", markup=False)
