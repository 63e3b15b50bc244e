"""Train a torchvision ResNet with xla_fsdp, auto-wrapping its blocks into FSDP units.

    python3 examples/train_resnet_fsdp_auto_wrap.py                 # no TPU: 2 XLA:CPU devices
    PJRT_DEVICE=TPU python3 examples/train_resnet_fsdp_auto_wrap.py  # TPU VM: TPU-sized defaults
    torchrun --nproc_per_node 2 examples/train_resnet_fsdp_auto_wrap.py --transport torch

Synthetic data (no download). Prints a summary line: steps/s, samples/s, per-rank bytes.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

ON_TPU = os.environ.get("PJRT_DEVICE", "").upper() == "TPU"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50" if ON_TPU else "resnet18")
    p.add_argument("--batch_size", type=int, default=128 if ON_TPU else 8, help="per rank")
    p.add_argument("--image_size", type=int, default=224 if ON_TPU else 32)
    p.add_argument("--num_classes", type=int, default=1000 if ON_TPU else 10)
    p.add_argument("--num_steps", type=int, default=300 if ON_TPU else 8)
    p.add_argument("--lr", type=float, default=0.1 if ON_TPU else 0.01)
    p.add_argument("--auto_wrap_policy", choices=["size_based", "type_based"], default="size_based")
    p.add_argument("--auto_wrap_min_num_params", type=int, default=int(1e6) if ON_TPU else int(1e5))
    p.add_argument("--compute_dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--use_gradient_checkpointing", action="store_true")
    p.add_argument("--transport", choices=["xla", "torch"], default="xla")
    p.add_argument("--num_devices", type=int, default=2, help="XLA:CPU devices when no TPU")
    return p.parse_args(argv)


def build(args):
    import torch
    import torch.nn as nn
    import torchvision
    from torchvision.models.resnet import BasicBlock, Bottleneck

    import xla_fsdp
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP, checkpoint_module
    from xla_fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)(num_classes=args.num_classes)
    if args.auto_wrap_policy == "size_based":
        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=args.auto_wrap_min_num_params)
    else:
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={BasicBlock, Bottleneck})
    wrapper = None
    if args.use_gradient_checkpointing:
        wrapper = lambda m, *a, **kw: FSDP(checkpoint_module(m), *a, **kw)
    dtype = getattr(torch, args.compute_dtype)
    return FSDP(model, auto_wrap_policy=policy, auto_wrapper_callable=wrapper, compute_dtype=dtype,
                transport=args.transport), xla_fsdp


def train(args, device, rank: int, world_size: int, sync) -> None:
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    model, _ = build(args)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g).to(device)
    y = torch.randint(0, args.num_classes, (args.batch_size,), generator=g).to(device)
    bar = tqdm(range(args.num_steps), disable=rank != 0, desc="train")
    start, warm = None, min(2, args.num_steps - 1)
    for step in bar:
        if step == warm:
            start = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        sync()
        bar.set_postfix(loss=f"{loss.item():.4f}")
    elapsed = time.perf_counter() - start
    steps = args.num_steps - warm
    state = sum(p.numel() * p.element_size() for p in model.parameters())
    state += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor))
    if rank == 0:
        print(f"SUMMARY model={args.model} world_size={world_size} steps/s={steps / elapsed:.3f} "
              f"samples/s={steps * args.batch_size * world_size / elapsed:.1f} "
              f"per-rank param+optimizer bytes={state} final_loss={loss.item():.4f}", flush=True)


def _xla_main(index, args):
    import torch_xla
    import torch_xla.runtime as xr

    import xla_fsdp
    train(args, torch_xla.device(), xr.global_ordinal(), xr.world_size(), xla_fsdp.sync)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.transport == "torch":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        import torch
        train(args, torch.device("cpu"), dist.get_rank(), dist.get_world_size(), lambda: None)
        dist.destroy_process_group()
        return 0
    if not ON_TPU:
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        os.environ.setdefault("CPU_NUM_DEVICES", str(args.num_devices))
    import xla_fsdp  # noqa: F401  (sets the XLA:CPU runtime defaults before launch)
    import torch_xla
    torch_xla.launch(_xla_main, args=(args,))
    return 0


if __name__ == "__main__":
    sys.exit(main())
