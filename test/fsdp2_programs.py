"""FSDP2-style training programs written against ``xla_fsdp``'s ``fully_shard``, run on XLA:CPU
devices (threads of one process) and on gloo ranks (where ``fully_shard`` is PyTorch's own), and the
same model trained unsharded in one process for comparison (test_fsdp2)."""
import contextlib
import dataclasses
import os
import warnings
from typing import Any, Dict, List

import torch
import torch.nn as nn

import xla_fsdp
from ranks import Rank, on_xla
from training_program import BUILD_LOCK, Run, on_rank, reference, run_sharded
from xla_fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from xla_fsdp.unit.base import unit_of

STEPS, PER_RANK, WIDTH = 3, 4, 16


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int = WIDTH, layers: int = 3):
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build() -> Net:
    with BUILD_LOCK:  # XLA:CPU rank threads share the CPU random generator
        torch.manual_seed(0)
        return Net()


def init_weights(model: nn.Module) -> None:
    """The program's own init, as FSDP2 programs run it after ``to_empty``: every Linear and
    LayerNorm drawn from a CPU generator, so the sharded and the unsharded run start alike."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.LayerNorm)):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.3 + isinstance(m, nn.LayerNorm))
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)


def batch(step: int, world_size: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(PER_RANK * world_size, 4, generator=g), torch.randn(PER_RANK * world_size, 2, generator=g)


#: program name -> (micro-batches per step, optimizer, settings)
PROGRAMS: Dict[str, Dict[str, Any]] = {
    # the tutorial's loop: blocks then root, prefetch lists (each block the next one, both ways),
    # unshard() before the batch, clipping on parameters, an LR scheduler
    "tutorial": dict(micro=1, opt="adamw"),
    # FSDP2 tutorial's prefetch of 2: each block lists the next two (forward) and the previous two (backward)
    "prefetch2": dict(micro=1, opt="adamw", prefetch=2),
    # the same with CPUOffloadPolicy: on XLA a listed block's shards are staged to the device early
    "prefetch2_offload": dict(micro=1, opt="adamw", prefetch=2, offload=True),
    # no lists: FSDP2's default, none in forward and the block that ran forward before in backward
    "default_prefetch": dict(micro=1, opt="adamw", prefetch=0),
    # gradient accumulation: no gradient sync on the first of two micro-batches
    "accumulate": dict(micro=2, opt="adamw"),
    # ... keeping the gathered parameters from the first micro-batch's backward to the next forward
    "accumulate_keep": dict(micro=2, opt="adamw", keep_after_backward=True),
    # ZeRO-2 blocks: parameters stay gathered from forward to backward
    "zero2": dict(micro=1, opt="adamw", reshard_after_forward=False),
    # summed, not averaged, gradients: SGD sees world-size times the mean gradient
    "sum_gradients": dict(micro=1, opt="sgd", divide_factor=1.0),
    "bf16": dict(micro=1, opt="adamw", mp=dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    # set_reshard_after_forward(True) on the root: it frees its own parameters after forward too
    "root_reshard": dict(micro=1, opt="adamw", root_reshard=True),
    # FSDP2's int reshard_after_forward: the first block 1 (read as False), the others the world size (True)
    "int_reshard": dict(micro=1, opt="adamw", int_reshard=True),
    # ... and half the world size on every block at 4 ranks (the world size below): each keeps its rows of
    # a group of 2 after forward, and backward gathers within that group
    "int_reshard_half": dict(micro=1, opt="adamw", int_reshard="half"),
    # FSDP2's ignored_params: every block's LayerNorm stays whole on every rank and the program averages
    # its gradients itself (no clipping: PyTorch's clip_grad_norm_ cannot mix DTensors and tensors)
    "ignored": dict(micro=1, opt="adamw", ignored=True, no_clip=True),
    # FSDP2's meta-device init: build on meta, fully_shard, to_empty, the program's init_weights.
    # XLA only: upstream FSDP2 on CPU draws each rank's shard from the same generator state, so its
    # init is not the unsharded model's (test_fsdp2::test_meta_init_draws_full_tensors_on_xla)
    "meta_init": dict(micro=1, opt="adamw", meta=True, xla_only=True),
    # a list of modules in one call, as torchtitan shards [norm, lm_head]: FSDP2 gathers them as one
    # group, xla_fsdp on XLA as one unit each
    "module_list": dict(micro=1, opt="adamw", module_list=True),
}


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2) if name == "adamw" else torch.optim.SGD(params, lr=0.05)


@dataclasses.dataclass(frozen=True)
class Fsdp2Program:
    """Program ``name`` of PROGRAMS as a program of the harness protocol (training_program.py):
    FSDP2's tutorial loop, its global batch split by rank. What the sharded run observes on XLA
    units (gathered blocks, kept pieces, issued gathers) goes into its record."""
    name: str
    steps: int = STEPS

    @property
    def config(self) -> Dict[str, Any]:
        return PROGRAMS[self.name]

    def build(self, run: Run) -> nn.Module:
        if self.config.get("meta") and run.sharded:  # FSDP2's meta-device init: shard first, then init
            with torch.device("meta"):
                return Net()
        torch.manual_seed(0)
        model = Net()
        if self.config.get("meta"):
            init_weights(model)
        return model

    def shard(self, model: nn.Module, run: Run) -> nn.Module:
        cfg, world_size, device = self.config, run.world_size, run.device
        kw: Dict[str, Any] = {}
        if "mp" in cfg:
            kw["mp_policy"] = MixedPrecisionPolicy(**cfg["mp"])
        if cfg.get("offload"):
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)  # pinned host memory needs CUDA
        for i, block in enumerate(model.blocks):
            reshard = cfg.get("reshard_after_forward", True)
            if cfg.get("int_reshard") == "half":
                reshard = world_size // 2 if world_size >= 4 else world_size
            elif cfg.get("int_reshard"):
                reshard = 1 if i == 0 else world_size
            ignored = set(block.norm.parameters()) if cfg.get("ignored") else None
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="reshard_after_forward=1")  # FSDP2's, and ours alike
                fully_shard(block, reshard_after_forward=reshard, ignored_params=ignored, **kw)
        if cfg.get("module_list"):
            pair = [model.embed, model.head]
            assert fully_shard(pair, **kw) is pair and all(isinstance(m, FSDPModule) for m in pair)
        fully_shard(model, **kw)
        if cfg.get("meta"):
            model.to_empty(device=device)
            init_weights(model)
        model.to(device)
        blocks: List[FSDPModule] = list(model.blocks)
        ahead = cfg.get("prefetch", 1)
        if ahead:
            for i, block in enumerate(blocks):
                block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + ahead])
                block.set_modules_to_backward_prefetch(blocks[max(i - ahead, 0):i][::-1])
        run.notes["issued_at_forward"], run.notes["issued_at_backward"] = _watch_gathers(blocks)
        if "divide_factor" in cfg:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(cfg["divide_factor"])
                    module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        if cfg.get("root_reshard"):
            model.set_reshard_after_forward(True, recurse=False)
        return model

    def start(self, run: Run) -> None:
        run.optimizer = _optimizer(self.config["opt"], run.model.parameters())
        run.notes["scheduler"] = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lambda step: 1.0 / (1 + step))
        # XLA units only (empty on gloo): what the blocks and the root hold after forward and after
        # unshard(), whether a micro-batch without gradient sync left the shards without gradients,
        # the output's dtype
        for key in ("kept_after_forward", "pieces_after_forward", "root_after_unshard", "root_after_forward",
                    "shard_grads_after_no_sync", "out_dtypes"):
            run.notes[key] = []

    def around_steps(self, run: Run) -> Any:
        return contextlib.nullcontext()

    def step(self, run: Run, step: int) -> None:
        cfg, model, notes, world_size, micro = self.config, run.model, run.notes, run.world_size, self.config["micro"]
        blocks = list(model.blocks)
        # summed gradients (divide factor 1): the sharded run's gradients are the world size x the mean
        scale = 1.0 if run.sharded else world_size / cfg.get("divide_factor", world_size)
        x, y = batch(step, world_size * micro)
        run.optimizer.zero_grad()
        total = 0.0
        for k in range(micro):
            if run.sharded:
                model.set_requires_gradient_sync(k == micro - 1)
                if cfg.get("keep_after_backward"):
                    model.set_reshard_after_backward(k == micro - 1)
                model.unshard()
                notes["root_after_unshard"] += _blocks_gathered([model])

            def loss_of(r: int, k: int = k) -> torch.Tensor:
                lo = (k * world_size + r) * PER_RANK
                out = model(x[lo:lo + PER_RANK].to(run.device))
                if run.sharded:
                    notes["out_dtypes"].append(str(out.dtype))
                    notes["kept_after_forward"].append(_blocks_gathered(blocks))
                    notes["pieces_after_forward"].append(_pieces(blocks))
                    notes["root_after_forward"] += _blocks_gathered([model])
                return ((out.float() - y[lo:lo + PER_RANK].to(run.device)) ** 2).mean() / micro
            loss = run.mean_over_ranks(loss_of)
            (loss * scale).backward()
            if cfg.get("ignored") and run.sharded:  # FSDP2 leaves it to the program: average the ignored gradients
                _average_over_ranks([p.grad for b in blocks for p in b.norm.parameters()], world_size, run.device)
            if run.sharded and k < micro - 1 and unit_of(model) is not None:
                units = [unit_of(m) for m in model.modules() if unit_of(m) is not None]
                notes["shard_grads_after_no_sync"].append(
                    all(g.shard.grad is None for u in units for g in u.gather_groups))
            total += loss.detach()
        if not cfg.get("no_clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        run.optimizer.step()
        notes["scheduler"].step()
        run.sync()
        run.losses.append(float(total))

    def result(self, run: Run) -> Dict[str, Any]:
        model = run.model
        if not run.sharded:
            return {"losses": run.losses, "full": {n: p.detach() for n, p in model.named_parameters()}}
        blocks = list(model.blocks)
        notes = {k: v for k, v in run.notes.items() if k != "scheduler"}
        return dict(notes, losses=run.losses, full=_full_params(model), tree=tree_facts(model),
                    is_net=isinstance(model, Net), ignored_shapes=[tuple(p.shape) for b in blocks
                                                                   for p in b.norm.parameters()],
                    **{"class": type(model).__name__})


def train_sharded(me: Rank, name: str) -> Dict[str, Any]:
    """Rank ``me``'s run of program ``name``."""
    return on_rank(me, Fsdp2Program(name))


