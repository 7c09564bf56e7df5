"""Small helpers over GraphModules shared by the passes."""

from __future__ import annotations

import itertools
import operator
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch import nn

from fx_lightning.errors import TraceError

__all__ = [
    "delete_unused_submodules",
    "aten_ops",
    "is_batchnorm_like",
    "is_known_batchnorm",
    "KNOWN_BATCHNORM_FORWARDS",
    "looks_like_batchnorm",
    "shape_only_use",
    "value_users",
    "node_shape",
    "node_arg",
    "owner_of",
    "known_shape",
    "call_sites",
    "get_attr_targets",
    "install_module",
    "add_constant",
    "delete_unused_attributes",
    "unique_module_stacks",
    "plain_graph_module",
    "drop_replaced_attribute",
]


def node_shape(node: Any) -> Optional[Tuple[int, ...]]:
    """Shape of the tensor a node produces, from ShapeProp's ``tensor_meta`` or export's ``val``."""
    if not isinstance(node, fx.Node):
        return None
    meta = node.meta.get("tensor_meta")
    if meta is not None and hasattr(meta, "shape"):
        return tuple(_size(s) for s in meta.shape)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(_size(s) for s in val.shape)
    return None


def known_shape(node: Any) -> Optional[Tuple[int, ...]]:
    """:func:`node_shape` when every size in it is known (none symbolic), else None."""
    shape = node_shape(node)
    return shape if shape is not None and all(size >= 0 for size in shape) else None


def _size(size: Any) -> int:
    """A dimension's size; -1 for a symbolic one without an example value (a data-dependent row count)."""
    if isinstance(size, int):
        return size
    try:
        return int(size)
    except Exception:  # noqa: BLE001 - torch raises its own guard errors for a size no example decides
        return -1


def call_sites(gm: fx.GraphModule, target: str) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_module" and n.target == target)


def get_attr_targets(gm: fx.GraphModule) -> set:
    return {n.target for n in gm.graph.nodes if n.op == "get_attr"}


def is_batchnorm_like(module: nn.Module) -> bool:
    """BatchNorm, SyncBatchNorm, _BatchNormXd, their subclasses, and torchvision's FrozenBatchNorm2d."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return True
    return type(module).__name__ == "FrozenBatchNorm2d" and all(
        hasattr(module, a) for a in ("weight", "bias", "running_mean", "running_var", "eps")
    )


# The forwards the folds know: torch's BatchNorm (every _BatchNormXd) and SyncBatchNorm.
KNOWN_BATCHNORM_FORWARDS = {nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward}


def is_known_batchnorm(module: nn.Module) -> bool:
    """A BatchNorm whose forward the folds understand, kept as one call when tracing: torch's BatchNorms and
    subclasses that keep their forward, and torchvision's FrozenBatchNorm2d. Other BatchNorm subclasses are
    traced through, so the ``F.batch_norm`` inside their forward is what the folds see."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return type(module).forward in KNOWN_BATCHNORM_FORWARDS
    return is_batchnorm_like(module) and type(module).__module__.startswith("torchvision")


def looks_like_batchnorm(module: nn.Module) -> bool:
    """Holds BatchNorm statistics (``running_mean`` and ``running_var`` tensors): a BatchNorm of some form."""
    return all(isinstance(getattr(module, a, None), torch.Tensor) for a in ("running_mean", "running_var"))


# Uses of a value that read only its shape, rank, dtype or device: they do not see the numbers, so folding a
# BatchNorm into the layer that produced the value does not change them (BatchNorm keeps the shape).
_META_ATTRIBUTES = {"ndim", "shape", "dtype", "device", "is_cuda", "layout", "requires_grad"}
_META_METHODS = {"size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous", "get_device"}
_SHAPE_DONOR_METHODS = {"reshape_as", "view_as", "expand_as"}  # x.view_as(value) reads value's shape only


def aten_ops(*names: str) -> set:
    """The aten overloads named ``"packet.overload"`` that this torch has (missing ones are left out)."""
    found = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        if op is not None:
            found.add(op)
    return found


