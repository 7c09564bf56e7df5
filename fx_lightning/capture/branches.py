"""What a capture with the example's tensor values decides on the observed calls: its branches on values
(:mod:`~fx_lightning.signature.value_guards`), said in a note, and the sizes of a call (for the size caches a working
copy keeps: :func:`~fx_lightning.capture.working_copy.forget_size_caches`)."""

from __future__ import annotations

from typing import List, Sequence, Set

import torch
import torch.fx as fx
from torch import nn

from fx_lightning.capture.faithful import difference_from_model
from fx_lightning.capture.fx_failure import branch_sites
from fx_lightning.common.calls import Call, run_seeded, tree_of_call
from fx_lightning.common.notes import Note, NoteKind
from fx_lightning.signature.value_guards import ValueBranches, settle_value_branches

__all__ = ["settled_branches", "call_sizes", "VALUE_BRANCHES_PROVEN", "VALUE_BRANCHES_GUARDED",
           "SIZE_CACHES_FORGOTTEN"]

VALUE_BRANCHES_PROVEN = NoteKind("value_branches_proven", "the model branches on tensor values ({sites}); captured the "
                                 "way the example takes, and shown to give the model's outputs on the {calls} observed "
                                 "call(s) that take the other way, so every artifact serves both")
VALUE_BRANCHES_GUARDED = NoteKind("value_branches_guarded", "the model branches on tensor values ({sites}); every "
                                  "observed call took one way, so the artifacts compute that way only and refuse a "
                                  "call taking the other by name (the guard program value_guards.pt2 runs first)")
SIZE_CACHES_FORGOTTEN = NoteKind("size_caches_forgotten", "{caches}: kept from the last call's size (shown on two "
                                 "calls of other sizes), set to -1 for capture so no size is fixed to it")


def settled_branches(graph_module: fx.GraphModule, notes: List[Note], working: nn.Module, calls: Sequence[Call]
                     ) -> ValueBranches:
    """The capture's branches on tensor values decided on the observed ``calls`` (the first the one captured), said
    in ``notes``. Raises ExportError (ModelError where the weights compute the value) as settle_value_branches."""
    settled = settle_value_branches(graph_module, working, calls, run_seeded, difference_from_model,
                                    lambda c: tree_of_call(c).leaves(c), branch_sites)
    notes.append(VALUE_BRANCHES_GUARDED(sites="; ".join(settled.kept)) if settled.guards is not None else
                 VALUE_BRANCHES_PROVEN(sites="; ".join(settled.sites), calls=settled.other_way))
    return settled


def call_sizes(call: Call) -> Set[int]:
    """Every size of the call's tensors."""
    return {int(n) for t in tree_of_call(call).leaves(call) if isinstance(t, torch.Tensor) for n in t.shape}