def _average_over_ranks(grads: List[torch.Tensor], world_size: int, device) -> None:
    if device.type == "xla":
        import torch_xla.core.xla_model as xm
        xm.all_reduce(xm.REDUCE_SUM, grads, scale=1.0 / world_size)
        return
    import torch.distributed as dist
    for g in grads:
        dist.all_reduce(g)
        g.div_(world_size)


def _pieces(blocks) -> List[List[Any]]:
    """XLA units: per block and parameter, (rows kept after forward for backward, padded rows)."""
    if unit_of(blocks[0]) is None:
        return []
    return [[(g.post_forward_piece.rows.shape[0] if g.post_forward_piece else 0, g.padded_shape[0])
             for g in unit_of(b).gather_groups] for b in blocks]


def _watch_gathers(blocks: List[FSDPModule]):
    """Lists filled as training runs: when a block's own computation starts, in forward and in
    backward, which blocks' all-gathers have been issued (one tuple of bools per block run)."""
    at_forward, at_backward = [], []

    def record_backward(grad: torch.Tensor) -> None:
        at_backward.append(_blocks_issued(blocks))

    def forward_hook(module, inputs, output) -> None:
        if torch.is_grad_enabled():
            output.register_hook(record_backward)  # the block's backward starts here (after its pre-backward)

    for block in blocks:
        block.norm.register_forward_pre_hook(lambda module, inputs: at_forward.append(_blocks_issued(blocks)))
        block.down.register_forward_hook(forward_hook)
    return at_forward, at_backward


