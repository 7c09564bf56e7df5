"""Observing the call: what the target receives while Lightning runs the module's own steps.

While a step runs (the sanity check's and every validation's batches, the training batches), forward pre-hooks on
the target and on the LightningModule record the arguments (positional and keyword, any objects) and, from the
batch and its loader, how many samples the batch holds and its labels. The hooks are there only during a step:
nothing of them is left on the module between steps, in a copy, or in a checkpoint.

Kept: the values of the first ``parity.max_batches`` validation calls of the latest validation run (the end of fit
compares on them), of the first training calls (calibration, and the preflight when there is no validation data),
and the shapes of every call (what varies). :meth:`CallRecorder.observations` hands them to the pipeline.

Where the LightningModule is the target but its steps never call its ``forward`` (they call ``self.forward(...)``
directly, or a submodule), the one submodule the steps do call is the target, and a note says so; a compiled module
(whose hooks do not run) is not observed, and the pipeline reads the batch instead. Where the default target is the
``backbone`` and the forward runs other trained children beside it, a note names them (the artifact leaves them out).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import lightning.pytorch as pl
import torch
from torch import nn

from fx_lightning.common.batches import INPUT_KEYS, LABEL_KEYS, detached, label_candidates, loader_sample_counts
from fx_lightning.common.calls import Call, map_leaves, tree_of_call
from fx_lightning.callback.trainer_data import NO_VALIDATION_DATA, SOURCE_ORDER, SOURCE_STAGES, first_loader
from fx_lightning.capture.working_copy import is_compiled_module
from fx_lightning.config import FuseConfig
from fx_lightning.errors import ConfigError, ModelError
from fx_lightning.common.notes import NoteKind
from fx_lightning.pipeline import (Observations, ObservedStep, calibration_batch_count, has_own_forward,
                                   resolve_target)

__all__ = ["CallRecorder", "TARGET_CALLED_BY_STEPS", "BACKBONE_ONLY", "NOT_OBSERVED"]

TARGET_CALLED_BY_STEPS = NoteKind("target_called_by_steps", "the LightningModule's steps never call its forward (they "
                                                            "call {called} directly): fused {target}, the one of them "
                                                            "that holds the trained parameters")
BACKBONE_ONLY = NoteKind("backbone_only", "target: null fused backbone (the default where the LightningModule has "
                                          "one), but its forward also runs {around} around it, which the artifact "
                                          "leaves out: set target: '' to export the whole forward")
NOT_OBSERVED = NoteKind("not_observed", "the target's calls were not observed ({why}): its inputs were taken out of "
                                        "the batches")
# Shapes of this many calls are kept (evidence of which sizes vary).
MAX_SHAPES = 512
# Calls of the target kept with their values per step (a self-supervised step calls it once per view).
CALLS_PER_STEP = 4


@dataclass
class _Step:
    stage: str  # "validation" | "training"
    samples: Optional[int]
    labels: Tuple[torch.Tensor, ...]
    whole: Optional[Call] = None
    depth: int = 0  # > 0 while the LightningModule's forward runs
    counted: List[bool] = field(default_factory=list)  # per open call of the LightningModule: was it its forward
    # The calls of each module watched in this step (the first few): the call, the LightningModule's call it was
    # made in (None: outside its forward).
    calls: Dict[str, List[Tuple[Call, Optional[Call]]]] = field(default_factory=dict)


@dataclass
class _Log:
    """What one module received: values of the latest validation run's first calls and of the first training
    calls, and the shapes (with the batch's sample count) of every call."""

    kept: Dict[str, List[ObservedStep]] = field(default_factory=lambda: {"validation": [], "training": []})
    shapes: List[Tuple[List[Tuple[int, ...]], Optional[int]]] = field(default_factory=list)

    def add(self, stage: str, observed: ObservedStep, keep: int) -> None:
        if len(self.kept[stage]) < keep:
            self.kept[stage].append(observed)
        if len(self.shapes) < MAX_SHAPES:
            self.shapes.append((_shapes(observed.target), observed.samples))

    def observations(self, path: str, stages: Tuple[str, ...], notes: List[Any]) -> Optional[Observations]:
        """The first of ``stages`` whose calls were seen."""
        for stage in stages:
            steps = self.kept[stage]
            if steps:
                extra = [NO_VALIDATION_DATA()] if stage == "training" and "validation" in stages else []
                return Observations(path, list(steps), list(self.shapes), list(self.kept["training"]), stage,
                                    [*notes, *extra])
        return None


class CallRecorder:
    """Records the target's calls during the steps of one fit (see the module's docstring)."""

    def __init__(self, pl_module: "pl.LightningModule", config: FuseConfig) -> None:
        self.root = pl_module
        # parity.data: whose calls parity compares on (example: the example_input_array, nothing observed).
        self.stages = tuple(SOURCE_STAGES[source] for source in SOURCE_ORDER[config.parity.data])
        self.path, self.target = resolve_target(pl_module, config.target)
        # Calls kept per stage; training calls: parity's (without validation data) and the lossy variants' calibration.
        keep = max(1, config.parity.max_batches)
        self.keep = {"validation": keep, "training": max(keep, calibration_batch_count(config))}
        # Watched: the target, and the LightningModule's children when it is the default target (its steps may
        # call a submodule instead of its forward).
        self.watched: Dict[str, nn.Module] = {self.path: self.target}
        self.by_default = config.target is None
        if self.target is pl_module and self.by_default:
            self.watched.update(dict(pl_module.named_children()))
        # The default target ``backbone``: the children holding trained parameters that the LightningModule's
        # forward runs beside it (an input embedding, a head): the artifact leaves them out, and a note says so.
        self.beside: Dict[str, nn.Module] = {
            name: child for name, child in pl_module.named_children()
            if config.target is None and self.target is not pl_module and child is not self.target and _trained(child)}
        self.ran_beside: Set[str] = set()
        self.logs: Dict[str, _Log] = {name: _Log() for name in self.watched}
        self.step: Optional[_Step] = None
        self.root_called = False
        self.input_hint: Optional[str] = None  # how parity.input would name a batch's first item (for advice)
        self.seen: Set[str] = set()  # the stages whose steps began
        self.handles: List[Any] = []
        self.off: Optional[str] = None
        if any(is_compiled_module(m) for m in (pl_module, self.target)):
            self.off = "the module is compiled with torch.compile, whose modules run no hooks"

    # ------------------------------------------------------------------------------------------- steps

    def begin(self, stage: str, batch: Any, batch_idx: int, loader: Any) -> None:
        """A step of ``stage`` starts on ``batch`` (the ``batch_idx``-th of ``loader``)."""
        if self.off is not None:
            return
        if stage == "validation" and batch_idx == 0:
            for log in self.logs.values():
                log.kept["validation"] = []
        samples = loader_sample_counts(loader, batch_idx + 1)[batch_idx] if loader is not None else None
        self.step = _Step(stage, samples, _labels(batch))
        self.seen.add(stage)
        if self.input_hint is None:
            self.input_hint = _input_hint(batch)
        self._hook()

    def end(self) -> None:
        """The step ended: keep what it showed."""
        self._unhook()
        step, self.step = self.step, None
        if step is not None:
            self._keep(step)

    def _keep(self, step: _Step) -> None:
        """The step's calls so far into the logs (taken out of the step: a step still running keeps adding)."""
        taken, step.calls = step.calls, {}
        for name, calls in taken.items():
            for call, whole in calls:
                if name != self.path and whole is not None:
                    continue  # a child called by the forward: the forward is what the steps call
                self.logs[name].add(step.stage, ObservedStep(call, whole if name else None, step.samples,
                                                             step.labels), self.keep[step.stage])

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No hook on the module while the block runs (it copies the module: a copy must not carry them)."""
        hooked = bool(self.handles)
        self._unhook()
        try:
            yield
        finally:
            if hooked:
                self._hook()

    # ------------------------------------------------------------------------------------------- hooks

    def _hook(self) -> None:
        if self.handles:
            return
        self.handles.append(self.root.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        self.handles.append(self.root.register_forward_hook(self._root_post))
        for name, module in self.watched.items():
            if module is not self.root:
                self.handles.append(module.register_forward_pre_hook(self._watch(name, module), with_kwargs=True))
        for name, module in self.beside.items():
            self.handles.append(module.register_forward_pre_hook(self._beside(name, module)))

    def _unhook(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _root_pre(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        step = self.step
        if step is None or module is not self.root:
            return
        # Under DDP (and the strategies like it) Lightning calls the module with the step's arguments, its forward
        # swapped for the step on the instance for that one call: that call is the step, not the forward.
        redirected = "forward" in vars(module)
        step.counted.append(not redirected)
        if redirected:
            return
        if step.depth == 0:
            step.whole = _kept(args, kwargs) if self._room(step, self.path) else None
            self.root_called = True
            if self.target is self.root and step.whole is not None:
                step.calls.setdefault(self.path, []).append((step.whole, step.whole))
        step.depth += 1

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        step = self.step
        if step is not None and module is self.root and step.counted and step.counted.pop():
            step.depth -= 1

    def _watch(self, name: str, watched: nn.Module) -> Any:
        def hook(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
            step = self.step
            if step is None or module is not watched:
                return
            if self._room(step, name):
                step.calls.setdefault(name, []).append((_kept(args, kwargs), step.whole if step.depth > 0 else None))
            elif name == self.path and len(self.logs[name].shapes) < MAX_SHAPES:  # more calls: their shapes
                self.logs[name].shapes.append((_shapes(Call(tuple(args), dict(kwargs))), None))
        return hook

    def _beside(self, name: str, watched: nn.Module) -> Any:
        def hook(module: nn.Module, args: Tuple[Any, ...]) -> None:
            if self.step is not None and self.step.depth > 0 and module is watched:
                self.ran_beside.add(name)
        return hook

    def _room(self, step: _Step, name: str) -> bool:
        """Whether a call of ``name`` in this step is kept with its values: a few per step (two views of a batch,
        say), within what parity compares on."""
        return len(step.calls.get(name, [])) < CALLS_PER_STEP

    # --------------------------------------------------------------------------------------- the result

    def observations_from(self, stage: str) -> bool:
        """Whether the target's calls of ``stage`` were observed (their values kept) and parity would use them."""
        log = self.logs[self.path]
        return self.off is None and stage in self.stages[:1] and bool(log.kept[stage])

    def observations(self, validation_ahead: Callable[[], bool] = lambda: True) -> Optional[Observations]:
        """What was observed (None: nothing, observation was off, or ``parity.data: example``), of the first stage
        ``parity.data`` names that was seen. Raises ConfigError when the LightningModule is the default target, its
        forward was never called, and its steps called several submodules. ``validation_ahead``: whether validation
        steps may still run (asked during a step, the preflight, and only where it decides: it may build the
        validation loader); when none will, what was seen is all there is."""
        if self.off is not None or not self.stages:
            return None
        if self.step is not None:  # asked during a step (the preflight before the first optimizer step): its calls
            self._keep(self.step)
        found = self.logs[self.path].observations(self.path, self.stages, self._backbone_only())
        if found is not None or self.target is not self.root or self.root_called:
            return found
        called = sorted(name for name, log in self.logs.items() if name != self.path and any(log.kept.values()))
        weighted = [n for n in called if _weights(self.watched[n])]  # a loss or a batch transform holds none
        if not weighted and self.by_default and any(_weights(c) for c in self.root.children()):
            # The steps reach the model through its other methods (model.score(x)): none of its calls was seen.
            # With a forward of its own the LightningModule is fused on the batches' input, as when nothing is
            # observed; without one, refused once nothing more can be seen (validation may still call a child).
            if not has_own_forward(self.root):
                if "validation" in self.seen or self.step is None or not validation_ahead():
                    self._refuse_unobserved_model(called)
                raise ModelError(  # the preflight before validation was seen: what it calls decides, at the end
                    "the LightningModule has no forward and its training steps called no submodule holding weights "
                    "(they reach the model through its other methods): what its validation steps call decides the "
                    "target, at the end of fit")
            return None
        if not called:
            return None
        name = self._trained_one(called)
        return self.logs[name].observations(name, self.stages, [TARGET_CALLED_BY_STEPS(
            called=", ".join(called), target=name)])

    def _backbone_only(self) -> List[Any]:
        """The note that the default target ``backbone`` leaves out what the forward runs beside it (where the
        forward was seen to call the backbone and them)."""
        log = self.logs[self.path]
        inside = any(step.whole is not None for steps in log.kept.values() for step in steps)
        if not (inside and self.ran_beside):
            return []
        around = ", ".join(f"{n} ({_trained(self.beside[n]):,} trained parameters)" for n in sorted(self.ran_beside))
        return [BACKBONE_ONLY(around=around)]

    def _trained_one(self, called: List[str]) -> str:
        """Of the submodules the steps call, the one that holds the trained parameters (a batch transform or a loss
        holds none; a loss that holds the model and no weights of its own is not it). Raises ConfigError naming each
        with its count when several do: which one is the model is then not observable."""
        counts = {name: _trained(self.watched[name]) for name in called}
        trained = sorted((n for n in called if counts[n] > 0), key=lambda n: -counts[n])
        trained = [n for n in trained if not any(_wraps(self.watched[n], self.watched[m]) for m in trained if m != n)]
        if not trained:  # frozen: the one holding weights (a frozen feature extractor, an EMA copy)
            called = [n for n in called if _weights(self.watched[n])] or called
        if len(called) == 1 or len(trained) == 1:
            return trained[0] if trained else called[0]
        listed = ", ".join(f"{n} ({counts[n]:,} trained parameters)" for n in (trained or called))
        raise ConfigError(
            f"target: null, and the LightningModule's steps never call its forward: they call the submodules "
            f"{listed} directly, and more than one holds trained parameters.",
            fix=f"set target to the one to fuse (e.g. target: {(trained or called)[0]})")

    def _refuse_unobserved_model(self, called: List[str]) -> None:
        """The LightningModule has no forward and its steps called no module holding weights (only a loss or a
        transform, or nothing): they reach the model through its other methods (``flow.forward_kld(x)``), so no
        call of it was observed. A ConfigError naming where the weights are, with the setting that makes a call:
        the child holding the most, fed ``parity.input``."""
        holders = {n: sum(p.numel() for p in c.parameters()) for n, c in self.root.named_children() if _weights(c)}
        held = ", ".join(f"{n} ({c:,} parameters)" for n, c in sorted(holders.items(), key=lambda kv: -kv[1]))
        first = max(holders, key=lambda n: holders[n])
        item = self.input_hint or "<the batch item its forward takes: a key, an index or '*'>"
        calls = f"they call {', '.join(called)}, which hold no weights" if called else "they call no submodule"
        raise ConfigError(
            f"target: null, and the LightningModule has no forward; {calls}: its weights are in {held}, which the "
            "steps use through other methods than forward, so no call of the model was observed.",
            fix=f"fuse the module holding them, fed the batches' item its forward takes: target: {first}, "
                f"parity.input: {item}")


def _wraps(outer: nn.Module, inner: nn.Module) -> bool:
    """Whether ``outer`` holds ``inner`` and no trained weights of its own (a loss built around the model,
    sentence-transformers' ``MultipleNegativesRankingLoss(model)``): the model is ``inner``."""
    if outer is inner or not any(m is inner for m in outer.modules()):
        return False
    own = {id(p) for p in outer.parameters() if p.requires_grad}
    return own == {id(p) for p in inner.parameters() if p.requires_grad}


def _weights(module: nn.Module) -> bool:
    """Whether the module holds parameters, trained or frozen."""
    return any(True for _ in module.parameters())


def _trained(module: nn.Module) -> int:
    """How many of the module's parameters are trained."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _kept(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Call:
    """A call's arguments, detached and copied (the step goes on with the originals), on the CPU."""
    return map_leaves(lambda t: t.detach().to("cpu", copy=True), Call(tuple(args), dict(kwargs)))


def _shapes(call: Call) -> List[Tuple[int, ...]]:
    return [tuple(t.shape) for t in tree_of_call(call).leaves(call)]


def _input_hint(batch: Any) -> Optional[str]:
    """How ``parity.input`` names the batch's first input: ``'*'`` (the batch is a tensor), ``0`` (a tuple or list),
    or the first key holding a tensor (a dict); None for other batches."""
    if isinstance(batch, torch.Tensor):
        return "'*'"
    if isinstance(batch, (tuple, list)) and batch:
        return "0"
    if isinstance(batch, dict):  # the automatic rule's keys first (x, input, image...), never a label's
        keys = [k for k, v in batch.items() if isinstance(k, str) and isinstance(v, torch.Tensor)]
        return next((k for k in INPUT_KEYS if k in keys), next((k for k in keys if k not in LABEL_KEYS), None))
    return None


def _labels(batch: Any) -> Tuple[torch.Tensor, ...]:
    try:
        candidates = label_candidates(batch)
    except Exception:  # noqa: BLE001 - a batch that holds no labels the usual way
        return ()
    return tuple(detached(t).cpu() for t in candidates)


def step_loader(trainer: "pl.Trainer", stage: str) -> Any:
    """The loader a step's batch came from (the first one for several)."""
    return first_loader(trainer.val_dataloaders if stage == "validation" else trainer.train_dataloader)
