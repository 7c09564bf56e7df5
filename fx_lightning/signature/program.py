"""The one ``torch.export`` call: capture, every export format and every variant export a module through
:func:`export_program`, with the dimensions the :class:`~fx_lightning.signature.signature.Signature` says vary.

It tries, in order, stopping at the first program that runs on every call it is given to check:

1. non-strict export (torch.export's default for our purposes: it runs the Python code as it is);
2. strict export (TorchDynamo), when (1) failed on a data-dependent size or specialised a dimension that must vary:
   code such as ``int(batch.max()) + 1`` (a graph's pooling size) needs it;
3. both again with the eval-mode BatchNorms run as ``aten._native_batch_norm_legit_no_training`` (the same
   arithmetic), when a BatchNorm meets a data-dependent number of rows (``batch_norm`` asks whether it is empty);
4. non-strict again with sizes reasoned about size-obliviously (torch's ``backed_size_oblivious``), when every
   dynamic attempt specialised: an intermediate size that is 1 at the example (a ResNet trunk's 1x1 at 32x32) or
   above 1 makes torch.export guard on it, so no one example covers both; the program is then checked on the calls
   of other sizes like any other;
5. non-strict with the example's tensor values propagated (torch's ``fake_tensor_propagate_real_tensors``, what its
   ``draft_export`` does), when an attempt failed on a branch on tensor values (``if not mask.any():``): the branch
   the example takes is captured, guarded by runtime assertions in the graph that
   :mod:`~fx_lightning.signature.value_guards` then proves needless or keeps;
6. with ``allow_static``: the same program for the example's sizes only, saying why the dynamic one failed.

The module is ours (a working copy or a fused GraphModule): its BatchNorms' ``forward`` is swapped for the length of
the call only.
"""

from __future__ import annotations

import contextlib
import logging
import types
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

from fx_lightning.common.calls import Call, Tree, no_distribution_validation, tree_of_call
from fx_lightning.errors import first_line
from fx_lightning.signature.signature import DimKind, Signature

__all__ = ["Program", "ExportAttempt", "export_program", "signature_dims", "capture_dims", "ExportFailed",
           "eval_batchnorm_kernels", "nested_dynamic_shapes", "ASSERTION_FAILED"]

# A leaf's dimensions -> what torch.export should make of them (a Dim, Dim.AUTO, Dim.DYNAMIC); None: static.
LeafDims = Optional[Dict[int, Any]]


class ExportFailed(Exception):
    """Every attempt failed: ``attempts`` says how each one did."""

    def __init__(self, attempts: List["ExportAttempt"]) -> None:
        super().__init__("; ".join(str(a) for a in attempts))
        self.attempts = attempts

    @property
    def first(self) -> BaseException:
        return self.attempts[0].error or self


@dataclass
class ExportAttempt:
    dynamic: bool
    strict: bool
    batchnorm_kernel: bool
    size_oblivious: bool = False
    values_observed: bool = False
    error: Optional[BaseException] = None

    @property
    def route(self) -> str:
        """How torch.export ran: ``non-strict`` alone is its plain route."""
        return ("strict" if self.strict else "non-strict") + \
            (", BatchNorm as its inference kernel" if self.batchnorm_kernel else "") + \
            (", sizes size-oblivious" if self.size_oblivious else "") + \
            (", the example's tensor values propagated" if self.values_observed else "")

    def __str__(self) -> str:
        what = "dynamic" if self.dynamic else "static"
        return f"{what} {self.route}: {type(self.error).__name__}: {first_line(self.error)}" if self.error else \
            f"{what} {self.route}: ok"


@dataclass
class Program:
    """The exported program and every attempt, the last the one that made it: ``dynamic`` (the dimensions asked for
    are dynamic) or not (the example's sizes only, ``static_reason`` says why), by its ``route``."""

    program: "torch.export.ExportedProgram"
    dynamic: bool
    attempts: List[ExportAttempt]

    @property
    def route(self) -> str:
        return self.attempts[-1].route

    @property
    def values_observed(self) -> bool:
        """Whether a branch on tensor values was captured the way the example took it (guarded by assertions)."""
        return self.attempts[-1].values_observed

    @property
    def static_reason(self) -> Optional[str]:
        failed = [a for a in self.attempts if a.error is not None and a.dynamic]
        return first_line(failed[0].error) if failed and not self.dynamic else None