def _blocks_issued(blocks) -> tuple:
    """Whether each block's all-gather has been issued: its parameters gathered (XLA unit; FSDP2's
    group unsharded) or, for PyTorch's FSDP2, its asynchronous all-gather under way."""
    if unit_of(blocks[0]) is not None:
        return tuple(all(g.is_unsharded() for g in unit_of(b).gather_groups) for b in blocks)
    groups = [b._get_fsdp_state()._fsdp_param_group for b in blocks]
    return tuple(g.is_unsharded or g._all_gather_result is not None for g in groups)


def _blocks_gathered(blocks) -> List[bool]:
    """Whether each block holds its full parameters (XLA units; None on gloo)."""
    if unit_of(blocks[0]) is None:
        return []
    return [all(g.is_unsharded() for g in unit_of(b).gather_groups) for b in blocks]


def _full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    if unit_of(model) is not None:  # xla_fsdp's unit (XLA)
        from xla_fsdp.checkpoints.full_state import full_state_dict
        return {k: v.cpu() for k, v in (full_state_dict(model) or {}).items()}  # rank 0 only
    from torch.distributed.tensor import DTensor  # FSDP2's parameters, and ignored ones as they are
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu() for n, p in model.named_parameters()}


def tree_facts(model: nn.Module) -> Dict[str, Any]:
    """What a program sees of its model's tree (FSDP2 keeps it the program's own): parameter names,
    state-dict keys, the modules, and where an attribute set after sharding lands."""
    facts = {"names": [n for n, _ in model.named_parameters()], "keys": list(model.state_dict()),
             "modules": [type(m).__name__.replace("FSDP", "") for m in model.modules()],
             "children": [n for n, _ in model.named_children()],
             "dims": [p.dim() for p in model.parameters()], "shapes": [tuple(p.shape) for p in model.parameters()],
             "numel": sum(p.numel() for p in model.parameters())}
    # between steps the module's attribute is its registered (sharded) parameter, as in FSDP2
    facts["attribute_is_registered"] = model.blocks[0].up.weight is model.blocks[0].up._parameters["weight"]
    # the module's call is nn.Module's, with the unit's forward pre- and post-hooks on it, as FSDP2's
    facts["forward_hooks"] = [type(m).__call__ is nn.Module.__call__ and bool(m._forward_pre_hooks)
                              and bool(m._forward_hooks) for m in (model, *model.blocks)]
    # a norm of a parameter attribute between steps, through out-of-place ops: the whole tensor's (a plain
    # shard would give its rows' alone); another reduction on XLA is refused, naming the parameter and the fix
    try:
        model.blocks[0].up.weight.sum()
    except RuntimeError as e:
        facts["sum_between_steps"] = str(e)
    try:
        facts["norm_between_steps"] = float(model.blocks[0].up.weight.detach().float().norm().full_tensor())
    except RuntimeError as e:
        facts["norm_between_steps"] = str(e)
    model.blocks[0].scale = 3.0  # a plain attribute, set after sharding
    facts["attribute_is_the_modules_own"] = model.blocks[0].__dict__.get("scale") == 3.0
    del model.blocks[0].scale
    # the state dict's tensors are the parameters' shards (FSDP2's: the DTensors; xla_fsdp's: each rank's rows),
    # and load back
    state = model.state_dict()
    facts["state_is_parameters"] = all(state[n].shape == (p.rows() if hasattr(p, "rows") else p).shape
                                       for n, p in model.named_parameters())
    model.load_state_dict(state)
    return facts


