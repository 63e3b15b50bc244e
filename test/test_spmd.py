"""The SPMD mode: ``xla_fsdp.spmd`` builds xla_fsdp's units at world size 1
in torch_xla's SPMD runtime and annotates their shards over the devices. Each case runs in its
own process (SPMD and the per-device mode cannot share one): 5 steps equal unsharded training
(1e-5 fp32, losses and parameters) at 1, 2 and 4 XLA:CPU devices for the test models
(transformer with Embedding, remat, conv net with BatchNorm, weights tied across units, frozen
parameters, dim-0 shards, clipping; SGD and AdamW), with no compilation after step 2 and the
shards, their gradients' consumers and the optimizer state split over every device. A checkpoint
moves from the SPMD mode to the per-device mode at 4 devices and back, bit for bit."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = ["zero3_nested_sgd", "zero3_nested_adamw", "zero2_nested_adamw", "flatten_nested_adamw", "dim0_nested_sgd",
           "autowrap_type_lm_adamw", "checkpoint_lm_adamw", "frozen_flat_adamw", "tied_param_adamw",
           "tied_across_units_adamw", "convbn_sgd", "clip_adamw"]
TOL = 1e-5
# XLA's BatchNorm moves running_var by the biased batch variance; torch's CPU kernel by the unbiased
# one (9e-4 apart after 5 steps here, the same without SPMD): buffers get their own bound.
BUFFER_TOL = 2e-3

pytestmark = pytest.mark.xla  # every test here runs on XLA:CPU devices


def spmd(devices, names, out_dir, *extra):
    out = os.path.join(out_dir, f"spmd{devices}.json")
    env = dict(os.environ)
    env.pop("PJRT_DEVICE", None)
    env.pop("CPU_NUM_DEVICES", None)
    done = subprocess.run([sys.executable, os.path.join(HERE, "spmd_worker.py"), str(devices), out, ",".join(names),
                           *extra], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.load(open(out))


# built by SpmdFullyShardedDataParallel itself, and by an Accelerate config with xla_fsdp_v2: true
CLASS = ["class_lm_adamw", "class_zero2_lm_sgd", "accelerate_v2_lm_adamw", "class_shard_output_lm_sgd"]


@pytest.mark.parametrize("devices", [1, 2, 4])
def test_spmd_mode_trains_like_unsharded_without_recompiling(devices, tmp_path):
    names = CONFIGS + CLASS + (["class_hybrid_lm_adamw"] if devices == 4 else [])
    results = spmd(devices, names, str(tmp_path), "--refusals")
    for name in names:
        r = results[name]
        assert r["loss"] <= TOL and r["params"] <= TOL and r["norm"] <= TOL, (name, r)
        assert r["buffers"] <= BUFFER_TOL, (name, r)
        assert r["compiles"][2:] == [0, 0, 0], (name, r["compiles"])
        assert r["grad_views"] == 0, (name, r["grad_views"])  # shard gradients own their data
        if devices > 1 and "hybrid" not in name:  # every master shard and optimizer tensor split over the devices
            assert all(_pieces(s) == (devices, 1) for s in r["shardings"]), (name, r["shardings"])
            assert all(_pieces(s) == (devices, 1) for s in r["optimizer_shardings"]), (name, r)
    custom = results["class_shard_output_lm_sgd"]  # the user's shard_output saw every unit's output, every step
    assert custom["units"] > 1 and custom["shard_output_calls"] == 5 * custom["units"], custom
    if devices == 4:  # hybrid: split over 2 devices, copied along the replica axis
        hybrid = results["class_hybrid_lm_adamw"]
        assert all(_pieces(s) == (2, 2) for s in hybrid["shardings"] + hybrid["optimizer_shardings"]), hybrid
    said = results["refusals"]
    assert "NO_SHARD in SPMD mode is plain data parallel" in said["no_shard"]
    assert "needs a mesh with a 'replica' axis" in said["hybrid_without_replicas"]
    assert "sharding_groups= is for the per-device mode" in said["groups"]


def _pieces(sharding):
    """(pieces a tensor is split into, copies of each piece) of an XLA sharding string such as
    ``{devices=[1,4]0,1,2,3}`` or ``{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}``."""
    assert sharding.startswith("{devices=["), sharding
    tiles = [int(n) for n in sharding[len("{devices=["):sharding.index("]")].split(",")]
    copies = tiles.pop() if "last_tile_dim_replicate" in sharding else 1
    return math.prod(tiles), copies


def _full(path):
    return torch.load(path, weights_only=True)


def _assert_equal_states(a, b):
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for k, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            other = b["optimizer"]["state"][k][key]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (k, key)


def test_a_checkpoint_moves_between_spmd_and_per_device_mode_bit_for_bit(tmp_path):
    names = ["zero3_nested_adamw", "tied_across_units_adamw", "dim0_nested_sgd"]
    spmd_prefix = str(tmp_path / "spmd-{name}")
    spmd(4, names, str(tmp_path), "--save", spmd_prefix)
    # SPMD's files (world size 1) load into the per-device mode at 4 ranks, which saves its own
    device_prefix = str(tmp_path / "device-{name}")
    per_device = harness.run_xla(names, 4, steps=0, load_prefix=spmd_prefix, save_prefix=device_prefix,
                                 full_state=True)
    # ... and back into the SPMD mode
    back_prefix = str(tmp_path / "device-{name}")
    spmd(4, names, str(tmp_path), "--load", back_prefix)
    for name in names:
        trained = _full(spmd_prefix.format(name=name) + ".full.pt")
        ranks = per_device[name]
        in_device_mode = {"model": ranks[0]["full"], "optimizer": ranks[0]["full_optim"]}
        _assert_equal_states(trained, in_device_mode)
        _assert_equal_states(trained, _full(back_prefix.format(name=name) + ".full.pt"))
        assert ranks[0]["metadata"]["world_size"] == 4


@pytest.mark.fast
def test_default_shard_output_picks_the_batch_tensor_of_each_output_kind():
    from collections import OrderedDict

    from xla_fsdp.spmd.wrapper import _first_tensor
    logits, hidden = torch.zeros(4, 3, 5), torch.zeros(4, 3, 2)
    assert _first_tensor(logits) is logits
    assert _first_tensor((hidden, None)) is hidden and _first_tensor([[hidden], logits]) is hidden
    # a Hugging Face ModelOutput is an OrderedDict whose first value may be the scalar loss
    assert _first_tensor(OrderedDict(loss=torch.tensor(1.0), logits=logits)) is logits
    assert _first_tensor(None) is None and _first_tensor(()) is None and _first_tensor({"n": 3}) is None
