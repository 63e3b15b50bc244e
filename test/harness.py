"""Runs training configurations sharded on N real ranks (gloo processes or XLA:CPU device threads)
and unsharded in one process, so tests can compare the two."""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import glob
import functools
import os
import shutil
import tempfile
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn

import models
import xla_fsdp
from ranks import Rank, one_rank_group
from training_program import Run, on_rank, reference, run_sharded
from xla_fsdp import XlaFullyShardedDataParallel as FSDP, checkpoint_module
from xla_fsdp.checkpoints.shard_merge import consolidate_sharded_state_dicts
from xla_fsdp.wrap import (lambda_auto_wrap_policy, size_based_auto_wrap_policy,
                           transformer_auto_wrap_policy)

STEPS = 5


def _wrap_children(model: nn.Module, names, **kw) -> nn.Module:
    for n in names:
        setattr(model, n, FSDP(getattr(model, n), **kw))
    return model


def _nested(**kw):
    return lambda m: FSDP(_wrap_children(m, ["fc1", "fc2"], **kw), **kw)


def _policy_linear(m):
    return isinstance(m, nn.Linear)


def _world_size() -> int:
    from xla_fsdp.collectives import global_rank_and_size, resolve_transport
    return global_rank_and_size(resolve_transport())[1]


def _strategy(strategy: str, **kw):
    """Nested units under ``sharding_strategy``; hybrid shards within pairs of ranks (2x2 at ws 4)."""
    def wrap(m):
        if strategy.startswith("HYBRID"):
            kw["hybrid_shard_size"] = min(2, _world_size())
        return _nested(sharding_strategy=strategy, **kw)(m)
    return wrap


def _mesh_hybrid(strategy: str, as_process_groups: bool = False):
    """Hybrid groups given PyTorch FSDP's ways: a 2-D (replicate, shard) DeviceMesh, or its
    (shard, replicate) process groups (torch.distributed only). The shard axis runs across hosts
    ([[0, 2], [1, 3]] at 2 hosts x 2), unlike the default, so a test sees that the argument counts."""
    def wrap(m):
        from torch.distributed.device_mesh import DeviceMesh
        per_host = int(os.environ.get("LOCAL_WORLD_SIZE", _world_size()))
        layout = torch.arange(_world_size()).reshape(_world_size() // per_host, per_host).T
        mesh = DeviceMesh("cpu", layout, mesh_dim_names=("replicate", "shard"))
        kw = (dict(process_group=(mesh.get_group("shard"), mesh.get_group("replicate"))) if as_process_groups
              else dict(device_mesh=mesh))
        return _nested(sharding_strategy=strategy, **kw)(m)
    return wrap


def _torch_cpu_offload():
    from torch.distributed.fsdp import CPUOffload
    return CPUOffload(offload_params=True)  # PyTorch FSDP's spelling of cpu_offload=True


def no_decay(name: str) -> bool:
    """The usual rule: no weight decay on biases, norms and position embeddings."""
    return name.endswith("bias") or ".ln" in "." + name or name.startswith("ln") or name == "pos"


TIED_SPLIT_POLICY = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(
    m, (nn.Embedding, models.Block)) or (isinstance(m, nn.Linear) and m.out_features == 32))