def unsharded_tree_facts() -> Dict[str, Any]:
    model = Net()
    return {"names": [n for n, _ in model.named_parameters()], "keys": list(model.state_dict()),
            "modules": [type(m).__name__ for m in model.modules()], "children": [n for n, _ in model.named_children()],
            "dims": [p.dim() for p in model.parameters()], "shapes": [tuple(p.shape) for p in model.parameters()],
            "numel": sum(p.numel() for p in model.parameters())}


def train_unsharded(name: str, world_size: int) -> Dict[str, Any]:
    """The same program on the unwrapped model, fed every rank's samples at once."""
    return reference(Fsdp2Program(name), world_size)


# ----------------------------------------------------------------------------- meta-device init on XLA
def meta_init_facts(me: Rank) -> Dict[str, Any]:
    """What FSDP2's meta-init order gives on XLA devices, beyond training equality: the errors for a
    forward before ``to_empty`` and for another device; a random init draws each full tensor (rank
    blocks differ, the ranks agree); a state dict before the first forward holds the init; a
    checkpoint loaded after the init and before the first forward wins."""
    from xla_fsdp.checkpoints.full_state import full_state_dict
    from xla_fsdp.checkpoints.state_dict_api import StateDictOptions, set_model_state_dict
    rank, world_size, device = me.rank, me.world_size, me.device

    def meta_net() -> Net:
        with torch.device("meta"):
            model = Net(layers=1)
        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)

    facts: Dict[str, Any] = {}
    x = torch.ones(2, 4, device=device)
    model = meta_net()
    for key, call in (("forward_before_to_empty", lambda: model(x)),
                      ("other_device", lambda: model.to_empty(device="cuda"))):
        try:
            call()
        except (RuntimeError, ValueError) as e:
            facts[key] = str(e)
    # random init on the device: the full (16, 32)-weight is drawn, each rank keeps its rows
    model.to_empty(device=device)
    torch.manual_seed(0)
    init_weights(model)
    nn.init.normal_(model.blocks[0].down.weight)
    facts["parameters_are_shards"] = sorted(tuple(p.rows().shape) for p in model.parameters()) == sorted(
        (-(-p.shape[0] // world_size),) + tuple(p.shape[1:]) for p in Net(layers=1).parameters())
    before = full_state_dict(model)  # a state dict before the first forward
    model(x)
    after = full_state_dict(model)
    if rank == 0:
        facts["state_dict_before_forward_holds_init"] = all(torch.equal(before[k], after[k]) for k in after)
        down = after["blocks.0.down.weight"]
        blocks = down.chunk(world_size)
        facts["rank_blocks_differ"] = all(not torch.equal(blocks[0], b) for b in blocks[1:])
        facts["down_std"] = float(down.std())
    # a checkpoint loaded after init, before the first forward, is what trains
    model = meta_net()
    model.to_empty(device=device)
    init_weights(model)
    loaded = {k: torch.full_like(v, 0.25) for k, v in Net(layers=1).state_dict().items()}
    set_model_state_dict(model, loaded, options=StateDictOptions(full_state_dict=True))
    model(x)
    final = full_state_dict(model)
    if rank == 0:
        facts["loaded_wins"] = all(torch.equal(final[k], loaded[k]) for k in loaded)
    return facts


def dtensor_facts(me: Rank) -> Dict[str, Any]:
    """FSDP2's DTensor calls on XLA shards, after one training step: each parameter's placements,
    its local rows (``to_local``, no padding) and ``full_tensor()`` beside the full state dict."""
    from torch.distributed.tensor import Shard

    from xla_fsdp.checkpoints.full_state import full_state_dict
    rank, world_size, device = me.rank, me.world_size, me.device
    model = build()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batch(0, world_size)
    loss = ((model(x[rank * PER_RANK:(rank + 1) * PER_RANK].to(device)) - y[:PER_RANK].to(device)) ** 2).mean()
    loss.backward()
    opt.step()
    named = list(model.named_parameters())  # the original names, as FSDP2 gives them
    return {"placements": all(p.placements == (Shard(0),) for _, p in named),
            "local_rows": {n: p.to_local().shape[0] for n, p in named},
            "full": {n: p.full_tensor().cpu() for n, p in named},
            "state": {k: v.cpu() for k, v in (full_state_dict(model) or {}).items()},
            "refusals": _what_needs_dtensors(model, opt, named, world_size)}


def _what_needs_dtensors(model: nn.Module, opt: torch.optim.Optimizer, named, world_size: int) -> Dict[str, str]:
    """The errors (message per call) of the FSDP2 calls that need DTensor parameters (PyTorch's
    unchanged state-dict functions, ``distribute_tensor`` on a shard's ``device_mesh``)."""
    import torch.distributed.checkpoint.state_dict as dsd
    from torch.distributed.tensor import distribute_tensor
    full = dsd.StateDictOptions(full_state_dict=True)
    calls = {
        "get_model_state_dict": lambda: dsd.get_model_state_dict(model, options=full),
        "get_state_dict": lambda: dsd.get_state_dict(model, opt, options=full),
        "set_model_state_dict": lambda: dsd.set_model_state_dict(model, {}, options=full),
        "distribute_tensor": lambda: distribute_tensor(torch.zeros(2), named[0][1].device_mesh,
                                                       named[0][1].placements),
    }
    got = {}
    for name, call in calls.items():
        try:
            call()
            got[name] = "no error"
        except (RuntimeError, NotImplementedError) as e:
            got[name] = str(e)
    return got


def run_dtensor_facts(world_size: int) -> List[Dict[str, Any]]:
    return on_xla(dtensor_facts, world_size)


def run_meta_init_facts(world_size: int) -> List[Dict[str, Any]]:
    return on_xla(meta_init_facts, world_size)


def meta_init_draws(me: Rank) -> Dict[str, Any]:
    """FSDP2's meta-init order with the program's own seeded random init (``model.apply``), beside the
    same program unsharded: on the XLA device with ``xm.set_rng_state`` before ``fully_shard``, and with
    ``CPUOffloadPolicy`` and ``to_empty(device="cpu")`` from the CPU generator, there also with the
    program's ``reset_parameters`` called directly, as FSDP2's tutorial does. The full state dicts
    after the first forward, and the device seed ``fully_shard`` left."""
    import torch_xla.core.xla_model as xm
    from xla_fsdp.checkpoints.full_state import full_state_dict
    device = me.device

    def meta_net() -> nn.Sequential:
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight)
            nn.init.normal_(module.bias)

    def sharded(**kw: Any) -> nn.Module:
        model = meta_net()
        fully_shard(model[0], **kw)
        return fully_shard(model, **kw)

    out: Dict[str, Any] = {}
    xm.set_rng_state(101)
    plain = meta_net().to_empty(device=device).apply(init)
    out["xla_want"] = {k: v.cpu() for k, v in plain.state_dict().items()}
    xm.set_rng_state(101)
    model = sharded()
    out["seed_after_fully_shard"] = xm.get_rng_state()
    model.to_empty(device=device).apply(init)
    model(torch.ones(2, 8, device=device))
    out["xla_got"] = full_state_dict(model, rank0_only=False)
    model = sharded(offload_policy=CPUOffloadPolicy())
    model.to_empty(device="cpu")
    with BUILD_LOCK:  # the device threads share the CPU generator
        torch.manual_seed(5)
        out["cpu_want"] = {k: v.clone() for k, v in meta_net().to_empty(device="cpu").apply(init).state_dict().items()}
        torch.manual_seed(5)
        model.apply(init)
    model(torch.ones(2, 8, device=device))
    out["cpu_got"] = full_state_dict(model, rank0_only=False)

    class Net(nn.Module):  # the program's reset_parameters, called directly (not through model.apply)
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

        def reset_parameters(self) -> None:
            self.a.reset_parameters()
            self.b.reset_parameters()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)))

    with torch.device("meta"):
        model = Net()
    fully_shard(model.a, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    model.to_empty(device="cpu")
    with BUILD_LOCK:
        torch.manual_seed(6)
        plain = Net()
        torch.manual_seed(6)
        plain.reset_parameters()
        out["direct_want"] = {k: v.clone() for k, v in plain.state_dict().items()}
        torch.manual_seed(6)
        model.reset_parameters()
    model(torch.ones(2, 8, device=device))
    out["direct_got"] = full_state_dict(model, rank0_only=False)
    xla_fsdp.sync()
    return out


def step_cut_facts(me: Rank, mode: str) -> Dict[str, Any]:
    """The FSDP2 tutorial's loop (forward, backward, ``clip_grad_norm_``, step, ``zero_grad``, the
    loss read back) on XLA for 6 steps, every rank on the same batches, with ``mode``: ``none`` (no
    sync in the program, as FSDP2 programs are), ``off`` (the same with
    ``set_sync_after_optimizer_step(False)``), ``own`` (the program syncs after each step) or
    ``unwrapped`` (the model unsharded, syncing after each step). Per step: the graphs compiled and
    the step markers run (process-wide counters: read at one device); the losses."""
    import torch_xla.debug.metrics as met
    device = me.device
    with BUILD_LOCK:
        torch.manual_seed(0)
        model = Net().to(device)
    if mode != "unwrapped":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    if mode == "off":
        model.set_sync_after_optimizer_step(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiles, marks, losses = [], [], []
    for step in range(6):
        compiled, marked = (met.metric_data("CompileTime") or (0,))[0], met.counter_value("MarkStep") or 0
        x = torch.randn(PER_RANK, 4, generator=torch.Generator().manual_seed(step)).to(device)
        loss = model(x).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if mode in ("own", "unwrapped"):
            xla_fsdp.sync()
        compiles.append((met.metric_data("CompileTime") or (0,))[0] - compiled)
        marks.append((met.counter_value("MarkStep") or 0) - marked)
    return {"compiles": compiles, "marks": marks, "losses": losses}


# ----------------------------------------------------------------------------- runners
def run_xla(names: List[str], world_size: int) -> Dict[str, List[Dict[str, Any]]]:
    """Every program on ``world_size`` XLA:CPU devices (threads of one spawned process)."""
    return dict(zip(names, run_sharded([Fsdp2Program(n) for n in names], world_size, "xla")))


def run_gloo(names: List[str], world_size: int) -> Dict[str, List[Dict[str, Any]]]:
    """Every program on ``world_size`` gloo processes (PyTorch's own ``fully_shard``); each rank leaves
    without Python's teardown (FSDP2's gloo tensors: see ``ranks._exit_without_teardown``)."""
    names = [n for n in names if not PROGRAMS[n].get("xla_only")]
    runs = run_sharded([Fsdp2Program(n) for n in names], world_size, "torch", hard_exit=True, weights_only=True)
    return dict(zip(names, runs))


# ----------------------------------------------------------------------------- ignored_params, saved
def ignored_checkpoint_facts(me: Rank, folder: str) -> Dict[str, Any]:
    """Modules with ``ignored_params`` (each block's LayerNorm) through the checkpoint paths: a full
    state dict (state_dict_api) and sharded rank files (save/load, consolidation) carry the ignored
    parameters under their names, and loading sets them."""
    import xla_fsdp
    from xla_fsdp.checkpoints import state_dict_api as sda
    from xla_fsdp.checkpoints.consolidate import consolidate_sharded_model_checkpoints
    rank, device = me.rank, me.device

    def make() -> nn.Module:
        model = build()
        for block in model.blocks:
            fully_shard(block, ignored_params=set(block.norm.parameters()))
        return fully_shard(model).to(device)

    model = make()
    with torch.no_grad():
        model.blocks[0].norm.weight.add_(1.5)  # 2.5 where the unsharded init has 1.0
    full = sda.get_model_state_dict(model, options=sda.StateDictOptions(full_state_dict=True))
    prefix = os.path.join(folder, "ck")
    xla_fsdp.save_sharded_checkpoint(model, None, prefix)
    from_files, from_full = make(), make()
    xla_fsdp.load_sharded_checkpoint(from_files, None, prefix)
    sda.set_model_state_dict(from_full, full, options=sda.StateDictOptions(full_state_dict=True))
    facts = {"loaded_from_files": from_files.blocks[0].norm.weight.cpu().tolist(),
             "loaded_from_full": from_full.blocks[0].norm.weight.cpu().tolist()}
    if rank == 0:
        consolidated, _ = consolidate_sharded_model_checkpoints(prefix, save_model=False)
        facts["full"] = full["blocks.0.norm.weight"].tolist()
        facts["consolidated"] = consolidated["blocks.0.norm.weight"].tolist()
        facts["same_keys"] = sorted(consolidated) == sorted(full) == sorted(build().state_dict())
    return facts


def run_ignored_checkpoint_facts(world_size: int, folder: str) -> List[Dict[str, Any]]:
    return on_xla(ignored_checkpoint_facts, world_size, folder)


# ----------------------------------------------------------------------------- the sharded parameter on XLA
def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, on the host: a DTensor-like's ``full_tensor()`` (a collective), or the tensor."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()


def _no_decay_by_dim(model: nn.Module) -> List[Dict[str, Any]]:
    """nanoGPT's and torchtitan's recipe: matrices decay, vectors do not, read from ``p.dim()``; and parameters
    of more than 100 elements get a lower learning rate, read from ``p.numel()`` (on a shard's rows alone the
    recipe would split otherwise)."""
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named if p.dim() >= 2 and p.numel() > 100], "weight_decay": 0.1, "lr": 5e-3},
            {"params": [p for _, p in named if p.dim() >= 2 and p.numel() <= 100], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]


