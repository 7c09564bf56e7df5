"""What the target receives: the steps parity compares on, and the signature they show.

In order of trust:

1. **Observed**: the calls the callback recorded while Lightning ran the module's own steps (sanity check,
   validation, training), with the trainer attached: what the target really receives, however the batch is built.
2. **From batches**: the whole model run on the input ``parity.input`` takes out of each batch (automatically: a
   tensor, the first item of a tuple, an ``x``/``image``... key), the target's calls recorded inside. Without
   Lightning (``fuse_and_export``, the command line) this is the way.
3. **The module's own steps without a trainer**, when the batch is not forward's input and nothing was observed.

Where none works, the error says what was tried and how ``parity.input`` is written.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, MutableMapping, Optional, Sequence, Tuple

import torch
from torch import nn

from fx_lightning.common.batches import (
    PARITY_INPUT_SPELLINGS,
    InputRule,
    describe,
    describe_call,
    example_call,
    extract_input,
    flat_tensors,
    label_candidates,
    identity_rule,
    model_device_dtype,
    record_calls,
    to_model,
)
from fx_lightning.common.calls import (Call, as_call, forward_parameter_names, plain, run_seeded, tree_of,
                                       value_at)
from fx_lightning.config import FuseConfig
from fx_lightning.errors import ConfigError, ExportError, FXLightningError, ModelError, first_line
from fx_lightning.common.notes import Note, NoteKind
from fx_lightning.pipeline.records import Batches, Observations, ObservedStep, Source
from fx_lightning.pipeline.targets import has_own_forward
from fx_lightning.signature.absent import absent_fills, one_value_for_all
from fx_lightning.signature.signature import (ConstSpec, Observed, Signature, StateBetweenCalls, UnreturnableOutput,
                                             derive_signature, unreturnable_output)

__all__ = ["TargetSteps", "target_steps", "calibration_steps", "signature_for", "target_calls", "OBSERVED_CALLS",
           "CALIBRATED_ON_OBSERVED", "LABELS_LEFT_OUT", "ABSENT_FILLED", "ONE_FOR_ALL", "without_labels", "with_stand_ins",
           "STEP_INPUTS", "EXAMPLE_INPUTS_USED", "EXAMPLE_INPUTS_DICT"]

OBSERVED_CALLS = NoteKind("observed_calls", "the target's inputs as the LightningModule's own {stage} steps called it: "
                                            "{calls} call(s) compared, {shapes} call(s) seen")
STEP_INPUTS = NoteKind("step_inputs", "forward's input could not be taken out of the batches ({batch}), so the "
                                      "LightningModule's {step} ran on them and parity compared the target on the "
                                      "{calls} input(s) it received")
EXAMPLE_INPUTS_DICT = NoteKind("example_inputs_dict", "example_inputs is a dict: used as forward's keyword arguments")
CALIBRATED_ON_OBSERVED = NoteKind("calibrated_on_observed", "the lossy variants were calibrated on the {calls} "
                                                            "{stage} call(s) of the target observed ({wanted} "
                                                            "wanted): only calls the target was seen to receive")
LABELS_LEFT_OUT = NoteKind("labels_left_out", "the target's calls carry {labels} (the batch's labels, for a loss it "
                                              "computes in forward); it runs without them and gives the same other "
                                              "outputs on every call, so the artifact is built for the call a server "
                                              "makes, without {labels}")
ABSENT_FILLED = NoteKind("absent_filled", "{inputs} may be left out: every call observed passed it, and the model "
                                          "gave the same outputs with it left out (forward's default, None) as with "
                                          "the constant stand-in in its place, on every call, so the artifact puts "
                                          "that in its place ({fills})")
ONE_FOR_ALL = NoteKind("one_for_all", "{inputs} may be given as one value for every sample (an int or a 0-d tensor): "
                                      "the model gave the same outputs with the first value alone as with it repeated "
                                      "for every sample, on the calls observed")
EXAMPLE_INPUTS_USED = NoteKind("example_inputs_used", "no data batches: used the example inputs instead")


@dataclass
class TargetSteps:
    """The steps parity compares on, whether they go through the whole model, where they came from."""

    steps: List[ObservedStep]
    through_whole: bool
    source: str
    notes: List[Note] = field(default_factory=list)


def target_steps(config: FuseConfig, source: Source, whole: nn.Module, target: nn.Module, path: str) -> TargetSteps:
    """The target's calls to compare on (at most ``parity.max_batches``; one when parity is off)."""
    wanted = config.parity.max_batches if config.parity.enabled else 1
    observed = source.observed
    if observed is not None and observed.steps and config.parity.input is None:
        return _observed(observed, wanted, whole, target, path)
    data, rule, data_source, notes = _parity_data(config, source.batches, source.example_inputs, wanted)
    if not data:
        return TargetSteps([], bool(path), data_source, notes)
    samples = list(source.batches.samples) if data_source == source.batches.source else []
    try:
        steps = [_batch_step(whole, target, path, batch, rule, samples[i] if i < len(samples) else None)
                 for i, batch in enumerate(data)]
        return TargetSteps(steps, bool(path) and not _feeds_target(whole, rule), data_source, notes)
    except Exception as exc:  # noqa: BLE001 - the batch is not forward's input: ask the module's own step
        if config.parity.input is not None or rule is identity_rule:
            raise
        steps, step_notes = _steps_from_module(whole, target, data, exc, samples)
        return TargetSteps(steps, False, data_source, notes + step_notes)


