"""A training program for test_install: run under torchrun (gloo) in a venv that has only what the
README's CPU install lines bring. Trains a small model, saves training checkpoints, resumes from the
newest one in ``--ckpt_dir`` with ``--resume``; prints its per-step losses as one JSON line."""
import argparse
import gc
import json

import torch
import torch.distributed as dist
import torch.nn as nn

from xla_fsdp import XlaFullyShardedDataParallel as FSDP
from xla_fsdp.checkpoints import resume_training, save_training_checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt_dir", required=True)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--save_every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()

dist.init_process_group("gloo")
torch.manual_seed(0)
model = FSDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
start = 0
if args.resume:
    resumed = resume_training(model, optimizer, args.ckpt_dir)
    start = resumed.step
losses = {}
for step in range(start, args.steps):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses[step] = loss.item()
    if (step + 1) % args.save_every == 0:
        save_training_checkpoint(model, optimizer, args.ckpt_dir, step + 1, keep=0)
if dist.get_rank() == 0:
    print(json.dumps({"losses": losses}))
del model, optimizer
dist.destroy_process_group()
gc.collect()