BLOCK_POLICY = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={models.Block})
# Each config: model, optimizer, how to wrap (callable on the unwrapped model), extras.
CONFIGS: Dict[str, Dict[str, Any]] = {  # noqa: E501
    "zero3_nested_sgd": dict(model="mlp", opt="sgd", wrap=_nested(), check_freed=True),
    "zero3_nested_adamw": dict(model="mlp", opt="adamw", wrap=_nested(), check_freed=True),
    "zero2_nested_adamw": dict(model="mlp", opt="adamw", wrap=_nested(reshard_after_forward=False)),
    "zero2_root_sgd": dict(model="mlp", opt="sgd", wrap=lambda m: FSDP(m, reshard_after_forward=False)),
    "flatten_nested_adamw": dict(model="mlp", opt="adamw", wrap=_nested(flatten_parameters=True), check_freed=True),
    "dim0_nested_sgd": dict(model="mlp", opt="sgd", wrap=_nested(shard_param_on_dim_0=True), check_freed=True),
    "autowrap_size_flat_sgd": dict(
        model="mlp",
        opt="sgd",
        wrap=lambda m: FSDP(
            m,
            flatten_parameters=True,
            auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=100),
        ),
    ),
    "autowrap_type_lm_adamw": dict(model="lm", opt="adamw", wrap=lambda m: FSDP(m, auto_wrap_policy=BLOCK_POLICY)),
    "autowrap_type_lm_flat_sgd": dict(
        model="lm", opt="sgd", wrap=lambda m: FSDP(m, flatten_parameters=True, auto_wrap_policy=BLOCK_POLICY)
    ),
    "checkpoint_lm_adamw": dict(
        model="lm",
        opt="adamw",
        wrap=lambda m: FSDP(
            m,
            auto_wrap_policy=BLOCK_POLICY,
            auto_wrapper_callable=lambda mod, *a, **kw: FSDP(checkpoint_module(mod), *a, **kw),
        ),
    ),
    "frozen_flat_adamw": dict(model="frozen", opt="adamw", wrap=_nested(flatten_parameters=True)),
    "frozen_param_sgd": dict(model="frozen", opt="sgd", wrap=_nested()),
    "tied_param_adamw": dict(model="tied", opt="adamw", wrap=lambda m: FSDP(m)),
    "tied_flat_sgd": dict(model="tied", opt="sgd", wrap=lambda m: FSDP(m, flatten_parameters=True)),
    "tiny_param_sgd": dict(
        model="tiny",
        opt="sgd",
        wrap=lambda m: FSDP(m, auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=_policy_linear)),
    ),
    "tiny_dim0_adamw": dict(model="tiny", opt="adamw", wrap=lambda m: FSDP(m, shard_param_on_dim_0=True)),
    "convbn_sgd": dict(
        model="convbn",
        opt="sgd",
        wrap=lambda m: FSDP(
            m,
            auto_wrap_policy=functools.partial(
                lambda_auto_wrap_policy, lambda_fn=lambda x: isinstance(x, (nn.Conv2d, nn.BatchNorm2d))
            ),
        ),
    ),
    "no_sync_adamw": dict(model="mlp", opt="adamw", wrap=_nested(), micro=2),
    "no_sync_flat_sgd": dict(
        model="mlp", opt="sgd", wrap=_nested(flatten_parameters=True, reshard_after_forward=False), micro=2
    ),
    "clip_adamw": dict(model="mlp", opt="adamw", wrap=_nested(), clip=0.05),
    # bf16 compute with BatchNorm buffers stored in bf16: for checkpoint round trips (buffer dtypes
    # restored); its losses follow bf16 numerics, so it is not in the fp32 equivalence set.
    "convbn_bf16_sgd": dict(
        model="convbn",
        opt="sgd",
        equivalence=False,
        wrap=lambda m: FSDP(
            m,
            compute_dtype=torch.bfloat16,
            buffer_dtype=torch.bfloat16,
            auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda x: isinstance(x, nn.Conv2d)),
        ),
    ),
    "strategy_full_shard_adamw": dict(model="mlp", opt="adamw", wrap=_strategy("FULL_SHARD"), check_freed=True),
    "strategy_shard_grad_op_adamw": dict(model="mlp", opt="adamw", wrap=_strategy("SHARD_GRAD_OP"), check_kept=True),
    "strategy_no_shard_adamw": dict(model="mlp", opt="adamw", wrap=_strategy("NO_SHARD"), check_kept=True),
    "strategy_hybrid_adamw": dict(model="mlp", opt="adamw", wrap=_strategy("HYBRID_SHARD"), check_freed=True),
    "strategy_hybrid_zero2_flat_sgd": dict(
        model="mlp", opt="sgd", check_kept=True, wrap=_strategy("HYBRID_SHARD_ZERO2", flatten_parameters=True)
    ),
    # Hybrid with its default groups: the ranks of one host (LOCAL_WORLD_SIZE); run by test_multinode
    # under torchrun with 2 simulated nodes, where the shard groups must be the nodes.
    "node_hybrid_adamw": dict(model="mlp", opt="adamw", wrap=_nested(sharding_strategy="HYBRID_SHARD"),
                              check_freed=True, equivalence=False),
    "node_hybrid_zero2_adamw": dict(model="mlp", opt="adamw", wrap=_nested(sharding_strategy="HYBRID_SHARD_ZERO2"),
                                    check_kept=True, equivalence=False),
    "mesh_hybrid_adamw": dict(model="mlp", opt="adamw", wrap=_mesh_hybrid("HYBRID_SHARD"), equivalence=False),
    "pg_hybrid_zero2_adamw": dict(model="mlp", opt="adamw", wrap=_mesh_hybrid("HYBRID_SHARD_ZERO2", True),
                                  equivalence=False),
    # AdamW groups by original name (no decay on biases/norms) over flattened, auto-wrapped units.
    "wd_groups_flat_lm_adamw": dict(
        model="lm",
        opt="adamw_groups",
        # a forgotten no-decay group moves a norm weight by 2.5e-3 here (5 steps, lr 1e-3, wd 0.5); XLA:CPU's
        # compiled rounding (LLVM -O0, the suite's) ends 1.1e-6 from eager at 2 devices, gloo 0
        tol=2e-6,
        wrap=lambda m: FSDP(
            m, flatten_parameters=True, auto_wrap_policy=BLOCK_POLICY, flatten_group_fn=lambda name, p: no_decay(name)
        ),
    ),
    # Mixed precision: bf16 compute, fp32 master shards, fp32 reduce-scatter and logits; tracks
    # the fp32 loss curve (test_mixed_precision), not bit-equivalent.
    "mp_bf16_lm_adamw": dict(
        model="lm",
        opt="adamw",
        equivalence=False,
        wrap=lambda m: FSDP(
            m,
            compute_dtype=torch.bfloat16,
            fp32_reduce_scatter=True,
            output_dtype=torch.float32,
            auto_wrap_policy=BLOCK_POLICY,
        ),
    ),
    # The unit order changes every step: prefetches by the last forward's order miss and must be
    # drained (ZeRO-3 freeing checked every step).
    "reorder_lm_adamw": dict(
        model="lm_reorder", opt="adamw", check_freed=True, wrap=lambda m: FSDP(m, auto_wrap_policy=BLOCK_POLICY)
    ),
    # torch.distributed joins a unit's small groups into one collective and gathers large ones
    # alone: lowered threshold, so every unit of this tiny model mixes both paths.
    "coalesce_mixed_lm_adamw": dict(
        model="lm",
        opt="adamw",
        wrap=lambda m: FSDP(m, auto_wrap_policy=BLOCK_POLICY, _solo_collective_numel=256),
        check_freed=True,
    ),
    # The tied embedding/head weight is used by two units (and the root, which owns it): GPT-2
    # under a policy that wraps the embedding and the head.
    "tied_across_units_adamw": dict(
        model="lm_tied", opt="adamw", wrap=lambda m: FSDP(m, auto_wrap_policy=TIED_SPLIT_POLICY), check_freed=True
    ),
    "tied_across_units_flat_sgd": dict(
        model="lm_tied", opt="sgd", wrap=lambda m: FSDP(m, flatten_parameters=True, auto_wrap_policy=TIED_SPLIT_POLICY)
    ),
    "clip_lm_sgd": dict(model="lm", opt="sgd", wrap=lambda m: FSDP(m, auto_wrap_policy=BLOCK_POLICY), clip=0.5),
    # nn.Sequential with its inner Linear layers as nested units: the root unit's 4.* come first in
    # the wrapped model's parameters(), the unwrapped model's order is 0, 2, 4 (test_checkpoints).
    "seq_nested_adamw": dict(model="seq", opt="adamw", equivalence=False,
                             wrap=lambda m: FSDP(_wrap_children(m, ["0", "2"]))),
    "seq_nested_flat_adamw": dict(model="seq", opt="adamw", equivalence=False,
                                  wrap=lambda m: FSDP(_wrap_children(m, ["0", "2"], flatten_parameters=True),
                                                      flatten_parameters=True)),
    "seq_groups_flat_adamw": dict(model="seq", opt="adamw_groups", equivalence=False,
                                  wrap=lambda m: FSDP(_wrap_children(m, ["0", "2"], flatten_parameters=True),
                                                      flatten_parameters=True)),
    # Host offload (cpu_offload): master shards, gradients and optimizer state on the host. Run by
    # test_offload in launches of their own (equivalence=False keeps them out of the session runs);
    # check_host records after every step where the state lives (host_residency).
    "offload_zero3_sgd": dict(model="mlp", opt="sgd", wrap=_nested(cpu_offload=True), check_freed=True,
                              check_host=True, equivalence=False),
    "offload_zero3_adamw": dict(model="mlp", opt="adamw", check_freed=True, check_host=True, equivalence=False,
                                wrap=lambda m: _nested(cpu_offload=_torch_cpu_offload())(m)),
    # hybrid 2x2 at ws 4 (gradient shards all-reduced across replicas before they go to the host)
    "offload_hybrid_flat_no_sync_clip_adamw": dict(
        model="mlp", opt="adamw", micro=2, clip=0.05, check_host=True, equivalence=False,
        wrap=_strategy("HYBRID_SHARD", cpu_offload=True, flatten_parameters=True)),
    # ZeRO-2 with activation checkpointing (on XLA torch_xla's reentrant checkpoint: nested backward passes)
    "offload_remat_lm_zero2_sgd": dict(
        model="lm", opt="sgd", check_host=True, check_kept=True, equivalence=False,
        wrap=lambda m: FSDP(m, auto_wrap_policy=BLOCK_POLICY, cpu_offload=True, reshard_after_forward=False,
                            auto_wrapper_callable=lambda mod, *a, **kw: FSDP(checkpoint_module(mod), *a, **kw))),
    # bf16 master shards on the host (param_storage_dtype): follows bf16 numerics, not the fp32 run.
    "offload_bf16_storage_adamw": dict(model="mlp", opt="adamw", check_host=True, equivalence=False,
                                       wrap=_nested(cpu_offload=True, param_storage_dtype=torch.bfloat16)),
}
#: the host-offload configurations (test_offload)
OFFLOAD = [n for n in CONFIGS if n.startswith("offload_")]
NO_SYNC_MICRO = 2


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # lr 2e-3: AdamW turns rounding noise on near-zero gradients into steps of up to ~lr, and
    # XLA:CPU fuses differently from eager; a smaller lr keeps that under the 1e-5 tolerance.
    if name == "adamw_groups":  # strong decay, so forgetting the no-decay group shows
        options = lambda n: {"weight_decay": 0.0} if no_decay(n) else {}  # noqa: E731
        if isinstance(model, FSDP):
            groups = model.optimizer_param_groups(options)
        else:
            named = list(model.named_parameters())
            groups = [dict(options(n), params=[p]) for n, p in named]
        # eps 1e-6, lr 1e-3: with eps 1e-8 and lr 2e-3 AdamW blows XLA:CPU-vs-eager rounding up to 2.8e-6
        # on one tensor, above the 2e-6 this config is held to (gloo: 6e-8 either way).
        return torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.5, eps=1e-6)
    return torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes this rank holds persistently: parameters, gradients and optimizer state."""
    total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size()
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


@dataclasses.dataclass(frozen=True)
class ConfigRun:
    """A run of config ``name`` as a program of the harness protocol (training_program.py): steps
    [start_step, start_step + steps) on ``per_rank`` samples per rank. Sharded, it may load a
    checkpoint first (``load_prefix``: sharded; ``load_full_path``: full) and save one at the end
    (``save_prefix``, and ``save_prefix + '_init'`` before training when nothing is loaded), and
    ``full_state`` adds the gathered full model and optimizer state to its record. The reference
    may start from ``init_state``. A name "config@variant" runs config again in the same launch."""
    name: str
    steps: int = STEPS
    start_step: int = 0
    per_rank: int = 4
    save_prefix: Optional[str] = None
    load_prefix: Optional[str] = None
    load_full_path: Optional[str] = None
    full_state: bool = False
    init_state: Optional[Dict[str, torch.Tensor]] = None

    @property
    def config(self) -> Dict[str, Any]:
        return CONFIGS[self.name.partition("@")[0]]

    def build(self, run: Run) -> nn.Module:
        model = models.make_model(self.config["model"])
        run.notes["inner"] = model  # the unwrapped model (its set_step)
        if not run.sharded:
            if self.init_state is not None:
                model.load_state_dict(self.init_state)
            model.to(run.device)
        return model

    def shard(self, model: nn.Module, run: Run) -> nn.Module:
        return self.config["wrap"](model)

    def start(self, run: Run) -> None:
        cfg, wrapped = self.config, run.model
        run.optimizer = opt = make_optimizer(cfg["opt"], wrapped)
        run.notes.update(freed=[], residency=[])
        if not run.sharded:
            return
        run.notes["seen"] = _record_params_seen(wrapped) if cfg.get("check_freed") else []
        if self.load_full_path:
            from xla_fsdp.checkpoints import load_full_optim_state_dict, load_full_state_dict
            full = torch.load(self.load_full_path, weights_only=True)
            load_full_state_dict(wrapped, full["model"])
            load_full_optim_state_dict(wrapped, opt, full["optimizer"])
        elif self.load_prefix:
            xla_fsdp.load_sharded_checkpoint(wrapped, opt, self.load_prefix)
        elif self.save_prefix:
            xla_fsdp.save_sharded_checkpoint(wrapped, opt, self.save_prefix + "_init")

    def around_steps(self, run: Run) -> Any:
        return contextlib.nullcontext()

    def step(self, run: Run, index: int) -> None:
        cfg, model, notes = self.config, run.model, run.notes
        step, micro = self.start_step + index, cfg.get("micro", 1)
        run.optimizer.zero_grad()
        step_loss = 0.0
        if hasattr(notes["inner"], "set_step"):
            notes["inner"].set_step(step)
        for k in range(micro):
            def loss_of(r: int, k: int = k) -> torch.Tensor:
                x, y = (t.to(run.device) for t in models.batch(cfg["model"], step * micro + k, r, self.per_rank))
                out = model(x)
                if run.sharded:
                    self._check_after_forward(run)
                return models.loss_fn(cfg["model"], out, y)
            with model.no_sync() if run.sharded and k < micro - 1 else contextlib.nullcontext():
                loss = run.mean_over_ranks(loss_of)
                loss.backward()
            run.sync()
            step_loss += loss.item()
        if cfg.get("clip"):
            norm = (model.clip_grad_norm_(cfg["clip"]) if run.sharded
                    else torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"]))
            run.norms.append(norm)
        run.optimizer.step()
        run.sync()
        run.losses.append(step_loss)
        if cfg.get("check_host") and run.sharded:
            notes["residency"].append(host_residency(model, run.optimizer, run.barrier))

    def _check_after_forward(self, run: Run) -> None:
        """ZeRO-3: the nested units (and the tensors their layers saw) freed; ZeRO-2: kept."""
        cfg, notes = self.config, run.notes
        if cfg.get("check_freed"):
            notes["freed"].append(_inner_units_freed(run.model) and _seen_params_freed(run.model, notes["seen"]))
        notes["seen"].clear()
        if cfg.get("check_kept"):
            notes["freed"].append(_inner_units_kept(run.model))

    def result(self, run: Run) -> Dict[str, Any]:
        model, opt = run.model, run.optimizer
        norms = [float(n) for n in run.norms]
        if not run.sharded:
            return {"losses": run.losses, "norms": norms, "state_dict": model.state_dict(),
                    "param_bytes": sum(p.numel() * 4 for p in model.parameters()),
                    "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}}
        if self.save_prefix:
            xla_fsdp.save_sharded_checkpoint(model, opt, self.save_prefix)
        record: Dict[str, Any] = {}
        if self.full_state:
            from xla_fsdp.checkpoints import full_optim_state_dict, full_state_dict
            record["full"] = full_state_dict(model, rank0_only=False)
            record["full_optim"] = full_optim_state_dict(model, opt, rank0_only=False)
        record.update({
            "losses": run.losses,
            "norms": norms,
            "state_dict": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "metadata": model.get_shard_metadata(),
            "state_bytes": state_bytes(model, opt),
            "freed_after_forward": run.notes["freed"],
            "residency": run.notes["residency"],
            "grad_state_dict": _grad_state_dict(model) if self.config.get("check_host") else None,
            "collective_split": _collective_split(model),
            "devices": sorted({str(p.device) for p in model.parameters()} | {str(b.device) for b in model.buffers()}),
            "host_shards_pinned": _host_shards_pinned(model),
        })
        return record


def config_run(name: str, steps: int = STEPS, start: int = 0, per_rank: int = 4, save_prefix: Any = None,
               load_prefix: Any = None, load_full_path: Any = None,
               full_state: Union[bool, Collection[str]] = False) -> ConfigRun:
    """The run of config ``name`` that these keywords ask for: a path may be a dict variant -> path
    (the variant of "config@variant"), and may name the config with "{name}", so one launch can
    run several configs; ``full_state``: True, or the names of the configs that want it."""
    base, _, variant = name.partition("@")

    def path(p: Any) -> Optional[str]:
        p = p.get(variant) if isinstance(p, dict) else p
        return p.format(name=base) if p else p
    return ConfigRun(name, steps, start, per_rank, path(save_prefix), path(load_prefix), path(load_full_path),
                     full_state is True or bool(full_state and name in full_state))


def train_sharded(me: Rank, name: str, **kwargs: Any) -> Dict[str, Any]:
    """Rank ``me``'s run of config ``name`` (keywords: :func:`config_run`)."""
    return on_rank(me, config_run(name, **kwargs))