def signature_dims(signature: Signature, *, dynamic_samples: bool = True) -> List[LeafDims]:
    """The input leaves' dynamic dimensions for an artifact: the proven sample axis (one shared ``batch`` Dim, from
    1) unless ``dynamic_samples`` is off or only padding to a size seen is exact along it (``any_size`` false), and
    every dimension that varied (``Dim.DYNAMIC``: torch.export must keep it dynamic or fail)."""
    batch = torch.export.Dim("batch", min=1)
    samples = dynamic_samples and signature.sample.any_size
    out: List[LeafDims] = []
    for leaf in signature.inputs:
        dims: Dict[int, Any] = {}
        for i, d in enumerate(leaf.dims):
            if d.kind is DimKind.sample and samples:
                dims[i] = batch
            elif d.kind is DimKind.variable:
                dims[i] = torch.export.Dim.DYNAMIC
        out.append(dims or None)
    return out


def capture_dims(signature: Optional[Signature], leaves: Sequence[Any], *, dynamic_samples: bool = True
                 ) -> List[LeafDims]:
    """The dimensions capture keeps dynamic: those that varied and the proven sample axis (``Dim.DYNAMIC``: a
    model that fixes one fails, and is captured for the example's sizes instead, with a note), and dim 0 where no
    signature is given (``Dim.AUTO``: torch.export decides; :func:`specialised` tells whether it kept it)."""
    out: List[LeafDims] = []
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            out.append(None)
            continue
        dims: Dict[int, Any] = {}
        spec = signature.inputs[i] if signature is not None and i < len(signature.inputs) else None
        if dynamic_samples and spec is not None and spec.sample_axis is not None:
            dims[spec.sample_axis] = torch.export.Dim.DYNAMIC
        elif dynamic_samples:
            dims[0] = torch.export.Dim.AUTO
        if spec is not None:
            for d, dim in enumerate(spec.dims):
                if dim.kind is DimKind.variable:
                    dims[d] = torch.export.Dim.DYNAMIC
        out.append(dims or None)
    return out


