"""Which parameter groups a forward sends gradients to, and whether every rank agrees.

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

import warnings
from typing import Any, Callable, Iterable, List, Optional, Set, Tuple

import torch
from torch.autograd.graph import get_gradient_edge

from .tensor_tree import tensors_in

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
                if count == 0 and ref.fqn not in group.warned_unused:
                    group.warned_unused.add(ref.fqn)
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