def _observed(observed: Observations, wanted: int, whole: nn.Module, target: nn.Module, path: str) -> TargetSteps:
    device, _ = model_device_dtype(whole)
    steps = [dataclasses.replace(s, target=to_model(s.target, device, None), whole=to_model(s.whole, device, None))
             for s in observed.steps[:wanted]]
    through = bool(path) and all(s.whole is not None for s in steps)
    if through:  # the target's inputs at these weights (weights: best differ from the ones observed)
        try:
            steps = [ObservedStep(target_calls(whole, target, s.whole)[0], s.whole, s.samples, s.labels)  # type: ignore[arg-type]
                     for s in steps]
        except FXLightningError:
            raise
        except Exception as exc:  # noqa: BLE001 - the model's own code, in eval mode, on what the steps passed
            raise _eval_failure(exc) from exc
    note = OBSERVED_CALLS(stage=observed.stage, calls=len(steps), shapes=len(observed.shapes) + len(observed.steps))
    return TargetSteps(steps, through, {"validation": "val", "training": "train"}.get(observed.stage, "val"),
                       [*observed.notes, note])


def _parity_data(config: FuseConfig, batches: Batches, example_inputs: Any,
                 wanted: int) -> Tuple[List[Any], InputRule, str, List[Note]]:
    """The batches parity reads, the rule that takes forward's inputs out of them, their source, and notes."""
    data = list(itertools.islice(iter(batches.items), wanted))
    notes: List[Note] = []
    if isinstance(example_inputs, Mapping):  # Lightning allows a dict of keyword arguments here
        example: Optional[Call] = Call((), dict(example_inputs))
        notes.append(EXAMPLE_INPUTS_DICT())
    else:
        example = example_call(example_inputs)
    if not data and example is not None:
        if batches.source != "example":
            notes.append(EXAMPLE_INPUTS_USED())
        return [example], identity_rule, "example", notes
    return data, config.parity.input, batches.source, notes


def _batch_step(whole: nn.Module, target: nn.Module, path: str, batch: Any, rule: InputRule,
                samples: Optional[int]) -> ObservedStep:
    device, dtype = model_device_dtype(whole)
    call = as_call(to_model(extract_input(batch, rule), device, dtype))
    labels = label_candidates(batch) if rule is not identity_rule else ()
    if not path or _feeds_target(whole, rule):
        return ObservedStep(call, None, samples, labels)
    return ObservedStep(target_calls(whole, target, call)[0], call, samples, labels)