def _between_steps(model: nn.Module, step: int) -> None:
    """A program's own edits between steps, through the module's attributes: freezing and unfreezing, and
    element-wise changes of values under no_grad (an init of one tensor, a rescale, a clamp, a fill)."""
    if step == 1:
        model.blocks[0].up.weight.requires_grad_(False)
    if step == 3:
        model.blocks[0].up.weight.requires_grad = True
    if step == 2:
        with torch.no_grad():
            nn.init.zeros_(model.blocks[0].up.bias)
            model.blocks[2].down.weight.mul_(0.5)
            model.head.weight.clamp_(-0.05, 0.05)
            model.embed.bias.fill_(0.01)
        model.blocks[1].down.weight.data.mul_(0.9)  # through .data, as older init code writes


def sharded_param_facts(me: Rank) -> Dict[str, Any]:
    """An FSDP2 program's own uses of its parameters, on ``fully_shard``'s parameters on XLA and on the same
    model unsharded in this rank (each step the same batch on every rank): optimizer groups by ``p.dim()`` and
    ``p.numel()``, freezing and editing through module attributes between steps, a gradient hook registered on
    a parameter, clipping, an EMA of ``p.detach()``, each parameter's norm; then what is refused (naming the
    parameter), a state dict through ``torch.save`` and ``weights_only`` loads, a deep copy, a cast."""
    import copy
    import io
    device = me.device
    models = [build().to(device), build().to(device)]  # sharded, unsharded
    model, ref = models
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    facts: Dict[str, Any] = {
        "shapes": [(n, tuple(p.shape), p.numel(), p.dim()) for n, p in model.named_parameters()],
        "want_shapes": [(n, tuple(p.shape), p.numel(), p.dim()) for n, p in ref.named_parameters()],
        "attributes_are_registered": all(m._parameters[n] is getattr(m, n) for m in model.modules()
                                         for n in m._parameters),
        "is_parameter": all(isinstance(p, nn.Parameter) for p in model.parameters()),
        "repr": repr(model.blocks[1].up.weight)}
    opts = [torch.optim.AdamW(_no_decay_by_dim(m), lr=1e-2) for m in models]
    for m in models:
        m.blocks[1].up.weight.register_hook(lambda g: g * 0.5)
    emas = [[p.detach().clone() for p in m.parameters()] for m in models]
    losses, clip_norms = [], []  # (sharded, unsharded) per step, read at the end (one graph per step)
    for step in range(4):
        x, y = (t.to(device) for t in batch(step, 1))
        got = []
        for m, opt, ema in zip(models, opts, emas):
            _between_steps(m, step)
            loss = ((m(x) - y) ** 2).mean()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for e, p in zip(ema, m.parameters()):
                    e.mul_(0.9).add_(p.detach(), alpha=0.1)
            got.append((loss.detach(), norm.detach()))
        losses.append((got[0][0], got[1][0]))
        clip_norms.append((got[0][1], got[1][1]))
        me.sync()
    # a step that raises (an lr the program set wrong) changes nothing; the next one trains as unsharded, and
    # the optimizer holds the parameters and keys its state by them, as before (its steps take the shards)
    x, y = (t.to(device) for t in batch(4, 1))
    for m, opt in zip(models, opts):
        ((m(x) - y) ** 2).mean().backward()
        lr, opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"], "wrong"
        try:
            opt.step()
        except TypeError:
            pass
        opt.param_groups[0]["lr"] = lr
        opt.step()
        opt.zero_grad()
    me.sync()
    ids = {id(p) for p in model.parameters()}
    facts["optimizer_holds_parameters"] = ({id(p) for g in opts[0].param_groups for p in g["params"]} == ids
                                           and {id(p) for p in opts[0].state} == ids)
    param_norms = [(p.norm(), q.norm()) for p, q in zip(model.parameters(), ref.parameters())]
    params = [(n, p.full_tensor(), q) for (n, p), q in zip(model.named_parameters(), ref.parameters())]
    ema_pairs = [(e.full_tensor(), f) for e, f in zip(*emas)]
    me.sync()  # the norms' and the full tensors' collectives in one graph, then read
    for key, pairs in (("losses", losses), ("clip_norms", clip_norms), ("param_norms", param_norms)):
        facts[key] = [(float(a), float(b)) for a, b in pairs]
    facts["params"] = [(n, _whole(p), _whole(q)) for n, p, q in params]
    facts["emas"] = [(_whole(e), _whole(f)) for e, f in ema_pairs]
    weight = model.blocks[1].up.weight
    facts["refused"] = {}
    for name, call in (("sum", lambda: weight.sum()), ("index", lambda: weight[0]),
                       ("normal_", lambda: nn.init.normal_(weight)), ("matmul", lambda: weight @ weight.T),
                       ("view", lambda: weight.view(-1)), ("bfloat16", lambda: model.bfloat16()),
                       ("matrix_norm", lambda: torch.linalg.norm(weight, 2)),
                       ("assign", lambda: model.load_state_dict(model.state_dict(), assign=True)),
                       ("whole_shaped", lambda: weight + torch.ones(weight.shape, device=device)),
                       ("data", lambda: setattr(weight, "data", torch.zeros(weight.shape, device=device)))):
        try:
            call()
            facts["refused"][name] = "no error"
        except (RuntimeError, NotImplementedError) as e:
            facts["refused"][name] = str(e)
    facts["dtype_after_cast"] = str(model.blocks[1].up.weight.dtype)
    before = [_whole(p) for p in model.parameters()]
    for keep_vars in (False, True):
        buf = io.BytesIO()
        torch.save(model.state_dict(keep_vars=keep_vars), buf)
        buf.seek(0)
        model.load_state_dict(torch.load(buf, weights_only=True))
    facts["state_dict_round_trip"] = all(torch.equal(a, _whole(p)) for a, p in zip(before, model.parameters()))
    facts["deepcopy"] = torch.equal(_whole(copy.deepcopy(weight)), _whole(weight))
    return facts


def run_sharded_param_facts(world_size: int) -> List[Dict[str, Any]]:
    return on_xla(sharded_param_facts, world_size)