def specialised(program: "torch.export.ExportedProgram", leaf_dims: Sequence[LeafDims]) -> bool:
    """Whether torch.export fixed a dimension asked for as ``Dim.AUTO`` to the example's size (its code depends on
    that size). True also when the program's tensor inputs cannot be matched to ``leaf_dims``: not shown dynamic."""
    user = set(program.graph_signature.user_inputs)
    vals = [n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder" and n.name in user]
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    if len(tensors) != len(leaf_dims):
        return True
    from torch.fx.experimental.symbolic_shapes import is_concrete_int  # a SymInt fixed to a number counts

    return any(is_concrete_int(t.shape[d]) for t, dims in zip(tensors, leaf_dims)
               for d, how in (dims or {}).items() if how == torch.export.Dim.AUTO)


def nested_dynamic_shapes(module: nn.Module, call: Call, leaf_dims: Sequence[LeafDims]) -> Any:
    """``dynamic_shapes`` shaped as torch.export wants them for ``module`` called with ``call``: one entry per
    positional argument (tensor leaves get theirs, anything else None), the arguments a ``*args`` parameter
    collects as one tuple of their own (``forward(self, *args)`` wrappers)."""
    tree = tree_of_call(call)
    it = iter(leaf_dims)
    specs = [_spec_of(child, it) for (kind, _), child in tree.children if kind == "arg"]
    kwargs = {key: _spec_of(child, it) for (kind, key), child in tree.children if kind == "kwarg"}
    import inspect

    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    star = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    if star is not None and star <= len(specs):
        specs = specs[:star] + [tuple(specs[star:])]
    if kwargs:
        named = {p.name: s for p, s in zip(params, specs)}
        return {**named, **kwargs}
    return tuple(specs)


def _spec_of(tree: Tree, it: Iterator[LeafDims]) -> Any:
    if tree.kind == "tensor":
        return next(it)
    if tree.kind == "const":
        return None
    parts = [_spec_of(child, it) for _, child in tree.children]
    if tree.kind == "map":
        return {key: p for ((_, key), _), p in zip(tree.children, parts)}
    if tree.kind == "seq":
        return tuple(parts) if issubclass(tree.cls or tuple, tuple) else list(parts)
    raise ValueError(f"torch.export cannot take a {tree.cls.__name__ if tree.cls else tree.kind} argument: "
                     "flatten the call first (fx_lightning.common.calls.FlatCall)")


def _batchnorm_forward(self: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._native_batch_norm_legit_no_training.default(
        x, self.weight, self.bias, self.running_mean, self.running_var, 0.0, self.eps)[0]


@contextlib.contextmanager
def eval_batchnorm_kernels(module: nn.Module) -> Iterator[int]:
    """While the block runs, every eval-mode BatchNorm with running statistics in ``module`` (ours: a working copy)
    computes with ``aten._native_batch_norm_legit_no_training``, the kernel eval-mode ``batch_norm`` dispatches
    to, without its check for an empty input (which torch.export cannot answer for a data-dependent row count).
    Yields how many were swapped."""
    swapped = []
    for m in module.modules():
        if (type(m).forward is nn.modules.batchnorm._BatchNorm.forward and not m.training
                and getattr(m, "running_mean", None) is not None and "forward" not in vars(m)):
            m.forward = types.MethodType(_batchnorm_forward, m)
            swapped.append(m)
    try:
        yield len(swapped)
    finally:
        for m in swapped:
            del m.forward


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch's shape machinery logs a failed attempt's whole graph as a warning (and the guard it could not make as
    an error); the attempt's error, kept and reported, says enough."""
    loggers = [logging.getLogger(name) for name in ("torch.fx.experimental.symbolic_shapes", "torch._dynamo",
                                                    "torch.export", "torch._export", "torch._guards")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _data_dependent(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}"
    return any(s in text for s in ("data-dependent", "DataDependent", "Constraints violated", "specialized",
                                   "specialised", "ConstraintViolation", "guard on", "Guard failed",
                                   "Expected input"))


def export_program(module: nn.Module, call: Call, leaf_dims: Optional[Sequence[LeafDims]] = None, *,
                   allow_static: bool = True, check: Sequence[Call] = (), static_call: Optional[Call] = None,
                   values: bool = False) -> Program:
    """``torch.export`` of ``module`` on ``call`` with ``leaf_dims`` (one entry per tensor leaf of the call, in
    leaf order; None: static), trying the routes above; each program made is run on the ``check`` calls (other
    sizes the dynamic dimensions must take) before it is accepted. ``values``: the route with the example's tensor
    values may be tried (capture only, which decides the assertions it leaves: never an export of a fused graph).
    Raises :class:`ExportFailed` with every attempt
    when none worked."""
    dynamic = leaf_dims is not None and any(d for d in leaf_dims)
    batchnorms = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())
    attempts: List[ExportAttempt] = []
    groups = ([True] if dynamic else []) + ([False] if allow_static or not dynamic else [])
    for is_dynamic in groups:
        shapes = nested_dynamic_shapes(module, call, leaf_dims) if is_dynamic else None  # type: ignore[arg-type]
        for strict, kernel, oblivious, route_values in _ROUTES:
            earlier = [a for a in attempts if a.dynamic == is_dynamic]
            if kernel and not (batchnorms and any("batch_norm" in str(a.error) for a in earlier)):
                continue  # the kernel route answers a BatchNorm's question about a data-dependent row count only
            if oblivious and not is_dynamic:
                continue  # a static program has no size to reason about
            if route_values and not (values and any(_branch_on_values(a.error) for a in earlier)):
                continue  # only a branch on tensor values needs the example's values
            attempt = ExportAttempt(is_dynamic, strict, kernel, oblivious, route_values)
            attempts.append(attempt)
            try:
                with eval_batchnorm_kernels(module) if kernel else contextlib.nullcontext(0), _quiet(), \
                        _size_oblivious(oblivious), _values_observed(route_values):
                    with torch.no_grad(), no_distribution_validation():
                        made_on = _fresh(call if is_dynamic or static_call is None else static_call)
                        program = torch.export.export(module, made_on.args, made_on.kwargs or None, strict=strict,
                                                      dynamic_shapes=shapes)
                if is_dynamic:
                    _check_runs(program, check, route_values)
            except Exception as exc:  # noqa: BLE001 - recorded; another route may work
                attempt.error = exc
                if not _data_dependent(exc):
                    break  # the other routes would fail the same way: only data-dependent failures have one
                continue
            return Program(program, is_dynamic, attempts)
    raise ExportFailed(attempts)


def _fresh(call: Call) -> Call:
    """``call`` with new tensor objects on the same storage: a strict attempt marks its inputs' dimensions dynamic
    on the objects themselves, and a later static attempt on them would still see the marks."""
    tree = tree_of_call(call)
    return tree.rebuild([t.detach() for t in tree.leaves(call)])


# (strict, BatchNorm as its inference kernel, sizes size-oblivious, the example's tensor values), in the order tried.
_ROUTES = ((False, False, False, False), (True, False, False, False), (True, True, False, False),
           (False, True, False, False), (False, False, True, False), (False, True, True, False),
           (False, False, False, True), (False, True, False, True))


def _branch_on_values(exc: Optional[BaseException]) -> bool:
    """Whether an attempt failed on a Python branch on a tensor's values or a value read as a Python int (not on a
    size torch.export can reason about): non-strict export cannot guard on or specialise the data-dependent value,
    strict export on the branch."""
    text = f"{type(exc).__name__} {exc}" if exc is not None else ""
    return any(s in text for s in ("Could not guard on data-dependent expression", "Data-dependent branching",
                                   "Could not extract specialized integer from data-dependent expression"))


@contextlib.contextmanager
def _values_observed(on: bool) -> Iterator[None]:
    """torch.export with the example's real tensors beside the fake ones: a branch on a data-dependent value takes
    the example's way and leaves a runtime assertion (``_assert_scalar``) in the graph. torch 2.14's real-tensor
    check also compares each output's storage offset with ``!=``, which guards a symbolic offset (a ``chunk`` of a
    dynamic size) to the example's value and so fixes every size: that one comparison is left out here (the sizes
    and dtypes are still compared)."""
    if not on:
        yield
        return
    import torch._functorch.config as functorch_config
    import torch._subclasses.fake_utils as fake_utils

    checked = fake_utils._check_fake_real_tensors

    def without_offsets(real_out: torch.Tensor, fake_out: Any, context: str = "", sizes: bool = True,
                        strides: bool = False, storage_offset: bool = True, requires_grad: bool = True) -> None:
        torch._prims_common.compare_tensor_meta(real_out, fake_out, check_sizes=sizes, check_strides=strides,
                                                allow_rhs_unbacked=True)

    fake_utils._check_fake_real_tensors = without_offsets
    try:
        with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
            yield
    finally:
        fake_utils._check_fake_real_tensors = checked


def _size_oblivious(on: bool) -> Any:
    """torch's shape reasoning without the guards that a size is or is not 1 (``backed_size_oblivious``)."""
    if not on:
        return contextlib.nullcontext()
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(backed_size_oblivious=True)


def _check_runs(program: "torch.export.ExportedProgram", calls: Sequence[Call], values: bool = False) -> None:
    """The program runs on each call (other sizes of its dynamic dimensions). With the example's values captured, a
    call taking the other way of a branch on values fails the branch's assertion: that is for
    :mod:`~fx_lightning.signature.value_guards` to judge, not a failure of the sizes."""
    if not calls:
        return
    module = program.module()
    with torch.no_grad():
        for call in calls:
            try:
                call.run(module)
            except RuntimeError as exc:
                if not (values and ASSERTION_FAILED in str(exc)):
                    raise


# How a runtime assertion of torch.export's graph fails (``torch.ops.aten._assert_scalar``).
ASSERTION_FAILED = "Runtime assertion failed for expression"
