"""Helper for test_checkpoints: a one-rank gloo job that saves sharded checkpoints in a loop,
printing 'saved N' after each, until it is killed. With ``--async`` each save runs in the
background while the parameters are overwritten with the next values (the file must hold the
values at the save)."""
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import xla_fsdp  # noqa: E402

prefix = sys.argv[1]
background = "--async" in sys.argv[2:]
dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
torch.manual_seed(0)
model = xla_fsdp.XlaFullyShardedDataParallel(nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]))
opt = torch.optim.Adam(model.parameters())
model(torch.randn(2, 512)).sum().backward()
opt.step()
n = 0
while True:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(n))  # every save holds different bytes
    if background:
        pending = xla_fsdp.save_sharded_checkpoint(model, opt, prefix, extra={"n": n}, blocking=False)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(n + 1))  # training goes on while the save writes
        pending.wait()
    else:
        xla_fsdp.save_sharded_checkpoint(model, opt, prefix, extra={"n": n})
    print(f"saved {n}", flush=True)
    n += 1
