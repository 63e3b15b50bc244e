"""A step's gradients beyond the unit's own reduction: which gather groups a forward sends gradients to
(and whether every rank agrees), the type of a shard's gradient (:class:`ShardGrad`, below: norms and
overflow checks over the whole parameter), and the tensors inside any output (what gets backward hooks).

Which groups get gradients.

Ranks pair their reduce-scatters by order (gloo, NCCL) or by identity (XLA), so every rank must
reduce the same groups in the same order. A data-dependent branch (a layer some ranks skip in a
step) breaks that: a rank that skipped it gets no gradient for those parameters and would issue
one collective fewer. So after the root's forward each rank walks the autograd graph from the
outputs to find which groups (and which members of flat groups) will get a gradient, and the
ranks sum these bitmaps. When every rank used the same groups, backward reduces each unit's
gradients as they arrive. When not, backward holds every gradient and the end of backward
reduces, in one order on every rank, each group that some rank used, with zeros where this rank
has none: a rank that did not use a parameter contributes nothing, as in unsharded training,
and a parameter that no rank used keeps no gradient.

A flat shard whose members are only partly used is different: the optimizer steps the whole
flat tensor, so momentum, weight decay and Adam's moments move the unused members, which
unsharded training would leave alone. That cannot be undone here, so it is reported once per
parameter, with the fix.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_map

from ..collectives import Collectives


Edge = Tuple[Any, int]  # (autograd node, input number): where a tensor's gradient flows


def tensor_edge(tensor: torch.Tensor) -> Edge:
    edge = get_gradient_edge(tensor)
    return edge.node, edge.output_nr


class ForwardEdges:
    """A flat gather group's record, per member, of the gradient edges of the tensors its module
    places were given during a root's forward (recorded only while the root plans gradients): a
    member reached by none of them gets no gradient this step."""

    def __init__(self) -> None:
        self.per_member: Optional[List[List[Edge]]] = None

    def begin(self, members: int) -> None:
        self.per_member = [[] for _ in range(members)]

    def record(self, installed: Optional[List[torch.Tensor]], requires_grad: bool) -> None:
        if self.per_member is not None and installed is not None and requires_grad:
            for edges, value in zip(self.per_member, installed):
                if value.requires_grad:  # made under no_grad (a reentrant checkpoint's forward): no edge
                    edges.append(tensor_edge(value))

    def end(self) -> None:
        self.per_member = None


def reachable_edges(outputs: Any, recomputed: Optional[List[Any]] = None,
                    leaves: Optional[Set[int]] = None) -> Set[Edge]:
    """Every gradient edge of the autograd graph behind ``outputs`` (a pytree of tensors).
    ``leaves``: collects the ids of the leaf tensors whose accumulators the graph reaches (read from
    the accumulator: a leaf's own edge is found only by tracing a view of it, an op per lookup).
    ``recomputed``: collects the function of each reentrant checkpoint of the program's own in the
    graph (PyTorch's and torch_xla's keep it as ``ctx.run_function``; ``checkpoint_module``'s is
    left out): the parameters it uses are not in the graph, and get their gradients in a backward
    pass of their own, after the pass the rest of the graph runs in."""
    edges: Set[Edge] = set()
    seen: Set[Any] = set()
    stack = []
    for t in tensors_in(outputs):
        if t.requires_grad:
            node, nr = tensor_edge(t)
            edges.add((node, nr))
            if node not in seen:
                seen.add(node)
                stack.append(node)
    while stack:
        node = stack.pop()
        if leaves is not None and type(node).__name__ == "AccumulateGrad":
            leaves.add(id(node.variable))
        if (recomputed is not None and hasattr(node, "run_function")
                and not getattr(node.run_function, "recomputes_a_unit", False)):
            recomputed.append(node.run_function)
        for fn, nr in node.next_functions:
            if fn is None:
                continue
            edges.add((fn, nr))
            if fn not in seen:
                seen.add(fn)
                stack.append(fn)
    return edges


def modules_of(function: Any) -> Optional[Set[int]]:
    """Ids of the modules a reentrant checkpoint's function runs: a module, or a module's bound
    method (``self.fc``, ``self.mlp.forward``); None for any other function (a lambda, a closure),
    which may use any parameter."""
    owner = function if isinstance(function, torch.nn.Module) else getattr(function, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return {id(m) for m in owner.modules()}
    return None


class GradientPlan:
    """This step's agreement on which groups get gradients (see the module docstring).

    ``groups``: every trainable group of the root's tree, in tree order (the same on every rank);
    ``used``: per group, this rank's bitmap of members that will get a gradient.
    """

    def __init__(self, groups: List[Any], used: List[List[bool]],
                 start_sum: Callable[[List[int]], Callable[[], Optional[List[int]]]]):
        self.groups = groups
        self._used = used
        bits = [int(any(u)) for u in used] + [int(b) for u in used if len(u) > 1 for b in u]
        self._wait = start_sum(bits)
        self._counts: Optional[List[int]] = None
        self.uniform = True
        self._resolved = False
        #: gradients held until the end of backward when ranks disagree (group id -> full gradient)
        self.held: dict = {}

    def resolve(self) -> None:
        """Wait for the ranks' counts (once); decide whether backward must hold its gradients."""
        if self._resolved:
            return
        self._resolved = True
        self._counts = self._wait()  # None: the transport cannot count over ranks; assume they agree
        group_counts = self.group_counts()
        self.uniform = self._counts is None or all(c in (0, max(group_counts)) for c in group_counts)
        self._warn_partly_used_flat()

    def holds_gradients(self) -> bool:
        """Whether ranks used different groups this step, so gradients wait for the end of backward."""
        self.resolve()
        return not self.uniform

    def hold(self, group: Any, grad: torch.Tensor) -> None:
        """Keep ``group``'s full gradient for the end of backward (added up: a module recomputed
        twice by a reentrant checkpoint gives two)."""
        held = self.held
        held[id(group)] = held[id(group)] + grad if id(group) in held else grad

    def has_held(self, group: Any) -> bool:
        return id(group) in self.held

    def take_held(self, group: Any) -> Optional[torch.Tensor]:
        """The gradient held for ``group`` (None if this rank has none), no longer held."""
        return self.held.pop(id(group), None)

    def discard(self) -> None:
        """The forward had no backward: take part in the sum (every rank does), decide nothing."""
        if not self._resolved:
            self._resolved = True
            self._wait()

    def group_counts(self) -> List[int]:
        """Per group, how many ranks used it (this rank's 0/1 where ranks cannot be counted)."""
        if self._counts is None:
            return [int(any(u)) for u in self._used]
        return self._counts[:len(self.groups)]

    def _member_counts(self) -> Iterable[Tuple[Any, List[int]]]:
        """(group, per-member count of ranks that used it) for the flat groups of several members."""
        counts = self._counts
        offset = len(self.groups)
        for group, used in zip(self.groups, self._used):
            if len(used) < 2:
                continue
            if counts is None:
                yield group, [int(b) for b in used]
            else:
                yield group, counts[offset:offset + len(used)]
            offset += len(used)

    def _warn_partly_used_flat(self) -> None:
        where = "on any rank" if self._counts is not None else "on this rank"
        for group, counts in self._member_counts():
            if not any(counts):
                continue
            for ref, count in zip(group.refs, counts):
                if count == 0 and group.first_unused_report(ref.fqn):
                    warnings.warn(
                        f"xla_fsdp: parameter '{ref.fqn}' got no gradient in this step {where}, but it "
                        f"shares the flat shard '{group.flat_name}' with parameters that did. The optimizer "
                        "steps the whole flat shard, so momentum, weight decay and Adam's moments still move "
                        "it, which training without FSDP would not. Wrap with flatten_parameters=False, or "
                        "pass a flatten_group_fn that puts it in a shard of its own.",
                        UnusedFlatParameterWarning, stacklevel=2)


class UnusedFlatParameterWarning(UserWarning):
    """A member of a flat shard got no gradient while the rest of the shard did."""


def used_members(group: Any, edges: Set[Edge], hidden_modules: Set[int], leaves: Set[int]) -> List[bool]:
    """Per member of ``group``: will it get a gradient from the graph whose edges are ``edges``
    and whose accumulators are those of the tensors ``leaves`` (ids). ``hidden_modules``: ids of
    modules whose use of a parameter the graph does not show (they ran under a reentrant
    checkpoint); a member any of them holds counts as used."""
    if hidden_modules:
        hidden = [any(id(module) in hidden_modules for module, _ in ref.slots) for ref in group.refs]
    else:
        hidden = [False] * len(group.refs)
    if not group.flat:
        if group.full.grad_fn is None:  # a leaf, as a parameter is
            return [hidden[0] or id(group.full) in leaves]
        # Looked up each time, never kept: an accumulator records the parameter's shape when it is made,
        # and ``full`` changes shape between gathered and freed, so a kept one made while ``full`` was
        # freed sums every later gradient down to one element (FSDP1 and torch_xla's FSDP keep theirs:
        # their parameters' shapes do not change).
        return [hidden[0] or tensor_edge(group.full) in edges]
    return [seen or any(e in edges for e in member) for seen, member in zip(hidden, group.forward_edges.per_member)]


# ============================================================================= the shard gradient's type
# Gradients of shards that answer norms and overflow checks for the whole parameter.
#
# A shard's ``.grad`` holds this rank's block of the gradient. Programs written for unsharded
# training (and for PyTorch FSDP2, whose DTensor gradients behave this way) reduce over
# ``model.parameters()`` themselves: ``torch.nn.utils.clip_grad_norm_`` takes the norm of every
# gradient, and ``torch.amp.GradScaler`` looks for infs in them. On shards each rank would get its
# own answer (its own clip factor; an inf seen by one rank only, so ranks disagree on skipping the
# step). :class:`ShardGrad` is the shard gradient's type: those few reductions are summed (or maxed)
# over the ranks that split the parameter, so every rank gets the answer unsharded training gets:
# norms over all elements (``torch.linalg.vector_norm``, ``torch.norm``, ``Tensor.norm``,
# ``torch._foreach_norm``), ``max``/``min`` over all elements (torch_xla's own ``clip_grad_norm_``,
# which replaces torch's, takes the inf norm so), and GradScaler's ``found_inf``. ``detach()``,
# ``.data`` and ``abs()`` give the same gradient, still of this type; every other operation runs on
# the plain tensor and returns plain tensors.
#
# A norm of a shard gradient is therefore a collective: every rank of the sharding group must ask
# for it (as with FSDP2's DTensors), not rank 0 alone.


class ShardGrad(torch.Tensor):
    """A shard's gradient; ``_xla_fsdp_sharding`` is (collectives of its sharding group, channel)."""

    _xla_fsdp_sharding: Tuple[Collectives, int]

    def _plain(self) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            return self.detach()

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Saved (``torch.save``, pickling) as the plain tensor it is: readable with ``weights_only=True``."""
        return self._plain().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: Dict[int, Any]) -> torch.Tensor:
        """A copy is a plain tensor: it is no longer this parameter's gradient."""
        return self._plain().clone()

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in _HANDLED:  # the fast path (an optimizer's element-wise reads): run as a plain tensor
            return _AS_PLAIN(func, types, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
            handler = _GLOBAL.get(func)
            if handler is not None:
                result = handler(result, args, kwargs)
            elif (func in _SAME_GRADIENT and isinstance(args[0], ShardGrad) and isinstance(result, torch.Tensor)
                  and result is not args[0]):
                result = as_shard_grad(result, *args[0]._xla_fsdp_sharding)
        return result


def as_shard_grad(grad: torch.Tensor, comms: Collectives, channel: int) -> torch.Tensor:
    """``grad`` itself, a tensor the unit just made, retyped as a :class:`ShardGrad` of a group
    sharded over ``comms``. Not ``as_subclass``: that makes an alias, and on XLA an alias is a view
    whose graph still holds the reduce-scatter, so reading it on one rank ran the collective again
    (an XLA rendezvous abort). Without sharding (one rank: NO_SHARD, the SPMD mode's logical rank)
    it stays plain."""
    if comms.world_size == 1 or isinstance(grad, ShardGrad):
        return grad
    grad.__class__ = ShardGrad
    grad._xla_fsdp_sharding = (comms, channel)
    return grad


def run_shard_hooks(shard: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:
    """Hooks the program registered on the shard (``register_hook``) see its gradient block
    before it is added to ``.grad`` and may replace it, as autograd does for a leaf. The shard is
    never in the autograd graph, so without this they would never run."""
    for hook in list((shard._backward_hooks or {}).values()):
        replaced = hook(reduced)
        if replaced is not None:
            reduced = replaced
    return reduced


def run_post_accumulate_hooks(shard: torch.Tensor) -> None:
    """``register_post_accumulate_grad_hook`` hooks on the shard (an optimizer step in backward):
    run once the reduced block is in ``shard.grad``, as autograd would."""
    for hook in list((shard._post_accumulate_grad_hooks or {}).values()):
        hook(shard)


# ----------------------------------------------------------------------------- norms
def _order(args: Sequence[Any], kwargs: Dict[str, Any], position: int, names: Sequence[str], default: Any) -> Any:
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return args[position] if len(args) > position else default


def _whole(args: Sequence[Any], kwargs: Dict[str, Any], position: int) -> bool:
    """Whether the norm runs over every element (no ``dim``)."""
    dim = kwargs.get("dim", args[position] if len(args) > position else None)
    return dim is None or (isinstance(dim, (tuple, list)) and len(dim) == args[0].dim())


def combine_norms(local: List[torch.Tensor], ords: List[float], sharding: List[Optional[Tuple[Collectives, int]]]
             ) -> List[torch.Tensor]:
    """Whole-parameter norms from per-rank shard norms: ``(sum |x|^p)^(1/p)`` over the ranks
    (max for inf, min for -inf, a sum of counts for 0), one all-gather per sharding group."""
    out = list(local)
    by_group: Dict[int, List[int]] = {}
    for i, s in enumerate(sharding):
        if s is not None:
            by_group.setdefault(id(s[0]), []).append(i)
    for indices in by_group.values():
        comms, channel = sharding[indices[0]]
        values = []
        for i in indices:
            v, p = local[i].detach().float().reshape(()), ords[i]
            values.append(v.pow(p) if p not in (0.0, math.inf, -math.inf) else v)
        gathered = comms.all_gather(torch.stack(values).to(comms.device), channel).view(comms.world_size, len(indices))
        for column, i in enumerate(indices):
            column_values, p = gathered[:, column], ords[i]
            if p == math.inf:
                total = column_values.max()
            elif p == -math.inf:
                total = column_values.min()
            elif p == 0.0:
                total = column_values.sum()
            else:
                total = column_values.sum().pow(1.0 / p)
            out[i] = total.to(local[i].device, local[i].dtype).reshape(local[i].shape)
    return out


def norm_order(ord_: Any) -> float:
    if ord_ is None or ord_ == "fro":
        return 2.0
    if isinstance(ord_, str):
        raise RuntimeError(f"xla_fsdp: the '{ord_}' norm of a shard gradient cannot be formed from its "
                           "shards; gather the full gradient first (xla_fsdp.checkpoints / summon) or use a "
                           "vector norm")
    return float(ord_)


def _refuse_partial(func_name: str) -> None:
    raise RuntimeError(f"xla_fsdp: {func_name} over some dimensions of a shard gradient would be this rank's "
                       "block only; take the norm over all elements (no dim), which xla_fsdp sums over the "
                       "ranks, or gather the full gradient first")


def _whole_norm(what: str, ord_name: str) -> Callable[[Any, Sequence[Any], Dict[str, Any]], Any]:
    """``torch.linalg.vector_norm`` (order ``ord``), ``torch.norm`` and ``Tensor.norm`` (order ``p``): a
    vector norm over all elements unless ``dim`` is given, summed over the ranks."""
    def handler(result: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        tensor = args[0]
        if not isinstance(tensor, ShardGrad):
            return result
        if not _whole(args, kwargs, 2):
            _refuse_partial(what)
        p = norm_order(_order(args, kwargs, 1, (ord_name,), 2))
        return combine_norms([result], [p], [tensor._xla_fsdp_sharding])[0]
    return handler


def _linalg_norm(result: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """``torch.linalg.norm``: the vector norm of a 1-D shard, or the Frobenius norm; a matrix
    norm (spectral, nuclear, ...) of a dim-0 shard cannot be formed from shards."""
    tensor = args[0]
    if not isinstance(tensor, ShardGrad):
        return result
    if not _whole(args, kwargs, 2):
        _refuse_partial("torch.linalg.norm")
    ord_ = _order(args, kwargs, 1, ("ord",), None)
    if tensor.dim() == 2 and ord_ not in (None, "fro"):
        norm_order(str(ord_))
    return combine_norms([result], [norm_order(ord_)], [tensor._xla_fsdp_sharding])[0]


def _foreach_norm(result: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    tensors = args[0]
    p = norm_order(_order(args, kwargs, 1, ("ord",), 2))
    sharding = [t._xla_fsdp_sharding if isinstance(t, ShardGrad) else None for t in tensors]
    return tuple(combine_norms(list(result), [p] * len(result), sharding))


def _non_finite_check(result: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """``GradScaler.unscale_``: an inf in any rank's block is an inf for every rank of its group."""
    grads = args[0]
    found_inf = _order(args, kwargs, 1, ("found_inf",), None)
    seen = set()
    for g in grads:
        if isinstance(g, ShardGrad) and id(g._xla_fsdp_sharding[0]) not in seen:
            comms, channel = g._xla_fsdp_sharding
            seen.add(id(comms))
            gathered = comms.all_gather(found_inf.detach().float().reshape(1).to(comms.device), channel)
            found_inf.copy_(gathered.max().to(found_inf.device, found_inf.dtype).reshape(found_inf.shape))
    return result


def _extreme(largest: bool) -> Callable[[Any, Sequence[Any], Dict[str, Any]], Any]:
    """``max``/``amax`` (``largest``) or ``min``/``amin`` over every element: torch_xla's own
    ``clip_grad_norm_`` takes the inf norm so."""
    def handler(result: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        tensor = args[0]
        if not isinstance(tensor, ShardGrad) or len(args) > 1 or kwargs or not isinstance(result, torch.Tensor):
            return result
        comms, channel = tensor._xla_fsdp_sharding
        gathered = comms.all_gather(result.detach().reshape(1).to(comms.device), channel)
        total = gathered.max() if largest else gathered.min()
        return total.to(result.device, result.dtype).reshape(result.shape)
    return handler


_GLOBAL: Dict[Callable, Callable[[Any, Sequence[Any], Dict[str, Any]], Any]] = {
    torch.linalg.vector_norm: _whole_norm("torch.linalg.vector_norm", "ord"),
    torch.linalg.norm: _linalg_norm,
    torch.norm: _whole_norm("a norm", "p"),
    torch.Tensor.norm: _whole_norm("a norm", "p"),
    torch._foreach_norm: _foreach_norm,
    torch._amp_foreach_non_finite_check_and_unscale_: _non_finite_check,
    torch.Tensor.max: _extreme(True), torch.max: _extreme(True), torch.Tensor.amax: _extreme(True),
    torch.amax: _extreme(True), torch.Tensor.min: _extreme(False), torch.min: _extreme(False),
    torch.Tensor.amin: _extreme(False), torch.amin: _extreme(False),
}
#: operations whose result is the same gradient (a detached alias, its magnitudes): still a ShardGrad
_SAME_GRADIENT = {torch.Tensor.detach, torch.Tensor.data.__get__, torch.Tensor.abs, torch.abs}
#: what ShardGrad answers itself; everything else runs as on a plain tensor, in C (no Python context)
_HANDLED = frozenset(_GLOBAL) | frozenset(_SAME_GRADIENT)
_AS_PLAIN = torch._C._disabled_torch_function_impl


# ============================================================================= tensors inside any output
# The tensors inside a module's inputs and outputs, wherever they sit: PyTorch's pytree containers (tuples,
# lists, dicts, named tuples, Hugging Face ``ModelOutput`` s) and, beyond what pytree knows, dataclass
# instances (a plain ``@dataclass`` output). A unit that missed an output tensor would register no backward
# hook on it: its backward would run on freed parameters.


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with ``fn(t)`` for every tensor ``t`` (dataclasses copied, their class kept)."""
    def visit(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if _is_dataclass_instance(x):
            new = copy.copy(x)
            for field in dataclasses.fields(x):
                object.__setattr__(new, field.name, map_tensors(fn, getattr(x, field.name)))
            return new
        return x
    return tree_map(visit, tree, is_leaf=_is_dataclass_instance)


def tensors_in(tree: Any) -> List[torch.Tensor]:
    """Every tensor in ``tree``, in order."""
    found: List[torch.Tensor] = []
    for leaf in tree_flatten(tree, is_leaf=_is_dataclass_instance)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif _is_dataclass_instance(leaf):
            found.extend(tensors_in([getattr(leaf, f.name) for f in dataclasses.fields(leaf)]))
    return found
