"""Differential testing: a randomly drawn training program run sharded on N real ranks and
unsharded in one process on the global batch, compared by original names.

A :class:`Program` picks one value on every dimension below; ``programs()`` is the hypothesis
strategy over them. Each program trains a few steps both ways and compares losses, clip norms,
the full state dict gathered from the live model, the consolidated per-rank ``state_dict()`` s and
the optimizer state (Adam moments, SGD momentum) by parameter name.

Tolerances: fp32 compute 2e-5 (absolute on losses and tensors, relative on gradient norms; eager
and XLA:CPU fuse differently); bf16 compute 5e-2 absolute on losses and 1e-1 on tensors (the
reference computes in fp32, so this bounds bf16 rounding over a few steps, not a bit-exact match:
the wrong-reduction self-test runs in fp32); the same for fp32 parameters under autocast to bf16.

Semantics that cannot equal unsharded training, and are kept out of the drawn programs (each has
its own test): a flat shard only partly used in a step (warned, see ``xla_fsdp.unit.gradients``),
BatchNorm running statistics (each rank's forward updates its own; they are not compared), and
dropout (each rank draws masks for its own batch from its own generator; the reference draws one
mask for the global batch: test_user_programs compares seeded dropout with every rank on the same
batch). Refusals are not drawn either (tying after wrapping, a weight clamped in forward on XLA):
their errors have tests of their own.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import threading
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

import xla_fsdp
import cpu_kernels
from training_program import Run
from xla_fsdp import XlaFullyShardedDataParallel as FSDP, checkpoint_module
from xla_fsdp.checkpoints import (full_optim_state_dict, full_state_dict, load_full_optim_state_dict,
                                  load_full_state_dict)
from xla_fsdp.checkpoints.shard_merge import consolidate_sharded_state_dicts
from xla_fsdp.unit.base import is_unit, root_unit
from xla_fsdp.wrap import size_based_auto_wrap_policy

PER_RANK = 3
VOCAB, WIDTH = 16, 8


@dataclasses.dataclass(frozen=True)
class Program:
    strategy: str = "FULL_SHARD"       # or SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2
    layout: str = "param"              # param | flat | dim0
    wrap: str = "nested"               # root | nested | auto | fully_shard (FSDP2's API: blocks then root; XLA)
    dtype: str = "fp32"                # fp32 | bf16
    optimizer: str = "sgd"             # sgd (momentum, weight decay) | adamw | adamw_groups
    embedding: bool = False            # integer inputs through nn.Embedding
    batchnorm: bool = False
    scalar: bool = True                # a 0-d learnable temperature
    frozen: bool = False               # the first block's linear layer is frozen
    branch: str = "all"                # which ranks use the branch layer in a step: all | steps (every rank,
    #                                    even steps only) | ranks (rank + step even) | none
    twice: bool = False                # the first block runs again after the second
    remat: bool = False                # activation checkpointing on the blocks (checkpoint_module)
    addmm: bool = False                # the blocks' layer is GPT-2's Conv1D: addmm saves the weight itself
    tied: str = "none"                 # the first block's weight also used by: none | blocks (the second
    #                                    block) | late (a root-level layer after the blocks)
    micro: int = 1                     # micro-batches per step (no_sync before the last)
    clip: Optional[float] = None
    eval_before_reload: bool = False   # a forward with grad and no backward before the reload
    reload: bool = False               # load the state saved after step 0 before step 2 (both runs)
    steps: int = 3
    wrong_reduction: bool = False      # self-test: sum gradients over ranks instead of averaging
    # Programs as users write them:
    toggle: str = "none"               # at step 1, requires_grad of the shards holding blocks.0.fc.weight is
    #                                    set False (freeze) or True (unfreeze: it is frozen at wrap if `frozen`)
    clip_by: str = "model"             # with clip: model.clip_grad_norm_ | torch (torch.nn.utils.clip_grad_norm_
    #                                    over model.parameters(), as the PyTorch and FSDP2 tutorials write it)
    scaler: bool = False               # torch.amp.GradScaler; at step 1 one element of head.weight's
    #                                    gradient is inf on rank 0 only (a hook): every rank must skip the step
    hook: bool = False                 # a gradient hook registered before wrapping zeroes inp.weight's rows 0-1
    output: str = "tensor"             # what the model and its blocks return: tensor | tuple | dict | dataclass
    reinit: bool = False               # at step 1: model.apply(init) (zeroed biases, halved weights, LayerNorm
    #                                    scales reset) and an in-place edit of head.weight under torch.no_grad()
    rnn: bool = False                  # an nn.LSTM after the input layer (its own unit when auto-wrapped)
    offload: bool = False              # cpu_offload=True: shards, gradients and optimizer state on the host
    int_reshard: bool = False          # fully_shard: reshard_after_forward as FSDP2's int (the world size for
    #                                    ZeRO-3 blocks, 1 for ZeRO-2 ones) instead of the bool
    prefetch: bool = False             # fully_shard: each block lists the other in set_modules_to_forward_prefetch
    #                                    (the first) or ..._backward_prefetch (the second); False: FSDP2's default
    # Programs as users write them (the second set):
    clamp: bool = False                # blocks.1 clamps its fc.weight to [-0.3, 0.3] in place in forward (under
    #                                    torch.no_grad()): the edit stays, as unsharded. Eager devices and
    #                                    unflattened only: refused on XLA, and PyTorch refuses it on a split view
    inner_ckpt: bool = False           # each block runs its fc through the program's own reentrant checkpoint
    #                                    (inside checkpoint_module's when remat): torch's, torch_xla's on XLA
    autocast: bool = False             # the sharded forward runs under torch.autocast(<device>, bfloat16) over
    #                                    fp32 parameters (the reference in fp32: bf16 tolerances)
    # The third set:
    recipe: str = "api"                # adamw_groups' groups: api (model.optimizer_param_groups, by original name) |
    #                                    name (transformers' ["bias", "LayerNorm.weight"] on named_parameters()) |
    #                                    dim (nanoGPT's p.dim() < 2) applied to what the program sees: the shards.
    #                                    Where that splits the originals otherwise, the first step must refuse
    drop_empty: bool = False           # the recipe drops an empty group ([g for g in groups if g["params"]])
    teacher: bool = False              # an EMA teacher: a second root built alike, frozen before wrapping and
    #                                    wrapped alike; its output is a target, zip(parameters()) updates it

    # The harness protocol (training_program.py): one step function for the sharded run on each
    # rank and for the unsharded reference.

    def build(self, run: Run) -> nn.Module:
        torch.manual_seed(0)
        net = Net(self)
        run.notes["hooks"] = StepState(run.rank)  # the reference's overflow: in rank 0's batch, which it runs
        add_hooks(self, net, run.notes["hooks"])
        if self.teacher:  # DINO / BYOL: the same weights, frozen before it is wrapped (see teacher_frozen_after)
            torch.manual_seed(0)
            teacher = run.notes["teacher"] = Net(self)
            if not teacher_frozen_after(self):
                teacher.requires_grad_(False)
        if self.recipe != "api" and run.sharded:  # the original parameters, for recipe_splits_otherwise
            with torch.random.fork_rng(devices=[]):
                run.notes["originals"] = Net(self)
        return net

    def shard(self, model: nn.Module, run: Run) -> nn.Module:
        return wrap(self, model, run.world_size)

    def start(self, run: Run) -> None:
        if self.teacher and run.sharded:  # (not under the build lock: wrapping on XLA meets the other ranks)
            run.notes["teacher"] = wrap(self, run.notes["teacher"], run.world_size).requires_grad_(False)
        if self.toggle == "none":
            toggled: List[str] = []
        elif run.sharded:
            toggled = toggled_names(self, run.model)
        else:  # the names the sharded run toggled (its flat shards may hold more than blocks.0.fc)
            toggled = run.told.get("toggled") or ["blocks.0.fc.weight", "blocks.0.fc.bias"]
        run.notes.update(toggled=toggled, scaler=make_scaler(self, run.device), saved=None)
        if self.wrong_reduction and run.sharded:
            run.model.set_gradient_divide_factors(1.0, 1.0)  # sums over ranks: the self-test's bug
        run.optimizer = make_optimizer(self, run.model)
        # a recipe applied to the shards: refused at the first step exactly where it splits the originals otherwise
        run.notes["refusal"] = run.sharded and self.optimizer == "adamw_groups" and recipe_splits_otherwise(
            self, run.model, run.notes.get("originals"))

    def around_steps(self, run: Run) -> Any:
        return _RecordedWarnings(run)

    def step(self, run: Run, step: int) -> None:
        p, model, opt, notes = self, run.model, run.optimizer, run.notes
        if notes.get("refused"):
            return
        scaler = notes["scaler"]
        notes["hooks"].step = step
        if step == 1 and notes["toggled"]:
            set_requires_grad(p, model, notes["toggled"])
        if step == 1 and p.reinit:
            reinit(model)
            run.sync()
        if p.reload and step == 2:
            if p.eval_before_reload:  # an eval pass without torch.no_grad(), never backward
                model(batch(p, 99, 0, run.rank)[0].to(run.device))
                run.sync()
            _load_saved(run)
        opt.zero_grad()
        total = 0.0
        for k in range(p.micro):
            def loss_of(r: int, k: int = k) -> torch.Tensor:
                x, y = batch(p, step, k, r)
                x, y, branch = x.to(run.device), y.to(run.device), uses_branch(p, step, r)
                return _loss(p, model, x, y, branch, notes.get("teacher"))
            with _accumulating(p, run, k == p.micro - 1):
                # autocast: the sharded forward only (the reference in fp32, held to bf16 tolerances)
                with torch.autocast(run.device.type, torch.bfloat16, enabled=p.autocast and run.sharded):
                    loss = run.mean_over_ranks(loss_of)
                (scaler.scale(loss) if scaler is not None else loss).backward()
            run.sync()
            total += loss.item()
        if notes["refusal"]:
            notes["refused"] = refused_step(p, model, opt, scaler, run.norms)
            run.sync()  # the clip's collectives before it (the next program is wrapped under the build lock)
            return
        optimizer_step(p, model, opt, scaler, run.norms)
        run.sync()
        if p.teacher:
            update_teacher(model, notes["teacher"])
            run.sync()
        run.losses.append(total)
        if p.reload and step == 0:
            notes["saved"] = _save(run)

    def result(self, run: Run) -> Dict[str, Any]:
        model, opt, scaler = run.model, run.optimizer, run.notes["scaler"]
        if run.notes.get("refused"):
            return {"refused": run.notes["refused"]}
        common = {"losses": run.losses, "norms": run.norms, "scale": scaler.get_scale() if scaler is not None else None}
        teacher = run.notes.get("teacher")
        if not run.sharded:
            names = {id(q): n for n, q in model.named_parameters()}
            ordered = [names[id(q)] for g in opt.param_groups for q in g["params"]]
            optim = {ordered[i]: s for i, s in opt.state_dict()["state"].items()}
            return dict(common, full=model.state_dict(), optim=optim,
                        teacher=teacher.state_dict() if teacher is not None else None)
        return dict(common, toggled=run.notes["toggled"], warnings=run.notes["warnings"],
                    teacher=full_state_dict(teacher, rank0_only=False) if teacher is not None else None,
                    full=full_state_dict(model, rank0_only=False),
                    optim=full_optim_state_dict(model, opt, rank0_only=False),
                    # (fully_shard: its unit's, whose keys the metadata names)
                    state_dict={k: v.detach().cpu().clone() for k, v in root_unit(model).state_dict().items()},
                    metadata=root_unit(model).get_shard_metadata())


def programs(world_size: int, device_type: str = "cpu") -> st.SearchStrategy[Program]:
    """The drawn programs of the module docstring that run on ``device_type`` here (see runs_here)."""
    strategies = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
    if world_size >= 4:
        strategies += ["HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
    program = st.builds(
        Program, strategy=st.sampled_from(strategies), layout=st.sampled_from(["param", "flat", "dim0"]),
        wrap=st.sampled_from(["root", "nested", "auto"]), dtype=st.sampled_from(["fp32", "fp32", "bf16"]),
        optimizer=st.sampled_from(["sgd", "adamw", "adamw_groups"]), embedding=st.booleans(),
        batchnorm=st.booleans(), scalar=st.booleans(), frozen=st.booleans(),
        branch=st.sampled_from(["all", "steps", "ranks", "none"]), twice=st.booleans(), remat=st.booleans(),
        addmm=st.booleans(), tied=st.sampled_from(["none", "blocks", "late"]),
        micro=st.sampled_from([1, 1, 2]), clip=st.sampled_from([None, None, 0.05]),
        eval_before_reload=st.booleans(), reload=st.booleans(), steps=st.integers(3, 4),
        toggle=st.sampled_from(["none", "none", "freeze", "unfreeze"]), clip_by=st.sampled_from(["model", "torch"]),
        scaler=st.sampled_from([False, False, True]), hook=st.booleans(),
        output=st.sampled_from(["tensor", "tuple", "dict", "dataclass"]), reinit=st.booleans(), rnn=st.booleans(),
        offload=st.sampled_from([False, False, True]),
        clamp=st.sampled_from([False, False, True]), inner_ckpt=st.booleans(),
        autocast=st.sampled_from([False, False, True]), recipe=st.sampled_from(["api", "name", "dim"]),
        drop_empty=st.booleans(), teacher=st.sampled_from([False, False, True]))
    return program.filter(functools.partial(_exact, world_size=world_size)).filter(
        functools.partial(runs_here, device_type=device_type))


#: programs drawn and not run because this machine cannot run them unsharded either: the kernel's
#: reason -> the programs (each once, however often hypothesis offers it)
NOT_APPLICABLE: Dict[str, set] = {}


def kernels_needed(p: Program, device_type: str) -> List[str]:
    """The CPU kernels of ``cpu_kernels.PROBES`` that the program runs, unsharded as sharded."""
    if device_type != "cpu":
        return []  # XLA compiles its own kernels
    return ["nn.LSTM under CPU bf16 autocast"] if p.rnn and p.autocast else []


def runs_here(p: Program, device_type: str) -> bool:
    """False for a program that needs a kernel this machine's CPU lacks (the unsharded program fails
    the same way, with no FSDP anywhere): it is noted in NOT_APPLICABLE, and hypothesis draws another in
    its place. A program the unsharded reference can run is always drawn: if the sharded run cannot,
    that is a failure."""
    reasons = [f"{kernel}: {why}" for kernel in kernels_needed(p, device_type)
               if (why := cpu_kernels.missing(kernel)) is not None]
    for reason in reasons:
        NOT_APPLICABLE.setdefault(reason, set()).add(p)
    return not reasons


def fully_shard_programs(world_size: int) -> st.SearchStrategy[Program]:
    """Programs written against FSDP2's API (``xla_fsdp.fully_shard`` on the blocks, the branch and
    then the root; dim-0 shards; ZeRO-3 or ZeRO-2 blocks; bf16 through ``MixedPrecisionPolicy``;
    ``CPUOffloadPolicy``; accumulation with ``set_requires_gradient_sync``), for XLA devices: on the
    torch transport ``fully_shard`` is PyTorch's own, whose modules lack the wrapper's methods this
    suite compares through. ``reshard_after_forward`` is drawn as a bool or as FSDP2's int (1 or the
    world size; a group in between needs 4 devices, test_fsdp2), with or without prefetch lists."""
    def as_fsdp2(drawn: Tuple[Program, bool, bool]) -> Program:
        p, int_reshard, prefetch = drawn
        zero2 = p.strategy == "SHARD_GRAD_OP"
        return dataclasses.replace(p, wrap="fully_shard", layout="dim0", tied="none", int_reshard=int_reshard,
                                   strategy="SHARD_GRAD_OP" if zero2 else "FULL_SHARD", prefetch=prefetch)
    return st.tuples(programs(world_size, "xla"), st.booleans(), st.booleans()).map(as_fsdp2).filter(
        functools.partial(_exact, world_size=world_size))


def _exact(p: Program, world_size: int) -> bool:
    """Programs where sharded training must equal unsharded (see the module docstring).

    Every rank must run every unit (a unit's gather is a collective, in PyTorch's FSDP too), so a
    branch that some ranks skip is never a unit of its own. A flat shard must be used whole or not
    at all in a step: the branch layer has flat shards of its own only as its own unit, so a branch
    inside another unit's flat shard is drawn only where some rank uses it in every step. BatchNorm
    is drawn with fp32 compute only: in bf16, batch statistics of 3 samples turn rounding into
    gradient differences of 20 % and more against the fp32 reference (docs/usage.md, "Mixed precision":
    BatchNorm in fp32 gets its own unit)."""
    if (p.dtype == "bf16" or p.autocast) and p.batchnorm:
        return False
    if p.autocast and p.dtype == "bf16":
        return False  # bf16 parameters already: autocast changes nothing
    if p.clamp and p.tied != "none":
        return False  # the clamped weight is tied to one an earlier block saved for backward: unsharded fails too
    if p.clamp and (p.layout == "flat" or p.wrap == "auto"):
        # PyTorch refuses an in-place edit of a flat shard's split view; auto-wrapped, the clamped fc is a
        # unit of its own, whose parameters are shards while its parent's forward reads them (refused,
        # naming the parameter: a module edits the parameters its own unit gathered)
        return False
    if p.tied != "none" and p.wrap == "nested":
        return False  # tied across hand-made units is refused by design (test_api covers the error)
    if p.branch == "ranks" and branch_is_unit(p):
        return False  # a unit some ranks skip: its gather is a collective, so every rank must run it
    if p.layout == "flat" and p.branch == "ranks":
        return world_size > 1
    return not (p.layout == "flat" and p.branch in ("steps", "none") and not branch_is_unit(p))


def branch_is_unit(p: Program) -> bool:
    """The branch layer is an FSDP unit of its own: always with the size policy (its 72 parameters
    reach ``min_num_params=60``), and when nested unless some ranks skip it."""
    return p.wrap == "auto" or (p.wrap in ("nested", "fully_shard") and p.branch != "ranks")


# ----------------------------------------------------------------------------- the model
class Conv1D(nn.Module):
    """GPT-2's linear layer: ``addmm(bias, x, weight)``, whose backward uses the saved weight
    itself (``nn.Linear`` saves ``weight.t()``, a tensor of the forward's own)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width ** 0.5)
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        return torch.addmm(self.bias, x, self.weight)


class Late(nn.Linear):
    """A root-level layer tied to the first block (never auto-wrapped): with checkpointing, its
    gradient reaches the shared weight before the block's recompute needs it."""


@dataclasses.dataclass
class Output:
    """A plain dataclass output (Hugging Face's ModelOutput is one, registered with pytree)."""
    logits: torch.Tensor
    aux: Optional[torch.Tensor] = None
    note: str = "out"


def pack(kind: str, h: torch.Tensor) -> Any:
    if kind == "tuple":
        return h, 3
    if kind == "dict":
        return {"logits": h, "count": 3}
    if kind == "dataclass":
        return Output(h, aux=h.detach().sum())
    return h


def unpack(out: Any) -> torch.Tensor:
    if isinstance(out, tuple):
        return out[0]
    if isinstance(out, dict):
        return out["logits"]
    return out.logits if isinstance(out, Output) else out


def reentrant_checkpoint(fn: Any, x: torch.Tensor) -> torch.Tensor:
    """The program's own reentrant checkpoint: PyTorch's, or torch_xla's on XLA (PyTorch's cannot
    run there)."""
    if x.device.type == "xla":
        import torch_xla.utils.checkpoint
        return torch_xla.utils.checkpoint.checkpoint(fn, x)
    import torch.utils.checkpoint
    return torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=True)


