"""PyTorch FSDP2 (``fully_shard``) training of the harness's configs on gloo, saving and loading
with ``torch.distributed.checkpoint`` the way the FSDP2 tutorials do (``get_state_dict`` /
``set_state_dict``, ``dcp.save`` / ``dcp.load`` of ``{"model": ..., "optim": ...}``): the other
side of the DCP interop tests."""
from typing import Any, Dict, Optional

import harness
import models
from ranks import Rank, on_gloo


def _torchtitan_state(model, opt, step: int) -> Dict[str, Any]:
    """What torchtitan's CheckpointManager hands dcp.save: the model's keys at the top level, the
    optimizer's flattened (``state.<name>.<field>``, ``param_groups.<name>.<hyperparameter>``),
    and its other states beside them."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    return {**get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, opt, options=StateDictOptions(
                flatten_optimizer_state_dict=True)),
            "lr_scheduler": {"last_epoch": step}, "train_state": {"step": step}}


def _train(me: Rank, name: str, steps: int, start: int, per_rank: int, load_dir: Optional[str],
           save_dir: Optional[str], layout: str) -> Dict[str, Any]:
    """Rank ``me``'s run: its losses and the full model state at the end."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                         set_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    rank, world_size = me.rank, me.world_size
    cfg = harness.CONFIGS[name]
    model = models.make_model(cfg["model"])
    mesh = init_device_mesh("cpu", (world_size,))
    for child in model.children():  # a unit per layer, as the tutorial wraps each block
        if any(p.requires_grad for p in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = harness.make_optimizer(cfg["opt"], model)
    if load_dir:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=load_dir)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = []
    for step in range(start, start + steps):
        opt.zero_grad()
        x, y = models.batch(cfg["model"], step, rank, per_rank)
        loss = models.loss_fn(cfg["model"], model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if save_dir and layout == "torchtitan":
        dcp.save(_torchtitan_state(model, opt, start + steps), checkpoint_id=save_dir)
    elif save_dir:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=save_dir)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"losses": losses, "full": full}


def run(name: str, world_size: int, steps: int, start: int = 0, per_rank: int = 4, load_dir: Optional[str] = None,
        save_dir: Optional[str] = None, layout: str = "tutorial") -> Dict[str, Any]:
    """Train ``steps`` steps on ``world_size`` gloo ranks; returns the global-batch losses (mean of
    the ranks' equal-sized batches) and the full model state at the end. ``layout``: how the save
    is laid out, the tutorials' ``{"model", "optim"}`` or ``"torchtitan"``'s."""
    # FSDP2 hands gloo its own tensors, and gloo's thread may free them as Python exits, aborting a rank
    # after its results are written: each rank leaves without Python's teardown (hard_exit)
    ranks = on_gloo(_train, world_size, name, steps, start, per_rank, load_dir, save_dir, layout, hard_exit=True,
                    weights_only=False)
    losses = [sum(r["losses"][i] for r in ranks) / world_size for i in range(steps)]
    return {"losses": losses, "full": ranks[0]["full"]}
