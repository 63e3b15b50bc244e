"""The small interface the sharding algorithm talks to, so it never knows which transport carries it."""
from __future__ import annotations

import abc
import io
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch


class Collectives(abc.ABC):
    """Collectives over one sharding group, plus the few device-specific tensor operations FSDP needs.

    ``channel`` arguments name one logical collective of a training step (the same integer on every
    rank). Transports whose rendezvous needs such an identity (XLA:CPU with several devices in one
    process) use it; the others ignore it.
    """

    name: str = "abstract"
    #: rank and size of the sharding group (the ranks that split a parameter between them)
    rank: int
    world_size: int
    #: the sharding groups, as global ranks (one group of all ranks when no groups were given)
    groups: List[List[int]]
    #: groups whose members hold the same shard and all-reduce gradient shards (hybrid, NO_SHARD);
    #: empty when every rank's shard is unique
    replica_groups: List[List[int]] = []

    #: this rank's index among all ranks
    global_rank: int

    @property
    def num_replicas(self) -> int:
        return len(self.replica_groups[0]) if self.replica_groups else 1

    @property
    def replica_rank(self) -> int:
        """Which copy of the shard this rank holds (0 on the ranks that write checkpoints)."""
        for group in self.replica_groups:
            if self.global_rank in group:
                return group.index(self.global_rank)
        return 0

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Device on which shards and full parameters live."""

    @abc.abstractmethod
    def all_gather(self, shard: torch.Tensor, channel: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Concatenate every rank's ``shard`` along dim 0 (into ``out`` when given)."""

    @abc.abstractmethod
    def reduce_scatter(self, full: torch.Tensor, channel: int, scale: float = 1.0) -> torch.Tensor:
        """Sum ``full`` over ranks and return this rank's equal dim-0 block of the sum, times ``scale``."""

    def start_all_gather(self, shard: torch.Tensor, channel: int) -> Callable[[], torch.Tensor]:
        """Begin :meth:`all_gather`; the returned function waits for it and returns the result
        (at once on lazy transports, see :meth:`start_reduce_scatter`)."""
        result = self.all_gather(shard, channel)
        return lambda: result

    def start_reduce_scatter(self, full: torch.Tensor, channel: int, scale: float = 1.0) -> Callable[[], torch.Tensor]:
        """Begin :meth:`reduce_scatter`; the returned function waits for it and returns the block.

        Eager transports return at once so the rest of backward computes while the gradient is
        on the wire (as DDP's buckets do); lazy ones (XLA) leave the scheduling to the compiler."""
        block = self.reduce_scatter(full, channel, scale)
        return lambda: block

    @abc.abstractmethod
    def all_reduce_sum(self, tensor: torch.Tensor, channel: int) -> torch.Tensor:
        """Sum a small tensor over the sharding group (used for gradient norms)."""

    @abc.abstractmethod
    def all_reduce_replicas(self, tensor: torch.Tensor, channel: int) -> torch.Tensor:
        """Sum a gradient shard over this rank's replica group (identity without replicas)."""

    # --- how a full parameter is filled and freed while staying the same autograd leaf ---
    @abc.abstractmethod
    def gather_into(self, full: torch.Tensor, shard: torch.Tensor, channel: int,
                    padded_shape: Tuple[int, ...], unpad: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """All-gather ``shard`` (cast to ``full.dtype``) into the padded ``padded_shape`` buffer and
        make ``full`` hold ``unpad(buffer)``."""

    def start_gather_into(self, full: torch.Tensor, shard: torch.Tensor, channel: int,
                          padded_shape: Tuple[int, ...], unpad: Callable[[torch.Tensor], torch.Tensor],
                          alias_ok: bool = True) -> Callable[[], object]:
        """Begin :meth:`gather_into`; ``full`` may be read only after the returned function ran.
        ``alias_ok``: ``shard`` is the persistent master, which ``full`` may share storage with at
        one rank; False for a transient copy (host offload), which ``full`` must copy."""
        self.gather_into(full, shard, channel, padded_shape, unpad)
        return lambda: None

    #: whether collectives run in the background while the caller computes (eager transports):
    #: then units prefetch the next unit's parameters
    overlaps: bool = False

    @abc.abstractmethod
    def fill_full(self, full: torch.Tensor, data: torch.Tensor, padded_shape: Tuple[int, ...],
                  unpad: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Make ``full`` hold ``unpad(data)``, ``data`` being already-gathered padded values (in rank
        order, any shape with ``prod(padded_shape)`` elements)."""

    #: whether a view of ``full`` kept from before a free sees the next gather's data (eager
    #: storage does; a lazy transport's views hold the IR value they were cut from)
    views_see_refills: bool = True

    #: whether a unit's groups share one all-gather and one reduce-scatter (see gather_group)
    coalesces: bool = False

    #: whether :meth:`reduce_scatter`'s ``scale`` is part of the collective itself (XLA multiplies
    #: the sum in the same op), so a division moved into it is one op less to trace per gradient
    scales_in_collective: bool = False

    #: whether the step is traced into one compiled program (XLA), whose scheduler puts each
    #: gather next to its use: a unit's parameters kept from forward for backward (see
    #: ``Schedule.end_forward``) then only live longer and raise the peak
    compiles_step: bool = False

    #: whether ``full`` takes an in-place edit (a module clamping its weight in forward) as eager
    #: storage does; XLA's ``full`` is born a broadcast view (see ``new_full``), whose in-place ops
    #: write through to its one-element base and come back as other values
    takes_in_place_edits: bool = True

    @abc.abstractmethod
    def free(self, full: torch.Tensor) -> None:
        """Release the memory behind ``full``; the next ``gather_into`` refills it."""

    @abc.abstractmethod
    def new_full(self, shape: Tuple[int, ...], padded_numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A ``shape`` tensor that ``gather_into`` can fill from a padded buffer; the caller
        wraps it in a Parameter and calls :meth:`free` before its data is ever used."""

    @abc.abstractmethod
    def is_allocated(self, full: torch.Tensor) -> bool:
        """Whether ``full`` currently holds gathered memory of its own (for memory checks and tests)."""

    def aliases_shard(self, full: torch.Tensor) -> bool:
        """Whether ``full`` is a view of the shard itself (one rank, no cast): nothing to free."""
        return False

    def allocate_channels(self, count: int) -> int:
        """Reserve ``count`` consecutive channel ids; returns the first (0 where unused)."""
        return 0

    def start_sum_over_ranks(self, values: Sequence[int]) -> Callable[[], Optional[List[int]]]:
        """Begin summing a short list of integers over every rank that trains the model (shard
        groups and their replicas); the returned function waits and gives the sums, or None where
        this transport cannot tell (then callers assume all ranks alike). Every rank must call it
        at the same point. Default: one rank, nothing to sum."""
        result = list(values)
        return lambda: result

    def meet(self, call: str) -> Tuple[List[int], float]:
        """Wait until every rank of the job reached ``call`` (a function each rank calls, such as a
        save), outside any collective, warning once while one is late. Returns the ranks that did not
        come within the job's timeout (then the caller raises, naming them) and that timeout. A rank
        that never comes (a call under ``if rank == 0:``) is named this way before the caller's first
        collective, which would abort or hang on the mismatch. Default: one rank, always there."""
        return [], 0.0

    #: whether the ranks are threads of one process, drawing from one CPU random generator (XLA:CPU,
    #: one-process TPU hosts): their models agree only if they take rank 0's (``sync_module_states``)
    ranks_share_a_process: bool = False

    def broadcast_from_rank_0(self, tensor: torch.Tensor) -> torch.Tensor:
        """Global rank 0's value of ``tensor`` (same shape on every rank), on every rank of the job
        (``sync_module_states``). Default: one rank, its own value."""
        return tensor

    def broadcast_object_from_rank_0(self, value: Any) -> Any:
        """Global rank 0's ``value`` (a state dict: tensors, containers, numbers, strings) on every rank,
        through :meth:`broadcast_from_rank_0` as bytes (its length first): ``set_state_dict(...,
        broadcast_from_rank0=True)`` on any transport, the ``xla`` process group included, whose
        ``broadcast_object_list`` fails inside torch_xla on host tensors. Read back with
        ``weights_only=True``; the other ranks' ``value`` is ignored."""
        mine = b""
        if self.global_rank == 0:
            buffer = io.BytesIO()
            torch.save(value, buffer)
            mine = buffer.getvalue()
        length = int(self.broadcast_from_rank_0(torch.tensor([len(mine)], dtype=torch.int64)).item())
        data = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else torch.zeros(length, dtype=torch.uint8)
        data = self.broadcast_from_rank_0(data)
        return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=True)

    def start_broadcast_from_rank_0(self, tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
        """:meth:`broadcast_from_rank_0` begun now and taken by the returned call. Every rank starts
        in the same order; where ranks are threads of one process (``ranks_share_a_process``) no rank
        waits until it takes. Default: the whole broadcast when taken."""
        return lambda: self.broadcast_from_rank_0(tensor)

    def check_construction(self) -> None:
        """Raise if ranks built different units (transports whose pairing depends on it)."""

    def optimization_barrier(self, tensors: Sequence[torch.Tensor]) -> None:
        """Stop the compiler from moving work across this point (no-op for eager transports)."""

    def step_mark(self) -> Any:
        """Something that later tells whether a step marker (a graph cut: ``torch_xla.sync()``) ran
        since it was made (:meth:`marked_since`); None where steps are not traced."""
        return None

    def marked_since(self, mark: Any) -> bool:
        """Whether a step marker ran since :meth:`step_mark` made ``mark``."""
        return True

    def to_host(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Small tensors (the ranks' fingerprints) read back on the host. Default: each as ``.cpu()``."""
        return [t.detach().cpu() for t in tensors]

    def sync(self, keep_rng: bool = True, why: Optional[str] = None) -> None:
        """Run pending device work (no-op for eager transports). ``keep_rng``: a cut the package makes
        for itself leaves the device's random state as the program would have it without the cut;
        False where the cut stands for the program's own step marker (``sync_on_finalization``).
        ``why``: the cause and the way around it, for the warning when draws came before the cut."""