def _host_shards_pinned(root: FSDP) -> Optional[bool]:
    """Whether every host-offloaded shard is in pinned memory (None: nothing is offloaded)."""
    host = [p for p in root.parameters() if p.device.type == "cpu"]
    return all(p.is_pinned() for p in host) if host else None


def _grad_state_dict(root: FSDP) -> Dict[str, torch.Tensor]:
    """The sharded state dict with every shard replaced by its gradient: consolidates to full gradients."""
    grads = {n: p.grad for n, p in root.named_parameters() if p.grad is not None}
    return {k: grads.get(k, v).detach().cpu().clone() for k, v in root.state_dict().items()}


def host_residency(root: FSDP, opt: torch.optim.Optimizer, barrier: Callable[[], None]) -> Dict[str, Any]:
    """Where a host-offloading model's state is between steps: the device types of its parameters,
    their gradients and the optimizer state, how many parameters have a gradient, how many groups
    still hold gathered parameters or device copies of shards, and (XLA) the number of graphs
    compiled so far, read once every rank has ended the step and before any rank goes on."""
    params = list(root.parameters())
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    units = [u for u in root.modules() if isinstance(u, FSDP)]
    groups = [g for u in units for g in u.gather_groups]
    barrier()
    compiles = None
    if root.comms.name == "xla":
        import torch_xla.debug.metrics as met
        compiles = (met.metric_data("CompileTime") or [0])[0]
    # XLA:CPU device threads share the counter: no rank goes on (after the last step, to graphs of its
    # own) before every rank has read it
    barrier()
    return {
        "params": sorted({p.device.type for p in params}), "dtypes": sorted({str(p.dtype) for p in params}),
        "grads": sorted({p.grad.device.type for p in params if p.grad is not None}),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in params if p.grad is not None}),
        "with_grad": sum(p.grad is not None for p in params), "trainable": sum(p.requires_grad for p in params),
        "optimizer": sorted({t.device.type for t in state}), "optimizer_tensors": len(state),
        "gathered": sum(g.comms.is_allocated(g.full) for g in groups),
        "device_copies": sum(len(u._runtime.offload._staged) + len(u._runtime.offload._waiting)
                             for u in units if u._runtime.offload is not None),
        "offloading_units": sum(u.cpu_offload for u in units), "units": len(units),
        "compiles": compiles,
    }