class Block(nn.Module):
    def __init__(self, addmm: bool = False, output: str = "tensor", clamp: bool = False, inner_ckpt: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = Conv1D(WIDTH) if addmm else nn.Linear(WIDTH, WIDTH)
        self.output, self.clamp, self.inner_ckpt = output, clamp, inner_ckpt

    def forward(self, h):
        if self.clamp and bool((self.fc.weight.abs() > 0.3).any()):  # only then: the reference's forwards
            with torch.no_grad():  # of every rank's batch before one backward must not edit a saved weight
                self.fc.weight.clamp_(-0.3, 0.3)
        x = self.norm(h)
        x = reentrant_checkpoint(self.fc, x) if self.inner_ckpt and torch.is_grad_enabled() else self.fc(x)
        return pack(self.output, h + torch.tanh(x))


class Net(nn.Module):
    def __init__(self, p: Program):
        super().__init__()
        self.embedding = p.embedding
        self.inp = nn.Embedding(VOCAB, WIDTH) if p.embedding else nn.Linear(6, WIDTH)
        # torch_xla's reentrant checkpoint returns tensors only: checkpointed blocks return one
        block_output = "tensor" if p.remat else p.output
        self.blocks = nn.ModuleList([Block(p.addmm, block_output, inner_ckpt=p.inner_ckpt),
                                     Block(p.addmm, block_output, clamp=p.clamp, inner_ckpt=p.inner_ckpt)])
        self.rnn = nn.LSTM(WIDTH, WIDTH, batch_first=True) if p.rnn else None
        self.output = p.output
        self.branch = nn.Linear(WIDTH, WIDTH)
        self.bn = nn.BatchNorm1d(WIDTH) if p.batchnorm else None
        self.temp = nn.Parameter(torch.tensor(1.25)) if p.scalar else None
        self.head = nn.Linear(WIDTH, 5)
        self.twice = p.twice
        self.late = Late(WIDTH, WIDTH, bias=False) if p.tied == "late" else None
        if p.tied == "blocks":
            self.blocks[1].fc.weight = self.blocks[0].fc.weight
        elif p.tied == "late":
            self.late.weight = self.blocks[0].fc.weight
        if p.frozen:
            self.blocks[0].fc.requires_grad_(False)

    def forward(self, x, use_branch: bool = True):
        h = self.inp(x).mean(1) if self.embedding else self.inp(x)
        if self.rnn is not None:
            h = h + self.rnn(h.unsqueeze(1))[0][:, 0]
        h = unpack(self.blocks[1](unpack(self.blocks[0](h))))
        if self.twice:
            h = unpack(self.blocks[0](h))
        if self.late is not None:
            h = h + torch.tanh(self.late(h))
        if self.bn is not None:
            h = self.bn(h)
        if use_branch:  # after the BatchNorm, which would cancel the branch's bias (a zero gradient
            h = h + self.branch(h)  # that AdamW turns into steps of rounding noise)
        out = self.head(h)
        return pack(self.output, out * self.temp if self.temp is not None else out)


class StepState:
    """What the gradient hooks of a program read: the step, this rank, and whether it runs."""

    def __init__(self, rank: int):
        self.step, self.rank = 0, rank


def add_hooks(p: Program, model: Net, state: StepState) -> None:
    """Hooks a program registers on its parameters before wrapping (both runs register them)."""
    if p.hook:
        def mask(g):
            g = g.clone()
            g[:2] = 0  # "train only the new rows": rows 0-1 keep their values
            return g
        model.inp.weight.register_hook(mask)
    if p.scaler:
        def overflow(g):
            if state.step == 1 and state.rank == 0:
                g = g.clone()
                g.view(-1)[0] = float("inf")
            return g
        model.head.weight.register_hook(overflow)


def batch(p: Program, step: int, micro: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    x = (torch.randint(0, VOCAB, (PER_RANK, 4), generator=g) if p.embedding
         else torch.randn(PER_RANK, 6, generator=g))
    return x, torch.randint(0, 5, (PER_RANK,), generator=g)


def uses_branch(p: Program, step: int, rank: int) -> bool:
    if p.branch == "ranks":
        return (rank + step) % 2 == 0  # half the ranks in each step (on one rank: every other step)
    if p.branch == "steps":
        return step % 2 == 0
    return p.branch == "all"


def no_decay(name: str) -> bool:
    return name.endswith("bias") or "norm" in name or name == "temp"


def make_optimizer(p: Program, model: nn.Module) -> torch.optim.Optimizer:
    if p.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    if p.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, eps=1e-6)
    if p.recipe != "api":  # the recipe as programs write it, on whatever named_parameters() gives
        named = list(model.named_parameters())
        groups = [{"params": [q for n, q in named if not recipe_no_decay(p, n, q.dim())], "weight_decay": 0.5},
                  {"params": [q for n, q in named if recipe_no_decay(p, n, q.dim())], "weight_decay": 0.0}]
        if p.drop_empty:
            groups = [g for g in groups if g["params"]]
        return torch.optim.AdamW(groups, lr=2e-3, eps=1e-6)
    options = lambda n: {"weight_decay": 0.0} if no_decay(n) else {}  # noqa: E731
    if isinstance(model, FSDP):
        groups = model.optimizer_param_groups(options)
    else:
        groups = [dict(options(n), params=[q]) for n, q in model.named_parameters()]
    return torch.optim.AdamW(groups, lr=2e-3, weight_decay=0.5, eps=1e-6)


def recipe_no_decay(p: Program, name: str, dim: int) -> bool:
    """The drawn no-decay recipe's rule for one parameter, from what the program sees of it."""
    if p.recipe == "name":
        return any(nd in name for nd in ("bias", "LayerNorm.weight"))
    return dim < 2


def recipe_splits_otherwise(p: Program, model: nn.Module, originals: nn.Module) -> bool:
    """Whether the first step must refuse the drawn recipe applied to the shards: a known no-decay recipe
    (by name, by dimension, the Hugging Face Trainer's get_decay_parameter_names) gives exactly the program's
    split on the shards and another one on some original parameter a shard holds (named by the shard
    metadata; ``originals``: the unwrapped model, for their dims and modules). Recipes that split the shards
    alike cannot be told apart, so one that would split the originals otherwise is enough. Elsewhere the
    run must equal unsharded training."""
    if p.recipe == "api":
        return False
    root = root_unit(model)
    layout = root.get_shard_metadata()["layout"]  # keyed by the unit's own names (fully_shard: its module's)
    entries = {id(q): layout[key] for key, q in root.named_parameters()}
    shards = list(model.named_parameters())
    dims = {n: q.dim() for n, q in originals.named_parameters(remove_duplicate=False)}
    decay = [set(trainer_decay_names(m)) for m in (model, originals)]
    recipes = {  # (on a shard, on an original)
        "name": (lambda key, q: recipe_no_decay(dataclasses.replace(p, recipe="name"), key, q.dim()),
                 lambda n: recipe_no_decay(dataclasses.replace(p, recipe="name"), n, dims[n])),
        "dim": (lambda key, q: q.dim() < 2, lambda n: dims[n] < 2),
        "trainer": (lambda key, q: key not in decay[0], lambda n: n not in decay[1]),
    }
    seen = [recipe_no_decay(p, key, q.dim()) for key, q in shards]
    for on_shard, on_original in recipes.values():
        if [on_shard(key, q) for key, q in shards] == seen and any(
                on_original(n) != on_shard(key, q) for key, q in shards for n in entries[id(q)]["names"]):
            return True
    return False


#: transformers' lazy module is not safe to import from two threads at once: an XLA:CPU rank thread got
#: "cannot import name 'Trainer' from 'transformers'" while the other imported it, and its partner then
#: waited 600 s at the construction check
_TRANSFORMERS_IMPORT = threading.Lock()


def trainer_decay_names(model: nn.Module) -> list:
    """transformers' Trainer.get_decay_parameter_names itself (imported, not copied, so that a wrong reading
    of its rule in the package cannot pass here as well)."""
    with _TRANSFORMERS_IMPORT:
        from transformers import Trainer
    return Trainer.get_decay_parameter_names(None, model)


def wrap(p: Program, model: Net, world_size: int) -> FSDP:
    if p.wrap == "fully_shard":
        return shard_fsdp2_style(p, model, world_size)
    kw: Dict[str, Any] = dict(sharding_strategy=p.strategy, flatten_parameters=p.layout == "flat",
                              shard_param_on_dim_0=p.layout == "dim0")
    if p.strategy.startswith("HYBRID"):
        kw["hybrid_shard_size"] = 2
    if p.dtype == "bf16":
        kw.update(compute_dtype=torch.bfloat16, fp32_reduce_scatter=True, output_dtype=torch.float32)
    if p.offload:
        kw["cpu_offload"] = True
    if p.layout == "flat" and p.optimizer == "adamw_groups":
        kw["flatten_group_fn"] = lambda name, q: no_decay(name)
    child = dict(kw, output_dtype=None)
    remat = checkpoint_module if p.remat else (lambda m: m)
    if p.wrap == "nested":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = FSDP(remat(block), **child)
        if branch_is_unit(p):
            model.branch = FSDP(model.branch, **child)
    elif p.wrap == "auto":
        kw["auto_wrap_policy"] = functools.partial(size_based_auto_wrap_policy, min_num_params=60,
                                                   exclude_wrap_modules={nn.ModuleList, Late})
        if p.remat:
            kw["auto_wrapper_callable"] = lambda m, *a, **k: FSDP(checkpoint_module(m), *a, **k)
    return FSDP(model, **kw)


def shard_fsdp2_style(p: Program, model: Net, world_size: int) -> nn.Module:
    """``fully_shard`` on each block (and the branch when it is a unit), then on the root."""
    from xla_fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    mp, root_mp = MixedPrecisionPolicy(), MixedPrecisionPolicy()
    if p.dtype == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        root_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       output_dtype=torch.float32)
    kw: Dict[str, Any] = dict(offload_policy=CPUOffloadPolicy() if p.offload else OffloadPolicy())
    remat = checkpoint_module if p.remat else (lambda m: m)
    reshard: Any = p.strategy == "FULL_SHARD"
    if p.int_reshard:  # FSDP2 reads the world size as True and 1 as False (warning that 1 is not True)
        reshard = world_size if reshard else 1
    for i, block in enumerate(model.blocks):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="reshard_after_forward=1")
            model.blocks[i] = fully_shard(remat(block), reshard_after_forward=reshard, mp_policy=mp, **kw)
    if branch_is_unit(p):
        model.branch = fully_shard(model.branch, mp_policy=mp, **kw)
    if p.prefetch:
        first, second = model.blocks
        first.set_modules_to_forward_prefetch([second])
        second.set_modules_to_backward_prefetch([first])
    return fully_shard(model, mp_policy=root_mp, **kw)


