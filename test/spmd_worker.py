"""One SPMD process: ``python spmd_worker.py DEVICES OUT_JSON CONFIG,... [--save P] [--load P]``.

Trains each harness config with ``xla_fsdp.spmd`` on DEVICES XLA:CPU devices (the global batch of
DEVICES x 4 samples split over them) beside the same model unsharded on the CPU, and writes per
config the largest loss and parameter differences, the compilations of each step, and the
sharding of the master shards. ``--save P`` / ``--load P`` save or load a sharded checkpoint at
prefix P (``{name}`` in P is the config) and write the model's full state to P + '.full.pt'."""
import json
import os
import sys

DEVICES = int(sys.argv[1])
os.environ.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(DEVICES))

import torch  # noqa: E402

import xla_fsdp  # noqa: E402
import xla_fsdp.spmd as spmd  # noqa: E402

spmd.enable()

import torch_xla  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from xla_fsdp.integrations.accelerate_config import from_accelerate  # noqa: E402
import models  # noqa: E402
from xla_fsdp.unit.base import ShardedUnit  # noqa: E402

STEPS = 5


def compiles() -> int:
    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


def _class(**kw):
    """The public class itself (the harness configs wrap with the per-device class, then annotate)."""
    return lambda model: spmd.SpmdFullyShardedDataParallel(model, auto_wrap_policy=harness.BLOCK_POLICY, **kw)


#: configs built with SpmdFullyShardedDataParallel: a transformer auto-wrapped by block, 1-D and hybrid
CLASS_CONFIGS = {
    "class_lm_adamw": {"model": "lm", "opt": "adamw", "build": lambda: _class()},
    "class_zero2_lm_sgd": {"model": "lm", "opt": "sgd", "build": lambda: _class(sharding_strategy="SHARD_GRAD_OP")},
    "accelerate_v2_lm_adamw": {"model": "lm", "opt": "adamw", "build": lambda: lambda model: from_accelerate(
        {"xla_fsdp_v2": True, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
         "fsdp_transformer_layer_cls_to_wrap": "Block"}, model).wrap(model)},
    "class_hybrid_lm_adamw": {"model": "lm", "opt": "adamw", "build": lambda: _class(
        mesh=spmd.make_mesh(replicas=2), sharding_strategy="HYBRID_SHARD")},
    # FSDPv2's shard_output= keyword, called on every unit's output
    "class_shard_output_lm_sgd": {"model": "lm", "opt": "sgd", "build": lambda: _class(shard_output=_counted_split)},
}
SHARD_OUTPUT_CALLS = []


def _counted_split(output, mesh):
    SHARD_OUTPUT_CALLS.append(type(output).__name__)
    spmd.split_by_batch(output, mesh)


def refusals() -> dict:
    """What the class says to settings it cannot honour."""
    said = {}
    for key, kw in {"no_shard": {"sharding_strategy": "NO_SHARD"},
                    "hybrid_without_replicas": {"sharding_strategy": "HYBRID_SHARD"},
                    "groups": {"sharding_groups": [[0]], "sharding_rank": 0, "sharding_world_size": 1}}.items():
        try:
            spmd.SpmdFullyShardedDataParallel(torch.nn.Linear(2, 2), **kw)
            said[key] = None
        except ValueError as e:
            said[key] = str(e)
    return said


def run(name: str, save: str, load: str) -> dict:
    if name in CLASS_CONFIGS:
        special = CLASS_CONFIGS[name]
        cfg = {"model": special["model"], "opt": special["opt"], "wrap": special["build"]()}
    else:
        cfg = harness.CONFIGS[name]
    reference = models.make_model(cfg["model"])
    ref_opt = harness.make_optimizer(cfg["opt"], reference)
    # built on the CPU and moved by the wrapper: module.to(xla) before wrapping unties shared
    # parameters (torch gives each module its own converted Parameter)
    wrapped = cfg["wrap"](models.make_model(cfg["model"]))
    if not isinstance(wrapped, spmd.SpmdFullyShardedDataParallel):
        spmd.shard_over_mesh(wrapped, spmd.make_mesh())
    opt = harness.make_optimizer(cfg["opt"], wrapped)
    device = torch_xla.device()
    result = {"loss": 0.0, "compiles": [], "norm": 0.0, "grad_views": 0}
    if load:
        xla_fsdp.load_sharded_checkpoint(wrapped, opt, load.format(name=name))
        steps = 0
    else:
        steps = STEPS
    for step in range(steps):
        x, y = models.batch(cfg["model"], step, 0, 4 * DEVICES)  # the global batch: every rank's samples
        before = compiles()
        out = wrapped(spmd.shard_batch(x.to(device)))
        loss = models.loss_fn(cfg["model"], out, y.to(device))
        loss.backward()
        # A gradient that is a view keeps its base alive: on XLA both are outputs of the step graph
        # (one more full-size write per parameter, each step).
        result["grad_views"] = max(result["grad_views"], sum(p.grad._base is not None for p in wrapped.parameters()
                                                             if p.grad is not None))
        norm = wrapped.clip_grad_norm_(cfg["clip"]) if cfg.get("clip") else None
        opt.step()
        opt.zero_grad()
        xla_fsdp.sync()
        result["compiles"].append(compiles() - before)
        ref_loss = models.loss_fn(cfg["model"], reference(x), y)
        ref_loss.backward()
        if cfg.get("clip"):
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg["clip"])
            result["norm"] = max(result["norm"], abs(float(norm) - float(ref_norm)))
        ref_opt.step()
        ref_opt.zero_grad()
        result["loss"] = max(result["loss"], abs(loss.item() - ref_loss.item()))
    full = xla_fsdp.checkpoints.full_state_dict(wrapped)
    params = dict(reference.named_parameters())
    result["params"] = max((full[k].float() - p.float()).abs().max().item() for k, p in params.items())
    result["buffers"] = max([(full[k].float() - b.float()).abs().max().item() for k, b in reference.named_buffers()]
                            or [0.0])
    if name == "class_shard_output_lm_sgd":
        result["shard_output_calls"] = len(SHARD_OUTPUT_CALLS)
        result["units"] = sum(isinstance(m, ShardedUnit) for m in wrapped.modules())
    result["shardings"] = sorted({torch_xla._XLAC._get_xla_sharding_spec(p) for p in wrapped.parameters()})
    result["optimizer_shardings"] = sorted({torch_xla._XLAC._get_xla_sharding_spec(t) for s in opt.state.values()
                                            for t in s.values() if torch.is_tensor(t) and t.dim() > 0})
    for prefix in (save, load):
        if prefix:
            path = prefix.format(name=name)
            if prefix is save:
                xla_fsdp.save_sharded_checkpoint(wrapped, opt, path)
            full_optim = xla_fsdp.checkpoints.full_optim_state_dict(wrapped, opt)
            torch.save({"model": full, "optimizer": full_optim}, path + ".full.pt")
    return result


if __name__ == "__main__":
    out, names = sys.argv[2], sys.argv[3].split(",")
    save = sys.argv[sys.argv.index("--save") + 1] if "--save" in sys.argv else ""
    load = sys.argv[sys.argv.index("--load") + 1] if "--load" in sys.argv else ""
    results = {name: run(name, save, load) for name in names}
    if "--refusals" in sys.argv:
        results["refusals"] = refusals()
    with open(out, "w") as f:
        json.dump(results, f)