_ATEN_META_OPS = aten_ops("sym_size.int", "sym_size.default", "sym_numel.default", "sym_stride.int",
                          "sym_storage_offset.default")
_ATEN_SHAPE_DONORS = aten_ops(*(f"{name}.default" for name in _SHAPE_DONOR_METHODS))


def shape_only_use(user: fx.Node, value: fx.Node) -> bool:
    """True when ``user`` reads only metadata of ``value`` (``.ndim``, ``.shape``, ``.size()``, the shape
    argument of ``reshape_as``/``view_as``, ``aten.sym_size``...)."""
    args = user.args
    if user.op == "call_function" and user.target is getattr:
        return len(args) >= 2 and args[0] is value and args[1] in _META_ATTRIBUTES
    if user.op == "call_function" and user.target in _ATEN_META_OPS:
        return all(a is not value for a in args[1:]) and args[0] is value
    if user.op == "call_function" and user.target is len:
        return True
    if user.op == "call_method" and user.target in _META_METHODS:
        return bool(args) and args[0] is value and all(a is not value for a in args[1:])
    if (user.op == "call_method" and user.target in _SHAPE_DONOR_METHODS) or (
            user.op == "call_function" and user.target in _ATEN_SHAPE_DONORS):
        return len(args) == 2 and args[1] is value and args[0] is not value
    return False


def value_users(node: fx.Node) -> List[fx.Node]:
    """The users of ``node`` that read its values (shape-only uses left out)."""
    return [u for u in node.users if not shape_only_use(u, node)]


def _unique_name(parent: nn.Module, base: str) -> str:
    if not hasattr(parent, base):
        return base
    for i in itertools.count(1):
        name = f"{base}_{i}"
        if not hasattr(parent, name):
            return name
    raise AssertionError  # pragma: no cover


def _ancestors(path: str) -> set:
    """``a``, ``a.b`` for ``a.b.c``: the modules that hold what ``path`` names."""
    return {".".join(path.split(".")[:i]) for i in range(1, path.count(".") + 1)}


def owner_of(gm: nn.Module, path: str) -> Tuple[nn.Module, str]:
    """(the module that holds what ``path`` names, its name there)."""
    owner_name, _, leaf = path.rpartition(".")
    return (gm.get_submodule(owner_name) if owner_name else gm), leaf


