"""A training script written the way torch_xla's FSDP examples are (torch_xla.launch, MpDeviceLoader,
accuracy by xm.mesh_reduce, xm.rendezvous before saving, per-rank xm.save of model + shard metadata +
optimizer, consolidation at the end), with xla_fsdp as the FSDP. Data: scikit-learn's handwritten
digits (shipped with scikit-learn, no download).

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python test/torch_xla_style_digits.py --ckpt_dir DIR

Prints ``RESULT {json}``: per-epoch test accuracy (as every rank saw it) and the consolidated
model's accuracy.
"""
import argparse
import json
import os
import sys
import threading

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import xla_fsdp  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.distributed.parallel_loader as pl  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
from xla_fsdp import XlaFullyShardedDataParallel as FSDP, consolidate_sharded_model_checkpoints  # noqa: E402


def digits():
    from sklearn.datasets import load_digits
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(y), generator=g)
    split = int(0.8 * len(y))
    return (x[order[:split]], y[order[:split]]), (x[order[split:]], y[order[split:]])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


# XLA:CPU devices are threads sharing the CPU RNG (docs/usage.md, "Several XLA:CPU devices": seed and build
# under a lock)
BUILD = threading.Lock()


def _mp_fn(index, flags):
    device = torch_xla.device()
    rank, world_size = xr.global_ordinal(), xr.world_size()
    (train_x, train_y), (test_x, test_y) = digits()
    train = torch.utils.data.TensorDataset(train_x, train_y)
    test = torch.utils.data.TensorDataset(test_x, test_y)
    train_sampler = torch.utils.data.distributed.DistributedSampler(train, world_size, rank, shuffle=True, seed=0)
    test_sampler = torch.utils.data.distributed.DistributedSampler(test, world_size, rank, shuffle=False)
    train_loader = torch.utils.data.DataLoader(
        train, batch_size=flags.batch_size, sampler=train_sampler, drop_last=True
    )
    test_loader = torch.utils.data.DataLoader(test, batch_size=64, sampler=test_sampler)
    with BUILD:
        torch.manual_seed(1)
        model = FSDP(Net(), sync_module_states=True)  # device threads share one CPU generator: rank 0's values
    optimizer = torch.optim.SGD(model.parameters(), lr=flags.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=flags.num_epochs)
    accuracies = []
    for epoch in range(flags.num_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for x, y in pl.MpDeviceLoader(train_loader, device):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()  # not xm.optimizer_step: FSDP gradients are already reduced
            xm.mark_step()
        scheduler.step()
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in pl.MpDeviceLoader(test_loader, device):
                correct += model(x).argmax(1).eq(y).sum()
                total += y.shape[0]
        accuracy = 100.0 * correct.item() / total
        accuracies.append(xm.mesh_reduce("test_accuracy", accuracy, np.mean))
    xm.rendezvous("ckpt")
    ckpt = {"model": model.state_dict(), "shard_metadata": model.get_shard_metadata(),
            "optimizer": optimizer.state_dict()}
    path = os.path.join(flags.ckpt_dir, f"final_ckpt_rank-{rank:08d}-of-{world_size:08d}.pth")
    xm.save(ckpt, path, master_only=False)
    xm.rendezvous("saved")
    consolidated = None
    if rank == 0:
        state, _ = consolidate_sharded_model_checkpoints(os.path.join(flags.ckpt_dir, "final_ckpt"),
                                                         ckpt_suffix="_rank-*-of-*.pth", save_model=False)
        plain = Net()
        plain.load_state_dict(state)
        plain.eval()
        with torch.no_grad():
            consolidated = 100.0 * plain(test_x).argmax(1).eq(test_y).float().mean().item()
    xm.rendezvous("done")
    if rank == 0:
        print("RESULT " + json.dumps({"world_size": world_size, "accuracies": accuracies,
                                      "consolidated_accuracy": consolidated}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt_dir", required=True)
    parser.add_argument("--num_epochs", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=32, help="per device")
    parser.add_argument("--lr", type=float, default=0.05)
    # the one call xla_fsdp asks of a torch_xla.launch program on several XLA:CPU devices (none on TPU)
    xla_fsdp.enable_xla_cpu_devices()
    torch_xla.launch(_mp_fn, args=(parser.parse_args(),))