def _collective_split(root: FSDP) -> List[Tuple[int, int]]:
    """Per unit: (groups gathered and reduced alone, groups sharing one collective)."""
    from xla_fsdp.unit.group_comms import split_for_coalescing
    splits = []
    for unit in root.modules():
        if isinstance(unit, FSDP) and unit.gather_groups:
            solo, shared = split_for_coalescing(unit.gather_groups, unit.settings.solo_collective_numel)
            splits.append((len(solo), len(shared)))
    return splits


def _inner_units_freed(root: FSDP) -> bool:
    """ZeRO-3 after forward: every nested unit has freed its full parameters, except, on eager
    transports, the one that ended forward last (it runs first in backward), which must still hold
    them. On XLA none is kept: the compiled step gathers it again right before its backward."""
    kept = root._runtime.root.kept_for_backward  # a unit's runtime
    units = [m for m in root.modules() if isinstance(m, FSDP) and m is not root and m._runtime is not kept]
    kept_right = (kept is None if root.comms.compiles_step else
                  kept is not None and all(g.is_unsharded() for g in kept.groups))
    # A world-size-1 alias of the shard (torch transport, no cast) owns nothing to free.
    return (bool(units) and kept_right
            and all(g.comms.aliases_shard(g.full) or (not g.is_unsharded() and not g.comms.is_allocated(g.full))
                    for u in units for g in u.gather_groups))


