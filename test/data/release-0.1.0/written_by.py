"""How the rank files beside this were written, by xla_fsdp 0.1.0 (commit 266aadb, torch 2.9.0): 2 gloo
ranks, one AdamW step, saved in torch.save's archive form. Run as
``torchrun --standalone --nproc_per_node 2 written_by.py PREFIX``; test_checkpoints checks that today's
code loads, consolidates and resizes them."""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import xla_fsdp
from xla_fsdp import XlaFullyShardedDataParallel as FSDP


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def batch() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(4, 4)  # rank r trains on rows 2r, 2r + 1


if __name__ == "__main__":
    dist.init_process_group("gloo")
    model = FSDP(make())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = batch()
    r = dist.get_rank()
    model(x[2 * r:2 * r + 2]).square().mean().backward()
    opt.step()
    xla_fsdp.save_sharded_checkpoint(model, opt, sys.argv[1], extra={"step": 1, "rng": torch.arange(3)})
    dist.destroy_process_group()
