"""How a unit takes its module: the parameters it owns become sharded groups, registered as
shards; and the per-step state a built unit starts from. A mixin of the public wrapper, which plans
transport, strategy and groups first (``_plan``) and then calls :meth:`ModuleAdoption._adopt`."""
from __future__ import annotations

import functools
import weakref
from typing import Callable, List, Optional, Set, Tuple

import torch
import torch.nn as nn

from ..sharding import default_predivide_factor
from . import construction, tied
from .options import UnitOptions
from .gather_group import GatherGroup
from .offload import shards_held_back
from .param_names import SHARD_PREFIX, SHARD_SEPARATOR, WRAPPED, flat_parts
from .step_state import StepState


class ModuleAdoption:
    """Construction steps after planning (see the wrapper's ``_plan``)."""

    #: register each shard in its original parameter's place, not as the unit's own (fully_shard)
    shards_in_place = False

    def _adopt(self, module: nn.Module, options: UnitOptions) -> None:
        """Take the parameters no nested unit owns: materialize meta ones, shard them into groups,
        register the shards, cast buffers, move the module to the device."""
        construction.materialize_meta(module, options.param_init_fn, torch.device("cpu"))
        if options._use_xla_patched_linear and self.comms.name == "xla":
            from .patched_linear import patch_linear_layers
            patch_linear_layers(module)
        self._param_attrs = construction.param_attrs(module)
        refs, self.tied_slots_left = construction.collect_params(module, tied.escaping(module),
                                                                  self.param_storage_dtype)
        self._fsdp_wrapped_module = module
        self._module_view: Optional[nn.Module] = None
        if getattr(module, "_xla_fsdp_checkpointed", False):
            # Weakly: the module must not keep its unit alive (nor make a reference cycle nn.Module sees).
            unit = weakref.ref(self)
            object.__setattr__(module, "_xla_fsdp_before_recompute", lambda: unit()._before_recompute())
        self.gather_groups: List[GatherGroup] = self._build_groups(refs)
        self._watched_groups: Set[int] = set()  # ids of groups whose full parameter has the gradient hook
        self._shard_names: List[str] = []
        for group in self.gather_groups:
            name = self._shard_param_name(group)
            if not group.in_place:  # (in place: registered where the original was, see GatherGroup)
                self.register_parameter(name, group.shard)
            group.shard._orig_name = f"{WRAPPED}.{group.flat_name if group.flat else group.refs[0].fqn}"
            group.shard._name = name
            self._shard_names.append(name)
        self._follow_requires_grad()
        self.buffer_info = {k: {"_orig_dtype": v} for k, v in
                            construction.cast_buffers(module, self.buffer_dtype, "").items()}
        with shards_held_back(self):  # in place, offloaded shards sit in the module and stay on the host
            module.to(self.comms.device)
        # (module, name, buffer, its version now, rank 0's value to take) for the floating buffers this unit owns
        # (integer counters are alike anyway); taken now, or at the first forward where the ranks
        # are threads of one process, as the groups' parameters are (see GatherGroup)
        self._rank_0_buffers: List[Tuple[nn.Module, str, torch.Tensor, int, Callable[[], torch.Tensor]]] = []
        if self._sync_module_states:
            for _, m in construction.owned_modules(module):
                for name, b in m._buffers.items():
                    if b is not None and b.is_floating_point():
                        self._rank_0_buffers.append((m, name, b, b._version, self.comms.start_broadcast_from_rank_0(b)))
            if not self.comms.ranks_share_a_process:
                self.take_deferred_values()
        # a state_dict before the first forward holds the deferred values too (in place: the
        # program asks the module, whose unit is outside its tree)
        hooked = module if self.shards_in_place else self
        hooked.register_state_dict_pre_hook(functools.partial(_take_before_state_dict, weakref.ref(self)))

    def take_deferred_values(self) -> None:
        """The values left to take since construction: what the program's own init wrote after
        ``to_empty`` (FSDP2's meta-init order, :meth:`begin_late_init`), and rank 0's parameters and
        buffers (``sync_module_states`` with rank threads). What was written since (a checkpoint
        loaded into the shards) is kept. Called before anything reads the shards: the root's first
        forward, ``summon_full_params``, ``state_dict``."""
        for group in self.gather_groups:
            group.finish_late_init()
            group.take_rank_0_values()
        buffers, self._rank_0_buffers = self._rank_0_buffers, []
        with torch.no_grad():
            for m, name, built, version, take in buffers:
                value, now = take(), m._buffers.get(name)
                if now is not None and not (now is built and now._version != version):
                    now.copy_(value)

    def begin_late_init(self, device: torch.device) -> None:
        """``to_empty`` on a sharded module (FSDP2's meta-init order: shard on the meta device, then
        ``to_empty`` and the program's init): the module's parameter attributes become full-size
        uninitialized parameters on ``device`` until :meth:`take_deferred_values` shards what the
        init wrote; its buffers get uninitialized storage there, as ``nn.Module.to_empty`` gives.
        On XLA the full tensors are lazy: the device computes each one where its shard is cut."""
        for group in self.gather_groups:
            group.begin_late_init(device)
        for _, m in construction.owned_modules(self._fsdp_wrapped_module):
            for name, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[name] = torch.empty_like(b, device=self.comms.device)

    def _follow_requires_grad(self) -> bool:
        """Take up ``requires_grad`` changes the program made since the last forward (freezing or
        unfreezing after wrapping); a group that trains gets its gradient hook once. Returns
        whether any group changed."""
        changed = False
        for group in self.gather_groups:
            changed |= group.follow_requires_grad()
            if group.requires_grad and id(group) not in self._watched_groups:
                group.full.register_post_accumulate_grad_hook(functools.partial(self._on_full_grad_ready, group))
                self._watched_groups.add(id(group))
        self._num_grad_groups = sum(g.requires_grad for g in self.gather_groups)
        return changed

    def _init_step_state(self) -> None:
        """What the forward/backward life cycle tracks from step to step."""
        self.step_state = StepState()  # where the unit is in a step (see step_state.py)
        # Gradients are averaged over every rank that computed one: the shard group and its replicas.
        data_parallel = self.world_size * self.comms.num_replicas
        self.gradient_predivide_factor = default_predivide_factor(data_parallel)
        self.gradient_postdivide_factor = data_parallel / self.gradient_predivide_factor
        self._norm_channel = self.comms.allocate_channels(1)
        self._aux_channel = self.comms.allocate_channels(1)  # small control collectives (checkpoints)
        self._replica_aux_channel = self.comms.allocate_channels(1)

    def _build_groups(self, refs) -> List[GatherGroup]:
        names: List[Optional[str]]
        if self.flatten_parameters:
            parts, names = flat_parts(refs, self._flatten_group_fn)
        else:
            parts, names = [[r] for r in refs], [None] * len(refs)
        channel = self.comms.allocate_channels(GatherGroup.CHANNELS * len(parts))
        groups = []
        for i, (part, flat_name) in enumerate(zip(parts, names)):
            group = GatherGroup(part, self.comms, flat=self.flatten_parameters,
                               dim0=self.shard_param_on_dim_0, pad_multiple=self._shard_size_multiple,
                               compute_dtype=self.compute_dtype, channel=channel + GatherGroup.CHANNELS * i,
                               offload=self._offload, storage_dtype=self.param_storage_dtype,
                               sync_from_rank_0=self._sync_module_states, in_place=self.shards_in_place)
            group.flat_name = flat_name
            groups.append(group)
        return groups

    def _shard_param_name(self, group: GatherGroup) -> str:
        """The shard's name in this unit's ``state_dict()``: its own attribute (torch_xla's spelling), or
        in place the original parameter's place."""
        path = f"{WRAPPED}.{group.flat_name if group.flat else group.refs[0].fqn}"
        return path if group.in_place else SHARD_PREFIX + path.replace(".", SHARD_SEPARATOR)


def _take_before_state_dict(unit: "weakref.ref[nn.Module]", module: nn.Module, prefix: str, keep_vars: bool) -> None:
    alive = unit()
    if alive is not None:
        alive.take_deferred_values()