def _record_params_seen(root: FSDP) -> list:
    """Collects the parameter tensors each nested unit's module sees in forward (the tensors its
    layers save for backward), so a test can check that they too are freed after forward."""
    seen = []
    for unit in root.modules():
        if isinstance(unit, FSDP) and unit is not root:
            slots = [(g, slot) for g in unit.gather_groups for ref in g.refs for slot in ref.slots]
            unit.module.register_forward_pre_hook(
                lambda *_, slots=slots: seen.extend((g, getattr(m, a)) for g, (m, a) in slots))
    return seen


def _seen_params_freed(root: FSDP, seen: list) -> bool:
    # A world-size-1 alias of the shard (torch transport, no cast) owns nothing to free.
    kept_unit = root._runtime.root.kept_for_backward
    kept = kept_unit.groups if kept_unit is not None else []
    return bool(seen) and all(g.comms.aliases_shard(g.full) or not g.comms.is_allocated(t)
                              for g, t in seen if g not in kept)


def _inner_units_kept(root: FSDP) -> bool:
    """ZeRO-2 / NO_SHARD: nested units keep their full parameters from forward to backward."""
    units = [m for m in root.modules() if isinstance(m, FSDP) and m is not root]
    return bool(units) and all(g.is_unsharded() and (g.comms.is_allocated(g.full) or g.comms.aliases_shard(g.full))
                               for u in units for g in u.gather_groups)


