"""The one harness core: a training program is an object, and one loop (:func:`train`) runs it both
ways, sharded on every rank of either transport and unsharded in this process as the reference.

So the reference cannot drift from the sharded run: there is one step function, and what differs is
said once, by the :class:`Run` it is handed. A sharded run computes its own rank's batch; the
reference computes every rank's batch in one process and averages their losses, which is what
averaging gradients over ranks computes. Where a program must call another API when sharded (a
wrapper's ``no_sync``, its full state dict), its step asks ``run.sharded``.

Users: differential.py (drawn programs), harness.py (the named configurations), fsdp2_programs.py
(FSDP2-style programs). Launching is ranks.py's job."""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, ContextManager, Dict, List, Optional, Protocol, Sequence

import torch
import torch.nn as nn

from ranks import Rank, on_gloo, on_xla

#: XLA:CPU ranks are threads of one process sharing the CPU random generator: a program's model is
#: built (seeded) and sharded under this lock
BUILD_LOCK = threading.Lock()


@dataclasses.dataclass
class Run:
    """One run of a program. ``me``: the rank of a sharded run, None for the unsharded reference.
    ``told``: what a reference is told of the sharded run (rank 0's record), for facts only
    sharding reveals (the other names a flat shard holds). The loop's state: ``model``,
    ``optimizer``, ``losses``, ``norms`` and the program's own ``notes``."""
    world_size: int
    me: Optional[Rank] = None
    device: torch.device = torch.device("cpu")
    told: Dict[str, Any] = dataclasses.field(default_factory=dict)
    model: Any = None
    optimizer: Any = None
    losses: List[float] = dataclasses.field(default_factory=list)
    norms: List[float] = dataclasses.field(default_factory=list)
    notes: Dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def on(cls, me: Rank) -> "Run":
        return cls(me.world_size, me, me.device)

    @property
    def sharded(self) -> bool:
        return self.me is not None

    @property
    def rank(self) -> int:
        """This rank; the reference stands for every rank and answers 0 (where a program singles one
        rank out, as an overflow on rank 0, the reference sees it in every rank's batch)."""
        return self.me.rank if self.me is not None else 0

    @property
    def batch_ranks(self) -> Sequence[int]:
        """The ranks whose batches this run computes."""
        return [self.me.rank] if self.me is not None else range(self.world_size)

    def mean_over_ranks(self, loss_of_rank: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """The loss a step backpropagates: this rank's own (sharded), or the mean of every rank's
        (the reference)."""
        losses = [loss_of_rank(r) for r in self.batch_ranks]
        return losses[0] if self.sharded else torch.stack(losses).mean()

    def sync(self) -> None:
        """``xla_fsdp.sync`` on an XLA rank; nothing on eager devices."""
        if self.me is not None:
            self.me.sync()

    def barrier(self) -> None:
        if self.me is not None:
            self.me.barrier()


class TrainingProgram(Protocol):
    """What :func:`train` runs. ``build``: the unsharded model as the program writes it (seeded);
    ``shard``: the sharded run's wrapping of it; ``start``: the optimizer and whatever else the
    steps need (``run.optimizer``, ``run.notes``); ``around_steps``: a context over all steps
    (recording warnings); ``step``: one training step, the same code in both runs; ``result``:
    the run's record."""
    steps: int

    def build(self, run: Run) -> nn.Module: ...

    def shard(self, model: nn.Module, run: Run) -> nn.Module: ...

    def start(self, run: Run) -> None: ...

    def around_steps(self, run: Run) -> ContextManager[Any]: ...

    def step(self, run: Run, step: int) -> None: ...

    def result(self, run: Run) -> Dict[str, Any]: ...


def train(program: TrainingProgram, run: Run) -> Dict[str, Any]:
    """The one training loop, sharded or not."""
    with BUILD_LOCK:
        model = program.build(run)
        run.model = program.shard(model, run) if run.sharded else model
    run.sync()
    # No rank trains before every rank has built its model: torch_xla's checkpoint forks the
    # process-wide CPU RNG during backward, which would change a slower thread's initialization.
    run.barrier()
    program.start(run)
    with program.around_steps(run):
        for step in range(program.steps):
            program.step(run, step)
    return program.result(run)


def on_rank(me: Rank, program: TrainingProgram) -> Dict[str, Any]:
    """Rank ``me``'s run of ``program`` (the per-rank function of ranks.py's launchers and pools)."""
    return train(program, Run.on(me))


def reference(program: TrainingProgram, world_size: int, told: Optional[Dict[str, Any]] = None,
              device: Any = "cpu") -> Dict[str, Any]:
    """The unsharded run of ``program`` in this process, on every rank's batch."""
    return train(program, Run(world_size, device=torch.device(device), told=dict(told or {})))


def _each(me: Rank, programs: List[TrainingProgram], keep_errors: bool) -> List[Any]:
    """Rank ``me``'s runs of the programs one after the other. ``keep_errors``: a failed program
    ends the list with its error as a string (the other ranks may be stuck in a collective with
    this one); otherwise the error propagates, and the launcher ends the other ranks."""
    out: List[Any] = []
    for program in programs:
        try:
            out.append(on_rank(me, program))
        except Exception as e:  # noqa: BLE001 - reported per program by the caller
            if not keep_errors:
                raise
            out.append(f"{type(e).__name__}: {e}")
            break
    return out


def run_sharded(programs: List[TrainingProgram], world_size: int, transport: str, keep_errors: bool = False,
                **launch: Any) -> List[List[Any]]:
    """Every program on ``world_size`` ranks of ``transport`` (``"xla"``: XLA:CPU devices, threads of
    one process; ``"torch"``: gloo processes, with ``launch`` passed to ``ranks.on_gloo``), in one
    launch; per program, the rank records. A program that fails on a rank raises, unless
    ``keep_errors``: then its records are the error strings (and "did not run" for the ones after)."""
    if transport == "xla":
        per_rank = on_xla(_each, world_size, programs, keep_errors)
    else:
        per_rank = on_gloo(_each, world_size, programs, keep_errors, **launch)
    return [[per_rank[r][i] if i < len(per_rank[r]) else "did not run" for r in range(world_size)]
            for i in range(len(programs))]