def node_arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` (positional) or ``name`` (keyword) of a call node."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def install_module(gm: fx.GraphModule, node: fx.Node, new: nn.Module, *, exclusive: bool) -> None:
    """Make ``node`` call ``new``.

    ``exclusive``: the old module is called only here and nothing reads its attributes, so ``new`` takes
    its place (same name). Otherwise ``new`` is registered beside it under a fresh name, and every other
    call site keeps the old module.
    """
    target = str(node.target)
    parent, leaf = owner_of(gm, target)
    if exclusive:
        setattr(parent, leaf, new)
        return
    name = _unique_name(parent, f"{leaf}_fused")
    parent.add_module(name, new)
    node.target = f"{target.rpartition('.')[0]}.{name}" if "." in target else name


def add_constant(gm: fx.GraphModule, node_before: fx.Node, base: str, value: torch.Tensor) -> fx.Node:
    """Register ``value`` as a new non-trainable parameter on ``gm`` and return a get_attr node for it."""
    safe = base.replace(".", "_")
    name = _unique_name(gm, f"_fused_{safe}")
    gm.register_parameter(name, nn.Parameter(value, requires_grad=False))
    with gm.graph.inserting_before(node_before):
        return gm.graph.get_attr(name)


def drop_replaced_attribute(gm: fx.GraphModule, node: Any) -> None:
    """Erase ``node`` (a get_attr a pass just stopped using) and free its tensor, if nothing else reads it.

    Passes call this as they replace each weight, so a model's unfused and fused weights are never all
    alive together (``delete_unused_attributes`` at the end of a pass would free them only then).
    """
    if not isinstance(node, fx.Node) or node.op != "get_attr" or node.users:
        return
    target = str(node.target)
    gm.graph.erase_node(node)
    prefixes = _ancestors(target)
    for n in gm.graph.nodes:
        if (n.op == "get_attr" and n.target == target) or (n.op == "call_module" and n.target in prefixes):
            return  # still read: by another get_attr, or by the forward of a module that holds it
    try:
        owner, leaf = owner_of(gm, target)
    except AttributeError:
        return
    owner._parameters.pop(leaf, None)
    owner._buffers.pop(leaf, None)


def delete_unused_attributes(gm: fx.GraphModule) -> int:
    """Drop parameters, buffers and submodules that no node reads any more; returns how many elements freed.

    ``GraphModule.delete_all_unused_submodules`` keeps parameters that lost their get_attr node (the
    originals of weights a pass replaced), which would keep the unfused weights alive in every export.
    """
    before = _numel(gm)
    used_attrs = get_attr_targets(gm)
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"} | _modules_read(gm)

    # Ancestors of anything read or called must stay (they hold it).
    ancestors = set().union(*map(_ancestors, used_attrs | called))

    def needed(full: str) -> bool:
        if full in used_attrs or full in called or full in ancestors:
            return True
        # Inside a called module: its forward reads it.
        return bool(_ancestors(full) & called)

    for full, _ in list(itertools.chain(gm.named_parameters(remove_duplicate=False), gm.named_buffers(remove_duplicate=False))):
        if not needed(full):
            owner, leaf = owner_of(gm, full)
            owner._parameters.pop(leaf, None)
            owner._buffers.pop(leaf, None)
    delete_unused_submodules(gm)
    # Containers left empty (e.g. a BatchNorm whose parameters were all dropped) go too.
    for name, mod in sorted(gm.named_modules(), key=lambda kv: -kv[0].count(".")):
        if name and not needed(name) and not any(True for _ in mod.parameters()) and not any(True for _ in mod.buffers()) and not list(mod.children()):
            delattr(*owner_of(gm, name))
    return before - _numel(gm)


def _modules_read(gm: fx.GraphModule) -> Set[str]:
    """The modules get_attr nodes read as values (a module passed to a function kept whole: torchdiffeq's
    ``odeint(self.odefunc, ...)``): everything inside them is used, as inside a called module."""
    read: Set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            try:
                gm.get_submodule(str(node.target))
            except AttributeError:
                continue
            read.add(str(node.target))
    return read


def delete_unused_submodules(gm: fx.GraphModule) -> None:
    """``GraphModule.delete_all_unused_submodules``, keeping what is inside a module a get_attr node reads (torch's
    keeps what is inside a called module only, and deleted the layers of torchdiffeq's ODE function)."""
    used: Set[str] = set()
    for node in gm.graph.nodes:
        if node.op in ("call_module", "get_attr") and isinstance(node.target, str):
            parts = node.target.split(".")
            used.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    for root in {str(n.target) for n in gm.graph.nodes if n.op == "call_module"} | _modules_read(gm):
        try:
            module = gm.get_submodule(root)
        except AttributeError:
            continue
        used.update(f"{root}.{name}" for name, _ in module.named_modules() if name)
    for name in [name for name, _ in gm.named_modules() if name and name not in used]:
        gm.delete_submodule(name)


def _numel(module: nn.Module) -> int:
    return sum(t.numel() for t in itertools.chain(module.parameters(), module.buffers()))


def module_of(gm: fx.GraphModule, node: fx.Node) -> Optional[nn.Module]:
    """The module a call_module node calls (None for other nodes); a plain ``_modules`` walk, because
    ``get_submodule``'s checks dominate the passes' time on large graphs."""
    if node.op != "call_module":
        return None
    mod: Optional[nn.Module] = gm
    for part in str(node.target).split("."):
        mod = mod._modules.get(part) if mod is not None else None
    return mod


def attr_tensor(gm: fx.GraphModule, arg: Any) -> Optional[torch.Tensor]:
    """The tensor a get_attr node reads, else None (the argument is computed, not constant)."""
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        value = operator.attrgetter(str(arg.target))(gm)
        if isinstance(value, torch.Tensor):
            return value
    return None


def unique_module_stacks(gm: fx.GraphModule) -> int:
    """Make each call of a module called at several sites (a ResNet block's ``relu``, used twice) a module of
    its own in the graph's ``nn_module_stack`` metadata, which quantisers use to find patterns: pt2e refuses a
    "partition with more than one output node" otherwise. Consecutive nodes with the same innermost module
    are one call; a later run of it is another. Returns how many calls were renamed; the graph is unchanged."""
    runs: Dict[str, int] = {}
    previous = None
    renamed = 0
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            previous = None
            continue
        key = next(reversed(stack))
        path, kind = stack[key]  # partitions are keyed on the module path, not on the stack's own keys
        if path != previous:
            runs[path] = runs.get(path, 0) + 1
            renamed += runs[path] > 1
        previous = path
        if runs[path] > 1:
            node.meta["nn_module_stack"] = {**stack, key: (f"{path}@{runs[path]}", kind)}
    return renamed


def plain_graph_module(module: nn.Module, class_name: str = "FusedModule") -> fx.GraphModule:
    """A picklable copy of a fused GraphModule with the default code generator.

    An unlifted ``torch.export`` module (capture mode ``export``) flattens its inputs with a pytree codegen,
    checks them with a ``_guards_fn`` submodule and forward pre-hooks, and refuses ``eval()``: none of that
    pickles or re-exports cleanly. The copy takes the flat tensors as arguments and rebuilds the output
    structure in the graph itself. The weights are shared with ``module``, which is not changed.
    """
    if not isinstance(module, fx.GraphModule):
        raise TraceError(
            f"expected the fused torch.fx.GraphModule (FuseResult.graph_module), got {type(module).__name__}."
        )
    graph = fx.Graph()
    out = graph.graph_copy(module.graph, {})
    for node in list(graph.nodes):
        # The export guard module only re-checks input shapes; the plain model has no use for it.
        if node.op == "call_module" and str(node.target).split(".")[-1] == "_guards_fn" and not node.users:
            graph.erase_node(node)
    info = getattr(module.graph._codegen, "pytree_info", None)
    if info is not None:
        out = _flat_io(graph, out, info)
    graph.output(out)
    for node in reversed(list(graph.nodes)):
        # Unused attribute reads (export lists every buffer, num_batches_tracked included): pure, drop them.
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    plain = fx.GraphModule(module, graph, class_name=class_name)
    plain.eval()
    return plain


def _take_apart(graph: fx.Graph, structure: Any, name: str, placeholders: List[fx.Node]) -> None:
    """One placeholder for a nested argument, and ``getitem`` nodes taking each of its leaves out of it in place
    of the leaf placeholders torch.export made (a dict of named inputs reaches the model as that dict)."""
    leaves = pytree.tree_flatten_with_path(structure)[0]
    with graph.inserting_before(leaves[0][1]):  # where the argument's own leaves were: its place in the order
        holder = graph.placeholder(name)
    cursor = holder  # each getitem right after what it reads (an unlifted export graph reads weights first)
    for path, leaf in leaves:
        value: Any = holder
        for key in path:
            with graph.inserting_after(cursor):
                value = cursor = graph.call_function(operator.getitem,
                                                     (value, getattr(key, "key", getattr(key, "idx", None))))
        leaf.replace_all_uses_with(value)
        graph.erase_node(leaf)


def _flat_io(graph: fx.Graph, out: Any, info: Any) -> Any:
    """Take the inputs as forward's positional arguments (a nested one, a dict of named inputs say, taken apart
    in the graph); rebuild the output structure in the graph."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if info.in_spec is not None:
        args, kwargs = pytree.tree_unflatten(placeholders, info.in_spec)
        if kwargs:
            raise TraceError(
                f"the fused model takes keyword inputs ({', '.join(kwargs)}); exports take positional arguments "
                "(wrap the model so forward takes them positionally)."
            )
        for i, arg in enumerate(args):
            if not isinstance(arg, fx.Node):
                _take_apart(graph, arg, f"input_{i}", placeholders)
    if info.out_spec is not None:
        flat = list(out) if isinstance(out, (tuple, list)) else [out]
        out = pytree.tree_unflatten(flat, info.out_spec)
    return out