def train_reference(name: str, world_size: int, init_state: Optional[dict] = None, steps: int = STEPS,
                    per_rank: int = 4, device: Union[str, torch.device] = "cpu") -> Dict[str, Any]:
    """The same training, unsharded, in this process: each step averages the per-rank losses."""
    return reference(ConfigRun(name, steps, per_rank=per_rank, init_state=init_state), world_size, device=device)


def small_checkpoint(folder, make_model: Callable[[], nn.Module], input_width: int = 64):
    """``folder/in/ck``: a one-rank checkpoint of ``make_model()`` after one AdamW step on inputs of
    ``input_width`` features, and its DCP export ``folder/in/dcp``, for the tools' tests (a gloo
    group of one in this process)."""
    import subprocess
    import sys
    with one_rank_group(folder / "store"):  # or the caller's (the gloo fixture's), left to it
        model = FSDP(make_model())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, input_width)).sum().backward()
        opt.step()
        xla_fsdp.save_sharded_checkpoint(model, opt, str(folder / "in" / "ck"))
        del model, opt
    subprocess.run([sys.executable, "-m", "xla_fsdp.convert", "--to", "dcp", "--ckpt_prefix", str(folder / "in" / "ck"),
                    "--out", str(folder / "in" / "dcp")], check=True, capture_output=True)
    return folder / "in"