# ----------------------------------------------------------------------------- one run
def _loss(p: Program, model, x, y, use_branch, teacher: Optional[nn.Module] = None):
    logits = unpack(model(x, use_branch=use_branch)).float()
    loss = F.cross_entropy(logits, y)
    if teacher is not None:  # the student regressed on its teacher's logits, DINO-style
        with torch.no_grad():
            target = unpack(teacher(x, use_branch=use_branch)).float()
        loss = loss + 0.5 * F.mse_loss(logits, target)
    return loss


def make_scaler(p: Program, device) -> Optional[torch.amp.GradScaler]:
    # 2**10: a power of two, so scaling and unscaling change no bit of an fp32 gradient
    return torch.amp.GradScaler(torch.device(device).type, init_scale=2.0 ** 10) if p.scaler else None


def toggled_names(p: Program, model: FSDP) -> List[str]:
    """Original names of every parameter in the shards holding blocks.0.fc.weight (a flat shard
    holds others too: they are toggled with it, in the reference run as well)."""
    names: List[str] = []
    for layout in root_unit(model).get_shard_metadata()["layout"].values():
        if "blocks.0.fc.weight" in layout["names"]:
            names += layout["names"]
    return names


def set_requires_grad(p: Program, model: nn.Module, names: List[str]) -> None:
    """The program's toggle at step 1, on the shards (sharded run) or the parameters (reference)."""
    value = p.toggle == "unfreeze"
    if isinstance(model, FSDP):
        shards = {k for k, layout in model.get_shard_metadata()["layout"].items()
                  if set(layout["names"]) & set(names)}
        for key, shard in model.named_parameters():
            if key in shards:
                shard.requires_grad_(value)
    else:
        for name, param in model.named_parameters():
            if name in names:
                param.requires_grad_(value)