def _feeds_target(whole: nn.Module, rule: InputRule) -> bool:
    """Whether a configured ``parity.input`` gives the target's input: where the LightningModule has no forward of
    its own, nothing else can take it (the automatic rule never guesses so: the first item need not be the
    target's input)."""
    return rule is not None and rule is not identity_rule and not has_own_forward(whole)


def target_calls(whole: nn.Module, target: nn.Module, call: Call) -> List[Call]:
    """The calls ``target`` receives while ``whole`` runs on ``call``."""
    if whole is target:
        return [call]
    with torch.no_grad(), record_calls(target) as calls:
        call.run(whole)
    if not calls:
        raise ConfigError(
            "target: the target module is never called by the model's forward, so it cannot be fused "
            "in place; point `target` at a module that forward uses."
        )
    return [Call(tuple(args), dict(kwargs)) for args, kwargs, _ in calls]


def _steps_from_module(whole: nn.Module, target: nn.Module, data: List[Any], failure: Exception,
                       samples: Sequence[Optional[int]]) -> Tuple[List[ObservedStep], List[Note]]:
    """What ``target`` receives while the model's own validation (else training) step runs on each batch, on the
    working copy, without a trainer. Raises a ConfigError that says what was tried, with the batch's types and
    shapes, and how ``parity.input`` is written, when that does not work either."""
    step_errors: List[str] = []
    for name in ("validation_step", "training_step"):
        step = getattr(whole, name, None)
        if not callable(step):
            continue
        if name == "training_step" and getattr(whole, "automatic_optimization", True) is False:
            step_errors.append("training_step was not run: it steps its optimizers itself (manual optimization)")
            continue
        try:
            steps = [ObservedStep(call, None, samples[i] if i < len(samples) else None)
                     for i, batch in enumerate(data) for call in _step_calls(whole, target, step, batch, i)]
        except Exception as exc:  # noqa: BLE001 - the user's own step; said below
            step_errors.append(f"{name} raised {type(exc).__name__}: {first_line(exc)}")
            continue
        if steps:
            return steps, [STEP_INPUTS(batch=describe(data[0]), step=name, calls=len(steps))]
        step_errors.append(f"{name} never called the target")
    if any(e.startswith(f"{name} raised {type(failure).__name__}: {first_line(failure)}")
           for e in step_errors for name in ("validation_step", "training_step")):
        raise ModelError(  # the model's own step fails the same way: the data is right, the model cannot run
            f"the model's own forward raises on the data ({describe(data[0])}), in its steps too: "
            f"{type(failure).__name__}: {first_line(failure)}") from failure
    raise ConfigError(
        f"parity.input: forward's input could not be taken out of the batch ({describe(data[0])}). Tried: the "
        f"automatic input ({type(failure).__name__}: {first_line(failure).replace(f' {PARITY_INPUT_SPELLINGS}.', '')})"
        + (f"; the LightningModule's {'; its '.join(step_errors)}" if step_errors else "")
        + f". Under a Trainer the callback observes what the steps pass; here, {PARITY_INPUT_SPELLINGS}."
    ) from failure


def _step_calls(whole: nn.Module, target: nn.Module, step: Any, batch: Any, index: int) -> List[Call]:
    """Run ``step(batch, index)`` on the working copy with no trainer attached (its ``self.log`` warns and returns)
    and return every call of ``target``."""
    device, dtype = model_device_dtype(whole)
    attached = getattr(whole, "_trainer", None)
    with record_calls(target) as calls, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if attached is not None:
                whole._trainer = None
            step(to_model(batch, device, dtype), index)
        finally:
            if attached is not None:
                whole._trainer = attached
    return [Call(tuple(args), dict(kwargs)) for args, kwargs, _ in calls]