# ----------------------------------------------------------------------------- runs on N ranks (ranks.py)
def _runs(names: List[str], world_size: int, transport: str, kwargs: Dict[str, Any],
          **launch: Any) -> Dict[str, List[Dict[str, Any]]]:
    programs = [config_run(n, **kwargs) for n in names]
    return dict(zip(names, run_sharded(programs, world_size, transport, **launch)))


def run_gloo(names: List[str], world_size: int, **kwargs: Any) -> Dict[str, List[Dict[str, Any]]]:
    """Every config in ``names`` on ``world_size`` gloo processes; results per config and rank.
    ``kwargs`` go to :func:`config_run` (steps, start, per_rank, save/load prefixes)."""
    return _runs(names, world_size, "torch", kwargs, weights_only=False)


def run_xla(names: List[str], world_size: int, **kwargs: Any) -> Dict[str, List[Dict[str, Any]]]:
    """Run the configs on ``world_size`` XLA:CPU devices (threads of one spawned process)."""
    return _runs(names, world_size, "xla", kwargs)


def xla_steps(model: nn.Module, optimizer: torch.optim.Optimizer, batches: List[torch.Tensor],
              forward_context: Callable[[], Any] = contextlib.nullcontext) -> List[float]:
    """A user's plain XLA training loop: each batch to the model's device, forward (inside
    ``forward_context()``, e.g. autocast), the mean square of the output as the loss, a step and
    ``xla_fsdp.sync()``; the losses."""
    import torch_xla
    losses = []
    for x in batches:
        with forward_context():
            out = model(x.to(torch_xla.device()))
        loss = out.float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        xla_fsdp.sync()
        losses.append(loss.item())
    return losses