def reinit(model: nn.Module) -> None:
    """Re-initialising a trained model, as programs do after wrapping (Hugging Face's post_init,
    a reset of the head): the same calls in both runs; the sharded one gets the full parameters
    from ``apply`` itself and from ``summon_full_params`` for the in-place edit."""
    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            if m.bias is not None:
                nn.init.zeros_(m.bias)
            m.weight.data.mul_(0.5)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
    model.apply(init)
    context = FSDP.summon_full_params(model) if is_unit(model) else _Null()
    with context, torch.no_grad():
        model.head.weight[0].fill_(0.1)


def clip(p: Program, model: nn.Module) -> float:
    if p.clip_by == "torch" or not isinstance(model, FSDP):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), p.clip)
    else:
        norm = model.clip_grad_norm_(p.clip)
    return float(norm)


def optimizer_step(p: Program, model: nn.Module, opt: torch.optim.Optimizer, scaler, norms: List[float]) -> None:
    if scaler is not None and p.clip:
        scaler.unscale_(opt)
    if p.clip:
        norms.append(clip(p, model))
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


def refused_step(p: Program, model: nn.Module, opt: torch.optim.Optimizer, scaler, norms: List[float]) -> str:
    """The first step of a recipe that splits the originals otherwise: it must raise the refusal."""
    try:
        optimizer_step(p, model, opt, scaler, norms)
    except RuntimeError as e:
        if "xla_fsdp: this AdamW's" in str(e) and "optimizer_param_groups" in str(e):
            return str(e)
        raise
    raise AssertionError(f"the recipe's groups split the original parameters otherwise, but the first step was "
                         f"not refused ({p})")


