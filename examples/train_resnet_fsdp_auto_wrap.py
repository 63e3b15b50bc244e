"""Train a torchvision ResNet with xla_fsdp, auto-wrapping it into FSDP units.

    python3 examples/train_resnet_fsdp_auto_wrap.py                  # no TPU: 2 XLA:CPU devices, small defaults
    PJRT_DEVICE=TPU python3 examples/train_resnet_fsdp_auto_wrap.py   # TPU VM: ResNet-50, 224x224, batch 128
    torchrun --nproc_per_node 2 examples/train_resnet_fsdp_auto_wrap.py   # gloo ranks (transport torch)

Synthetic data unless --datadir points at an ImageFolder tree (train/ inside it, or the folder itself).
Ends with a SUMMARY line (steps/s, samples/s, per-rank bytes, peak memory, XLA compilations) and a
sharded checkpoint (--ckpt_prefix, default /tmp/resnet-fsdp/final_ckpt) that rank 0 consolidates.
"""
from __future__ import annotations

import functools
import os
import time

import torch
import torch.nn.functional as F

from example_utils import (ExampleParser, ON_TPU, add_launch_flags, at_least, compilations, launch, peak_rss_mib,
                           positive_float, seeded, state_bytes)


def parse_args(argv=None):
    p = ExampleParser(__doc__)
    p.add_argument("--model", default="resnet50" if ON_TPU else "resnet18")
    p.add_argument("--batch_size", type=at_least(1), default=128 if ON_TPU else 8, help="per rank")
    p.add_argument("--image_size", type=at_least(1), default=224 if ON_TPU else 32)
    p.add_argument("--num_classes", type=at_least(2), default=1000 if ON_TPU else 10)
    p.add_argument("--num_steps", type=at_least(1), default=300 if ON_TPU else 8, help="steps per epoch")
    p.add_argument("--num_epochs", type=at_least(1), default=1)
    p.add_argument("--lr", type=positive_float, default=0.1 if ON_TPU else 0.01)
    p.add_argument("--fake_data", action="store_true", help="synthetic images (the default without --datadir)")
    p.add_argument("--datadir", default=None, help="ImageFolder root")
    p.add_argument("--auto_wrap_policy", choices=["size_based", "type_based"], default="size_based")
    p.add_argument("--auto_wrap_min_num_params", type=at_least(0), default=int(1e6) if ON_TPU else int(1e5))
    p.add_argument("--compute_dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--use_gradient_checkpointing", action="store_true")
    p.add_argument("--ckpt_prefix", default="/tmp/resnet-fsdp/final_ckpt",
                   help="write a sharded checkpoint here, then consolidate it ('' to skip)")
    add_launch_flags(p)
    return p.parse_args(argv)


def build_model(args):
    import torchvision
    from torchvision.models.resnet import BasicBlock, Bottleneck

    from xla_fsdp import XlaFullyShardedDataParallel as FSDP, checkpoint_module
    from xla_fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    with seeded(0):
        model = getattr(torchvision.models, args.model)(num_classes=args.num_classes)
    if args.auto_wrap_policy == "size_based":
        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=args.auto_wrap_min_num_params)
    else:
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={BasicBlock, Bottleneck})
    wrapper = (lambda m, *a, **kw: FSDP(checkpoint_module(m), *a, **kw)) if args.use_gradient_checkpointing else None
    return FSDP(model, auto_wrap_policy=policy, auto_wrapper_callable=wrapper,
                compute_dtype=getattr(torch, args.compute_dtype), transport=args.transport)


def batches(args, rank: int, world_size: int):
    """Yields (images, labels) for this rank, forever: an ImageFolder, or one fixed synthetic batch."""
    if args.datadir and not args.fake_data:
        import torchvision
        import torchvision.transforms as T

        root = (
            os.path.join(args.datadir, "train") if os.path.isdir(os.path.join(args.datadir, "train")) else args.datadir
        )
        ds = torchvision.datasets.ImageFolder(root, T.Compose([
            T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip(), T.ToTensor(),
            T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]))
        sampler = torch.utils.data.distributed.DistributedSampler(ds, world_size, rank, shuffle=True, drop_last=True)
        # its own generator: an iterator otherwise draws its seed from torch's CPU generator, which XLA:CPU
        # rank threads share with a rank still building its model under the seeded lock
        loader = torch.utils.data.DataLoader(ds, args.batch_size, sampler=sampler, drop_last=True,
                                             generator=torch.Generator())
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g)
    y = torch.randint(0, args.num_classes, (args.batch_size,), generator=g)
    while True:
        yield x, y


def train(ctx, args):
    from tqdm import tqdm

    import xla_fsdp

    model = build_model(args)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    data = batches(args, ctx.rank, ctx.world_size)
    total = args.num_steps * args.num_epochs
    warm = min(2, total - 1)
    bar = tqdm(range(total), disable=not ctx.is_master, desc="train")
    start = time.perf_counter()
    for step in bar:
        if step == warm:
            ctx.sync()
            start, compiles_after_warmup = time.perf_counter(), compilations(ctx)
        x, y = next(data)
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(ctx.device)).float(), y.to(ctx.device))
        loss.backward()
        opt.step()
        ctx.sync()
        bar.set_postfix(
            loss=f"{loss.item():.4f}",
            samples_s=f"{(step + 1) * args.batch_size * ctx.world_size / max(time.perf_counter() - start, 1e-9):.1f}",
        )
    elapsed = time.perf_counter() - start
    # XLA:CPU devices are threads of one process sharing the compile counter: each rank reads it before
    # any rank starts the checkpoint's graphs (a rank ahead of the others would otherwise be counted)
    compiled = compilations(ctx)
    ctx.mean(0.0)
    steps = total - warm
    b = state_bytes(model, opt)
    ctx.log(f"SUMMARY example=resnet model={args.model} transport={ctx.transport} world_size={ctx.world_size} "
            f"steps/s={steps / elapsed:.3f} samples/s={steps * args.batch_size * ctx.world_size / elapsed:.1f} "
            f"param_bytes={b['param_bytes']} grad_bytes={b['grad_bytes']} optimizer_bytes={b['optimizer_bytes']} "
            f"peak_rss_mib={peak_rss_mib():.0f} compilations={compiled} "
            f"new_compilations_after_warmup={compiled - compiles_after_warmup} final_loss={loss.item():.4f}")
    if args.ckpt_prefix:
        os.makedirs(os.path.dirname(os.path.abspath(args.ckpt_prefix)), exist_ok=True)
        xla_fsdp.save_sharded_checkpoint(model, opt, args.ckpt_prefix)
        if ctx.is_master:
            _, path = xla_fsdp.consolidate_sharded_model_checkpoints(args.ckpt_prefix, "_rank-*-of-*.pth")
            ctx.log(f"checkpoint: {args.ckpt_prefix}_rank-*-of-{ctx.world_size:08d}.pth consolidated into {path}")


if __name__ == "__main__":
    launch(train, parse_args())