def calibration_steps(config: FuseConfig, source: Source, whole: nn.Module, target: nn.Module, path: str,
                      steps: TargetSteps, count: int) -> Tuple[List[Call], List[Note]]:
    """The target's calls the variants calibrate on (at most ``count``), and a note when they are fewer or not of
    training data. Under a trainer only calls the target was seen to receive: training calls, else (the preflight,
    before the first training step) the observed validation calls. Never the loader's raw batches through the
    module's forward: a module whose steps resize, augment or tokenise the batch would be calibrated, and its
    variant exported, for inputs the target never receives. Without observation (no trainer): the calibration
    batches through the whole model, else the parity steps."""
    if not count:
        return [], []
    observed = source.observed
    if observed is not None and config.parity.input is None:
        training = observed.calibration[:count]
        picked = _observed(dataclasses.replace(observed, steps=training or observed.steps), count, whole, target, path)
        calls = [s.target for s in picked.steps]
        stage = "training" if training else observed.stage
        notes = [CALIBRATED_ON_OBSERVED(calls=len(calls), stage=stage, wanted=count)] if len(calls) < count or \
            not training else []
        return calls, notes
    if source.batches.calibration and steps.through_whole:
        rule = config.parity.input
        try:
            return [_batch_step(whole, target, path, b, rule, None).target
                    for b in source.batches.calibration[:count]], []
        except Exception:  # noqa: BLE001 - the training batches differ from the validation ones: use those
            pass
    return [s.target for s in steps.steps[:count]], []


# Keyword arguments that name labels, where the batch gives none to compare them with.
_LABEL_NAMES = ("labels", "label", "targets", "target", "y")


def without_labels(found: TargetSteps, reference: nn.Module) -> TargetSteps:
    """The calls without the labels they carry, where that is proven by experiment on every call: the target runs
    without them and every output it still gives equals the one it gave with them (a text classifier's logits, its
    loss left out). Labels by name are left out; labels by position (``self(x, y)``, forward's ``labels=None``) are
    left out when they are the last positional arguments. The artifact is then built for the call a server makes.
    Only for a target called directly (not through the whole model, whose forward would pass them again)."""
    if found.through_whole or not found.steps:
        return found
    first = found.steps[0]
    names = [k for k, v in first.target.kwargs.items() if _is_labels(k, v, first.labels)]
    # A causal LM's labels are its input_ids: of the keywords equal to the labels, those named so go first.
    named = [k for k in names if k in _LABEL_NAMES]
    keep = _positional_labels_kept(first, reference)
    flags = _loss_flags(first.target, reference)
    tries = [named, names] if named and named != names else [names]
    for left in [group for labels in tries for group in ([*labels, *flags], labels)] if flags else tries:
        if not left and keep == len(first.target.args):  # a flag asking for the loss goes with the labels
            continue
        steps = _calls_without(found.steps, reference, keep, left)
        if steps is not None:
            positional = (forward_parameter_names(reference) or [])[keep:len(first.target.args)]
            labels = ", ".join([*positional, *left])
            return dataclasses.replace(found, steps=steps, notes=[*found.notes, LABELS_LEFT_OUT(labels=labels)])
    return found


def _calls_without(steps: Sequence[ObservedStep], reference: nn.Module, keep: int,
                   names: Sequence[str]) -> Optional[List[ObservedStep]]:
    """``steps`` with their calls cut to the first ``keep`` positional arguments and without the keywords ``names``,
    where on every call the model runs so and gives the same outputs, and more with them (the loss); else None."""
    out = []
    for step in steps:
        kept = Call(step.target.args[:keep], {k: v for k, v in step.target.kwargs.items() if k not in names})
        try:
            with_them, without = run_seeded(reference, step.target, 0), run_seeded(reference, kept, 0)
        except Exception:  # noqa: BLE001 - it needs them: the call stays as observed
            return None
        if not _outputs_kept(without, with_them):
            return None
        out.append(dataclasses.replace(step, target=kept))
    return out