def teacher_frozen_after(p: Program) -> bool:
    """A student flattened with a frozen layer keeps that layer's parameters apart from its trainable ones,
    which a teacher frozen whole would not: zip(parameters()) would pair other shards. So that teacher is
    built with the student's layer frozen and frozen whole after wrapping (docs/usage.md)."""
    return p.layout == "flat" and p.frozen


def update_teacher(student: nn.Module, teacher: nn.Module) -> None:
    """The EMA update as DINO and BYOL write it: parameter for parameter, on whatever they hold."""
    with torch.no_grad():
        for s, t in zip(student.parameters(), teacher.parameters()):
            t.mul_(0.8).add_(s.detach(), alpha=0.2)


def _load_saved(run: Run) -> None:
    """The reload at step 2 of the state saved after step 0 (the program's checkpoint API when sharded)."""
    model, opt, saved = run.model, run.optimizer, run.notes["saved"]
    if run.sharded:
        load_full_state_dict(model, saved[0])
        load_full_optim_state_dict(model, opt, saved[1])
        run.sync()
    else:
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])


def _save(run: Run) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    if run.sharded:
        return (full_state_dict(run.model, rank0_only=False),
                full_optim_state_dict(run.model, run.optimizer, rank0_only=False))
    return copy.deepcopy(run.model.state_dict()), copy.deepcopy(run.optimizer.state_dict())