# ----------------------------------------------------------------------------- one run per session
EQUIVALENCE = [n for n, c in CONFIGS.items() if c.get("equivalence", True)]
#: configs whose checkpoints test_checkpoints consolidates and compares bit for bit
ROUND_TRIP = ["zero3_nested_adamw", "zero2_nested_adamw", "flatten_nested_adamw", "dim0_nested_sgd",
              "tied_param_adamw", "tied_flat_sgd", "frozen_flat_adamw", "autowrap_type_lm_adamw",
              "convbn_bf16_sgd", "strategy_hybrid_adamw", "strategy_no_shard_adamw", "wd_groups_flat_lm_adamw",
              "tied_across_units_adamw"]
_SESSION_RUNS: Dict[Tuple[str, int], Tuple[Dict[str, List[Dict[str, Any]]], str]] = {}


def session_run(transport: str, world_size: int) -> Tuple[Dict[str, List[Dict[str, Any]]], str]:
    """Every equivalence and round-trip config trained once per (transport, world size) and test
    session, with checkpoints saved before and after training: the equivalence and checkpoint tests
    read the same run (on XLA:CPU most of a run is compiling). Returns (results per config, the
    checkpoint prefix, with ``{name}`` for the config).

    Once per session, not per process: under pytest-xdist the workers share the folder conftest names
    in ``XLA_FSDP_SESSION_RUNS``; the first worker to need a run makes it (holding a lock on it) and
    the others load its results and read its checkpoints."""
    key = (transport, world_size)
    if key in _SESSION_RUNS:
        return _SESSION_RUNS[key]
    shared = os.environ.get("XLA_FSDP_SESSION_RUNS")
    if not shared:
        ckpt_dir = tempfile.mkdtemp(prefix=f"xla_fsdp_{transport}{world_size}_")
        atexit.register(shutil.rmtree, ckpt_dir, ignore_errors=True)
        _SESSION_RUNS[key] = _make_session_run(transport, world_size, ckpt_dir)
        return _SESSION_RUNS[key]
    import fcntl
    ckpt_dir = os.path.join(shared, f"{transport}{world_size}")
    os.makedirs(ckpt_dir, exist_ok=True)
    done = os.path.join(ckpt_dir, "results.pt")
    with open(os.path.join(ckpt_dir, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker making this run: wait for it
        if not os.path.exists(done):
            results, prefix = _make_session_run(transport, world_size, ckpt_dir)
            torch.save((results, prefix), done + ".tmp")
            os.replace(done + ".tmp", done)
        _SESSION_RUNS[key] = torch.load(done, weights_only=False)  # the suite's own file
    return _SESSION_RUNS[key]


def _make_session_run(transport: str, world_size: int, ckpt_dir: str):
    names = [n for n in CONFIGS if n in EQUIVALENCE or n in ROUND_TRIP]
    prefix = os.path.join(ckpt_dir, "{name}")
    run = run_gloo if transport == "torch" else run_xla
    return run(names, world_size, save_prefix=prefix, full_state=ROUND_TRIP), prefix


def copy_session_checkpoint(transport: str, world_size: int, name: str, dest_prefix: str,
                            before_training: bool = False) -> List[str]:
    """The session run's checkpoint of config ``name`` (trained, or the one saved before training:
    another save, with another run id) copied under ``dest_prefix``: tests that need a checkpoint to
    damage or convert reuse a run the equivalence tests make anyway."""
    _, prefix = session_run(transport, world_size)
    source = prefix.format(name=name) + ("_init" if before_training else "")
    copies = []
    for path in sorted(glob.glob(glob.escape(source) + "_rank-*-of-*.pth")):
        copies.append(dest_prefix + path[len(source):])
        shutil.copy(path, copies[-1])
    assert len(copies) == world_size, (source, copies)
    return copies


def first_replica(rank_results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The ranks holding the first copy of every shard (all ranks unless hybrid/NO_SHARD); checks
    that the other copies are bit-identical to it."""
    first = {r["metadata"]["rank"]: r for r in rank_results if r["metadata"]["replica_rank"] == 0}
    for r in rank_results:
        twin = first[r["metadata"]["rank"]]
        for k, v in r["state_dict"].items():
            if "running_" not in k and "num_batches" not in k:
                assert torch.equal(v, twin["state_dict"][k]), f"replicas differ at {k}"
    return [first[i] for i in sorted(first)]


def consolidate(rank_results: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    first = first_replica(rank_results)
    return consolidate_sharded_state_dicts([r["state_dict"] for r in first], first[0]["metadata"])