def _loss_flags(call: Call, reference: nn.Module) -> List[str]:
    """Keyword flags the call sets to True where forward's default is None or False (CLIP's ``return_loss``):
    left out with the labels, where the model then gives the same outputs but the loss."""
    try:
        parameters = inspect.signature(reference.forward).parameters
    except (TypeError, ValueError):
        return []
    return [k for k, v in call.kwargs.items() if v is True and k in parameters
            and parameters[k].default in (None, False)]


def _positional_labels_kept(first: ObservedStep, reference: nn.Module) -> int:
    """How many positional arguments stay when the trailing ones that are the batch's labels (tensors equal to a
    label of the batch, passed where forward's parameter defaults to None) are left out."""
    try:
        parameters = [p for p in inspect.signature(reference.forward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return len(first.target.args)
    keep = len(first.target.args)
    while keep > 1 and keep <= len(parameters) and parameters[keep - 1].default is None and \
            isinstance(first.target.args[keep - 1], torch.Tensor) and first.labels and \
            _is_labels(parameters[keep - 1].name, first.target.args[keep - 1], first.labels):
        keep -= 1
    return keep


def _is_labels(name: str, value: Any, labels: Tuple[torch.Tensor, ...]) -> bool:
    """Whether a keyword's ``value`` is the batch's ``labels``: a tensor equal to one of them, else (no labels known,
    or targets a tensor cannot hold: a detector's list of per-image dicts) named as labels are."""
    if isinstance(value, torch.Tensor) and labels:
        return any(value.shape == t.shape and bool(torch.equal(value.detach().cpu(), t.detach().cpu())) for t in labels)
    return name in _LABEL_NAMES and (isinstance(value, torch.Tensor) or bool(flat_tensors(value)))


def _outputs_kept(without: Any, with_them: Any) -> bool:
    """Whether every tensor of ``without`` is, at the same place, the tensor of ``with_them`` (equal values), and
    ``with_them`` has more: the loss computed from the labels. Named outputs compare by name, and those the model
    gives only without the labels are its inference call's own (BART returns its cache where no labels turned it
    off). An input whose absence changes nothing (a mask of ones, equal to some integer item of the batch) is not
    labels: the artifact keeps it."""
    tree = tree_of(without)
    paths = tree.leaf_paths()
    given = tree_of(with_them).leaf_paths()
    values = tree.leaves(without)
    if tree.kind == "map" and tree_of(with_them).kind == "map":  # by name: only the outputs both calls give
        values = [v for p, v in zip(paths, values) if p in given]
        paths = [p for p in paths if p in given]
    if not paths or len(given) <= len(paths):
        return False
    for path, value in zip(paths, values):
        try:
            theirs = value_at(plain(with_them), path)
        except (KeyError, IndexError, AttributeError, TypeError):
            return False
        if not isinstance(theirs, torch.Tensor) or theirs.shape != value.shape or not torch.equal(theirs, value):
            return False
    return True


def with_stand_ins(signature: Signature, reference: nn.Module,
                      steps: Sequence[ObservedStep]) -> Tuple[Signature, List[Note]]:
    """``signature`` with a stand-in for each optional argument (default None) a caller may leave out, and each
    per-sample input a caller may give as one value, proven on the observed calls (:mod:`~fx_lightning.signature.absent`),
    and the notes saying so."""
    try:
        parameters = inspect.signature(reference.forward).parameters
    except (TypeError, ValueError):  # forward's signature unknown: no default to compare with
        return signature, []
    optional = {name for name, p in parameters.items() if p.default is None}
    calls, run = [s.target for s in steps], (lambda c: run_seeded(reference, c, 0))
    filled = one_value_for_all(absent_fills(signature, calls, run, optional), calls[:2], run)
    fills = {leaf.name: f"the size of {leaf.absent_size_of} for every sample" if leaf.absent_size_of is not None
             else "ones" if leaf.absent_fill == 1 else "zeros" for leaf in filled.inputs if leaf.optional}
    alone = [leaf.name for leaf in filled.inputs if leaf.one_for_all]
    notes = [ABSENT_FILLED(inputs=", ".join(fills), fills="; ".join(f"{k}: {v}" for k, v in fills.items()))] \
        if fills else []
    notes += [ONE_FOR_ALL(inputs=", ".join(alone))] if alone else []
    return filled, notes


def _returnable_target(reference: nn.Module, call: Call, path: str) -> str:
    """The advice for a target whose outputs an artifact cannot give back: the largest submodule (by parameters)
    whose outputs it can, seen by running the target once on ``call`` (a flow's conditioner network, say)."""
    outputs: Dict[str, object] = {}
    names = {id(m): name for name, m in reference.named_modules() if name}

    def record(module: nn.Module, _args: Any, out: Any) -> None:  # None: a hook returning a value replaces the output
        outputs.setdefault(names[id(module)], out)

    hooks = [m.register_forward_hook(record) for m in reference.modules() if id(m) in names]
    try:
        run_seeded(reference, call, 0)
    except Exception:  # noqa: BLE001 - ran before; no advice from a second run
        outputs = {}
    finally:
        for hook in hooks:
            hook.remove()
    sizes = {name: sum(p.numel() for p in reference.get_submodule(name).parameters()) for name in outputs}
    good = [name for name, out in outputs.items() if sizes[name] and unreturnable_output(tree_of(out)) is None]
    if not good:
        return ("nothing to set: no submodule with weights returns only what an artifact gives back (tensors in "
                "tuples, lists, dicts, named tuples, dataclasses, torch's distributions built from their parameters)")
    best = max(good, key=lambda name: (sizes[name], -name.count(".")))
    return (f"set target: {f'{path}.{best}' if path else best} ({sizes[best]} parameters, the largest submodule whose outputs an artifact gives "
            "back): the artifact is then that module, called as the model calls it")


def _returned_argument(reference: nn.Module, call: Call) -> Optional[Tuple[str, Any]]:
    """The mapping argument the target returns itself, updated in place (a copy of it is given, and that very copy
    comes back), by its step; None when it returns none of its arguments."""
    steps = [("arg", i) for i in range(len(call.args))] + [("kwarg", k) for k in call.kwargs]
    for kind, key in steps:
        given = value_at(call, ((kind, key),))
        if not isinstance(given, MutableMapping):
            continue
        mine = copy.copy(given)
        args = tuple(mine if (kind, key) == ("arg", i) else a for i, a in enumerate(call.args))
        kwargs = {k: mine if (kind, key) == ("kwarg", k) else v for k, v in call.kwargs.items()}
        try:
            with torch.no_grad():
                returned = reference(*args, **kwargs)
        except Exception:  # noqa: BLE001 - ran before on the recorded call; no finding from a second run
            return None
        if returned is mine:
            return (kind, key)
    return None


def signature_for(reference: nn.Module, steps: Sequence[ObservedStep], observed: Optional[Observations],
                  probe: bool = False, path: str = "") -> Signature:
    """The signature of the target's calls: ``reference`` run on them (and once more with another seed, for the
    outputs that are drawn at random), the shapes of more observed calls as evidence of what varies. ``path``: the
    target's, for advice naming another target."""
    shapes = list(observed.shapes) if observed is not None else []
    buffers = {name: (id(b), b._version) for name, b in reference.named_buffers()}
    try:
        signature = derive_signature([Observed(s.target, s.samples) for s in steps],
                                     lambda c: run_seeded(reference, c, 0), rerun=lambda c: run_seeded(reference, c, 1),
                                     extra_shapes=shapes, root_names=forward_parameter_names(reference), probe=probe)
    except UnreturnableOutput as exc:  # decided by the model's code, not its weights: the preflight stops on it
        raise ExportError(str(exc), fix=_returnable_target(reference, steps[0].target, path)) from exc
    except StateBetweenCalls as exc:
        replaced, written = _state_buffers(reference, buffers, path)
        if not replaced:  # written in place only (an observer a flag turns off as training goes): not proven yet
            raise ModelError(f"{exc}" + (f"; the calls wrote into the buffers {', '.join(written[:4])}"
                                         if written else "")) from exc
        raise ExportError(f"{exc}; the calls replaced the buffers {', '.join(replaced[:4])}",  # the code's doing
                          fix=STATELESS_TARGET) from exc
    except ValueError as exc:
        raise ModelError(f"the target's calls cannot be described as one signature: {exc}; the calls: "
                         + "; ".join(describe_call(s.target) for s in steps[:3])) from exc
    except Exception as exc:  # noqa: BLE001 - the model's own code, in eval mode, on the calls it received
        raise _eval_failure(exc) from exc
    try:
        parameters = inspect.signature(reference.forward).parameters
    except (TypeError, ValueError):  # forward's signature unknown: no default to tell a left-out argument by
        return signature
    names = forward_parameter_names(reference) or []
    signature.constants = [_with_default(c, parameters, names) for c in signature.constants]
    signature.returns_argument = _returned_argument(reference, steps[0].target)
    signature.arguments = [p.name if p.kind is p.POSITIONAL_OR_KEYWORD else "" for p in parameters.values()
                           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return signature


def _with_default(const: ConstSpec, parameters: Mapping[str, inspect.Parameter], names: Sequence[str]
                  ) -> ConstSpec:
    """``const`` with forward's default for it (``parameters``; ``names``: forward's positional ones) recorded where
    that is another value: a call that leaves the argument out asks for the default (torchvision's RAFT:
    ``num_flow_updates=4``, validated with 8), which the artifact, built with the observed value, does not compute."""
    kind, key = const.steps[0] if len(const.steps) == 1 else ("", None)
    name = names[key] if kind == "arg" and isinstance(key, int) and key < len(names) else key if kind == "kwarg" else None
    param = parameters.get(str(name)) if name is not None else None
    if param is None or param.default is inspect.Parameter.empty or const.unread is not None or \
            const.matches(param.default):
        return const
    return dataclasses.replace(const, default=repr(param.default))


# The advice for a target that answers from state its earlier calls left (tests/test_advice.py applies it).
STATELESS_TARGET = ("fuse a module whose forward starts from a fresh state on every call: give the LightningModule a "
                    "forward that does what the steps do with the model (reset the state of its own modules, then "
                    "run every step; a reset through a registry of every instance, as snntorch's utils.reset, does "
                    "not reach the copies fx-lightning runs: call each neuron's reset_mem()), call it in the steps "
                    "as self(x), and set target: ''")


def _state_buffers(reference: nn.Module, before: Dict[str, Tuple[int, int]],
                   path: str) -> Tuple[List[str], List[str]]:
    """The buffers the calls replaced with new tensors (a forward assigning ``self.mem = ...``: its code keeps state,
    whatever the weights), and those they only wrote into."""
    now = {name: (id(b), b._version) for name, b in reference.named_buffers()}
    named = lambda names: [".".join(filter(None, (path, n))) for n in names]  # noqa: E731
    replaced = [n for n, (i, _) in now.items() if n in before and before[n][0] != i]
    written = [n for n, (i, v) in now.items() if n in before and before[n][0] == i and before[n][1] != v]
    return named(replaced), named(written)


def _eval_failure(exc: Exception) -> ModelError:
    """The model's own forward raising in eval mode on calls its steps made: a condition of the model (it may need
    what training fills), not one the preflight can prove before training."""
    return ModelError(f"the model's own forward raises in eval mode on the calls its steps made "
                      f"({type(exc).__name__}: {first_line(exc)}): a model whose eval forward needs what training "
                      "fills (a memory bank, fitted statistics) cannot run before training; the end of fit runs it on "
                      "the trained model")