def _accumulating(p: Program, run: Run, last: bool) -> Any:
    """A micro-batch's context: the sharded run skips the gradient sync before the last (FSDP2's
    ``set_requires_gradient_sync``, the wrapper's ``no_sync``); the reference just accumulates."""
    if not run.sharded:
        return _Null()
    if p.wrap == "fully_shard":
        run.model.set_requires_gradient_sync(last)
        return _Null()
    return _Null() if last else run.model.no_sync()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _RecordedWarnings:
    """Over a sharded run's steps: the partly-used flat shard warnings it gave, into ``notes``."""

    def __init__(self, run: Run):
        self.run = run
        self.caught = warnings.catch_warnings(record=True)

    def __enter__(self):
        self.log = self.caught.__enter__()
        warnings.simplefilter("always", xla_fsdp.unit.gradients.UnusedFlatParameterWarning)
        return self

    def __exit__(self, *exc):
        self.run.notes["warnings"] = sorted({str(w.message) for w in self.log if issubclass(
            w.category, xla_fsdp.unit.gradients.UnusedFlatParameterWarning)})
        return self.caught.__exit__(*exc)


# ----------------------------------------------------------------------------- comparison
def refused(p: Program, sharded: List[Dict[str, Any]]) -> bool:
    """Whether the run was refused at its first step (each rank checked that the recipe splits the
    originals otherwise, see :func:`recipe_splits_otherwise`); every rank or none."""
    which = [rank for rank, r in enumerate(sharded) if "refused" in r]
    assert len(which) in (0, len(sharded)), f"ranks {which} alone refused ({p})"
    return bool(which)


