"""The torch transport on this machine's accelerator: CUDA under NCCL, XPU under XCCL, a PrivateUse1
device under its own backend, chosen from ``torch.accelerator`` and the group's backend config.
Sharded training there matches the same model trained unsharded on that device; offloaded shards
are pinned; a training checkpoint saves, resumes (the device's generator included) and
consolidates there. One rank per device (``min(2, device count)`` ranks).

CI machines have no accelerator: every test here skips there with the reason. docs/testing.md
says where and when they last ran on one."""
import os
import subprocess
import sys
import tempfile

import pytest
import torch

import harness
import models
from ranks import Rank, end_process_group, free_port

ACCELERATOR = torch.accelerator.current_accelerator(check_available=True)
pytestmark = pytest.mark.skipif(ACCELERATOR is None, reason="needs an accelerator (CUDA, XPU or a PrivateUse1 "
                                                            "device); this machine has none")
TOL = 1e-5
# fp32 configurations across the layouts and strategies, clipping, no_sync, offload, remat, BatchNorm
CONFIGS = ["zero3_nested_adamw", "zero2_nested_adamw", "flatten_nested_adamw", "dim0_nested_sgd",
           "strategy_shard_grad_op_adamw", "strategy_no_shard_adamw", "tied_param_adamw", "no_sync_adamw",
           "clip_adamw", "checkpoint_lm_adamw", "convbn_sgd", "offload_zero3_sgd"]


def _world_size() -> int:
    return min(2, torch.accelerator.device_count()) if ACCELERATOR is not None else 0


def _init(rank: int, world_size: int, port: int) -> torch.device:
    import torch.distributed as dist
    torch.set_num_threads(1)
    torch.accelerator.set_device_index(rank)
    backend = dist.Backend.default_device_backend_map[ACCELERATOR.type]
    dist.init_process_group(f"cpu:gloo,{ACCELERATOR.type}:{backend}", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size)
    return torch.device(ACCELERATOR.type, rank)


def _training_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    device = _init(rank, world_size, port)
    try:
        me = Rank.of_torch_group(device, torch.accelerator.synchronize)
        results = {}
        for name in CONFIGS:
            results[name] = harness.train_sharded(me, name)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        end_process_group()


@pytest.fixture(scope="module")
def runs():
    import torch.multiprocessing as mp
    world_size = _world_size()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_training_worker, args=(world_size, free_port(), out_dir), nprocs=world_size)
        per_rank = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    return {n: [per_rank[r][n] for r in range(world_size)] for n in CONFIGS}


@pytest.mark.parametrize("name", CONFIGS)
def test_matches_unsharded_on_the_accelerator(runs, name):
    """Sharded on the accelerator's backend vs the same model trained unsharded on the same device."""
    world_size = _world_size()
    ref = harness.train_reference(name, world_size, device=torch.device(ACCELERATOR.type, 0))
    ranks = runs[name]
    if not name.startswith("offload"):  # trained there, not on the host
        assert ranks[0]["devices"] == [f"{ACCELERATOR.type}:0"], ranks[0]["devices"]
    tol = harness.CONFIGS[name].get("tol", TOL)
    losses = [sum(r["losses"][s] for r in ranks) / world_size for s in range(harness.STEPS)]
    assert max(abs(a - b) for a, b in zip(losses, ref["losses"])) <= tol, (losses, ref["losses"])
    full = harness.consolidate(ranks)
    assert set(full) == set(ref["state_dict"])
    for key, want in ref["state_dict"].items():
        if "running_" in key or "num_batches" in key:
            continue  # BatchNorm statistics are per rank by design (like DDP)
        dev = (full[key] - want.cpu()).abs().max().item()
        assert dev <= tol, (key, dev)
    if harness.CONFIGS[name].get("clip"):
        for r in ranks:
            assert max(abs(a - b) for a, b in zip(r["norms"], ref["norms"])) <= TOL


def test_offloaded_shards_are_pinned(runs):
    assert all(r["host_shards_pinned"] for r in runs["offload_zero3_sgd"])
    assert runs["offload_zero3_sgd"][0]["host_shards_pinned"] is not None


def _resume_worker(rank: int, world_size: int, port: int, ckpt_dir: str, out_dir: str) -> None:
    import xla_fsdp
    from xla_fsdp.checkpoints import full_state_dict, resume_training, save_training_checkpoint
    device = _init(rank, world_size, port)

    def steps(wrapped, opt, start, stop):
        losses = []
        for step in range(start, stop):
            opt.zero_grad()
            x, y = (t.to(device) for t in models.batch("mlp", step, rank))
            loss = models.loss_fn("mlp", torch.nn.functional.dropout(wrapped(x), 0.3), y)  # the device's generator
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    def build(seed):
        wrapped = xla_fsdp.XlaFullyShardedDataParallel(models.make_model("mlp", seed))
        return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2)

    try:
        wrapped, opt = build(0)
        steps(wrapped, opt, 0, 3)
        save_training_checkpoint(wrapped, opt, ckpt_dir, 3)
        straight = steps(wrapped, opt, 3, 6)
        xla_fsdp.save_sharded_checkpoint(wrapped, opt, os.path.join(ckpt_dir, "final"))
        final = {k: v.cpu() for k, v in wrapped.state_dict().items()}
        final_full = {k: v.cpu() for k, v in full_state_dict(wrapped, rank0_only=False).items()}
        del wrapped, opt
        wrapped, opt = build(1)  # other weights: the checkpoint must replace them
        resumed_at = resume_training(wrapped, opt, ckpt_dir).step
        resumed = steps(wrapped, opt, 3, 6)
        torch.save({"straight": straight, "resumed": resumed, "resumed_at": resumed_at, "final": final,
                    "final_full": final_full,
                    "resumed_final": {k: v.cpu() for k, v in wrapped.state_dict().items()}},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        del wrapped, opt
    finally:
        end_process_group()


def test_training_checkpoint_resumes_and_consolidates_on_the_accelerator(tmp_path):
    """Save at step 3, train to 6; a model built from other weights resumes at 3 and trains the same
    steps to the same losses and weights (dropout draws from the device's generator, restored); the
    sharded checkpoint consolidates with the CLI into the unwrapped model's state dict."""
    import torch.multiprocessing as mp
    world_size = _world_size()
    ckpt_dir, out_dir = tmp_path / "ckpt", tmp_path / "out"
    out_dir.mkdir()
    mp.spawn(_resume_worker, args=(world_size, free_port(), str(ckpt_dir), str(out_dir)), nprocs=world_size)
    got = torch.load(out_dir / "rank0.pt", weights_only=True)
    assert got["resumed_at"] == 3
    assert max(abs(a - b) for a, b in zip(got["resumed"], got["straight"])) <= 1e-6, (got["resumed"], got["straight"])
    for key, value in got["final"].items():
        assert (got["resumed_final"][key] - value).abs().max().item() <= 1e-6, key
    out = tmp_path / "full.pth"
    subprocess.run([sys.executable, "-m", "xla_fsdp.consolidate_sharded_ckpts", "--ckpt_prefix",
                    str(ckpt_dir / "final"), "--save_path", str(out)], check=True)
    full = torch.load(out, weights_only=True)["model"]
    plain = models.make_model("mlp")
    plain.load_state_dict(full)  # strict: every name of the unwrapped model, nothing else
    for key, value in got["final_full"].items():
        assert torch.equal(full[key], value), key