def compare(p: Program, sharded: List[Dict[str, Any]], ref: Dict[str, Any]) -> float:
    """Raise AssertionError where sharded training (every rank's result) departs from ``ref``;
    returns the largest deviation seen."""
    loss_tol, tol = (5e-2, 1e-1) if p.dtype == "bf16" or p.autocast else (2e-5, 2e-5)
    worst = 0.0

    def close(what: str, got, want, tolerance: float) -> None:
        nonlocal worst
        got, want = torch.as_tensor(got, dtype=torch.float32), torch.as_tensor(want, dtype=torch.float32)
        assert torch.equal(got.isfinite(), want.isfinite()), f"{what}: finite where the other is not ({p})"
        got, want = got.nan_to_num(0.0, 0.0, 0.0), want.nan_to_num(0.0, 0.0, 0.0)
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        dev = (got - want).abs().max().item() if got.numel() else 0.0
        worst = max(worst, dev)
        assert dev <= tolerance, f"{what}: deviation {dev:.3g} > {tolerance:g} ({p})"

    params = [n for n in ref["full"] if "running_" not in n and "num_batches" not in n]
    # Each rank's loss is its own batch's; the reference's is their mean.
    close("losses (mean over ranks)", torch.tensor([r["losses"] for r in sharded]).mean(0), ref["losses"], loss_tol)
    for rank, r in enumerate(sharded):
        assert not r["warnings"], f"rank {rank} warned: {r['warnings']}"
        assert r["scale"] == ref["scale"], f"rank {rank}: loss scale {r['scale']} != {ref['scale']} ({p})"
        # A gradient norm sums every squared gradient: relative to its size (norms of 6 and more
        # with BatchNorm on 3 samples differ by 5e-5 between XLA's and eager's fp32 summation).
        norm_scale = max([1.0] + [abs(float(n)) for n in ref["norms"]])
        close(f"rank {rank} clip norms", r["norms"], ref["norms"], loss_tol * norm_scale)
        for n in params:
            close(f"rank {rank} parameter {n}", r["full"][n], ref["full"][n], tol)
        got_optim = r["optim"]["state"]
        assert set(got_optim) == set(ref["optim"]), (
            f"rank {rank}: optimizer state for {sorted(got_optim)} != {sorted(ref['optim'])}")
        for n, fields in ref["optim"].items():
            for f, v in fields.items():
                if f != "step" and isinstance(v, torch.Tensor):
                    close(f"rank {rank} optimizer {n}.{f}", got_optim[n][f], v, tol)
        for n, v in (ref["teacher"] or {}).items():
            if "running_" not in n and "num_batches" not in n:
                close(f"rank {rank} teacher {n}", r["teacher"][n], v, tol)
    replicas = [r for r in sharded if r["metadata"]["replica_rank"] == 0]
    consolidated = consolidate_sharded_state_dicts([r["state_dict"] for r in replicas], replicas[0]["metadata"])
    for n in params:
        close(f"consolidated {n}", consolidated[n], ref["full"][n], tol)
    return worst
