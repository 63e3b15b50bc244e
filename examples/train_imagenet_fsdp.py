"""ImageNet-style training with xla_fsdp: ImageFolder or fake data, warmup + step-decay schedule, eval.

    python3 examples/train_imagenet_fsdp.py                          # no TPU: small fake data, 2 XLA:CPU devices
    PJRT_DEVICE=TPU python3 examples/train_imagenet_fsdp.py --datadir /data/imagenet --use_nested_fsdp \\
        --lr 0.4 --batch_size 128 --num_warmup_epochs 5 --lr_scheduler_divide_every_n_epochs 30 \\
        --lr_scheduler_divisor 10 --num_epochs 100 --test_set_batch_size 64 --eval_interval 10 --drop_last

Flags follow torch_xla's test_train_mp_imagenet_fsdp.py. Every rank evaluates the whole test set.
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
    p.add_argument("--datadir", default="/tmp/imagenet")
    p.add_argument("--fake_data", action="store_true", help="(the default when --datadir does not exist)")
    p.add_argument("--use_small_fake_sample", action="store_true")
    p.add_argument("--image_size", type=at_least(1), default=224 if ON_TPU else 32)
    p.add_argument("--num_classes", type=at_least(2), default=1000 if ON_TPU else 10)
    p.add_argument("--batch_size", type=at_least(1), default=64 if ON_TPU else 8, help="per rank")
    p.add_argument("--test_set_batch_size", type=at_least(1), default=64 if ON_TPU else 16)
    p.add_argument("--num_epochs", type=at_least(1), default=18 if ON_TPU else 2)
    p.add_argument("--lr", type=positive_float, default=0.1 if ON_TPU else 0.05)
    p.add_argument("--momentum", type=at_least(0.0, float), default=0.9)
    p.add_argument("--num_warmup_epochs", type=at_least(0.0, float), default=0.9 if ON_TPU else 0.5)
    p.add_argument("--lr_scheduler_divide_every_n_epochs", type=at_least(1), default=20 if ON_TPU else 1)
    p.add_argument("--lr_scheduler_divisor", type=positive_float, default=5)
    p.add_argument("--eval_interval", type=at_least(1), default=1)
    p.add_argument("--test_only_at_end", action="store_true")
    p.add_argument("--drop_last", action="store_true")
    p.add_argument("--log_steps", type=at_least(1), default=20)
    p.add_argument("--flatten_parameters", action="store_true")
    p.add_argument("--auto_wrap_policy", choices=["none", "size_based", "type_based"], default="none")
    p.add_argument("--auto_wrap_min_num_params", type=at_least(0), default=int(1e6))
    p.add_argument("--use_nested_fsdp", action="store_true", help="each child module with parameters is a unit")
    p.add_argument("--use_gradient_checkpointing", action="store_true")
    p.add_argument("--compute_dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    p.add_argument("--fp32_reduce_scatter", action="store_true")
    p.add_argument("--shard_param_on_dim_0", action="store_true")
    p.add_argument("--ckpt_prefix", default=None)
    add_launch_flags(p)
    return p.parse_args(argv)


def datasets(args):
    """(train, test) datasets; fake ones are small tensors kept on the host."""
    if not args.fake_data and os.path.isdir(os.path.join(args.datadir, "train")):
        import torchvision
        import torchvision.transforms as T
        norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        train = torchvision.datasets.ImageFolder(os.path.join(args.datadir, "train"), T.Compose(
            [T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
        test = torchvision.datasets.ImageFolder(os.path.join(args.datadir, "val"), T.Compose(
            [T.Resize(int(args.image_size * 1.14)), T.CenterCrop(args.image_size), T.ToTensor(), norm]))
        return train, test
    n = (50_000 if ON_TPU and not args.use_small_fake_sample else 64 * (args.num_devices or 2))
    g = torch.Generator().manual_seed(0)
    make = lambda k: torch.utils.data.TensorDataset(torch.randn(k, 3, args.image_size, args.image_size, generator=g),
                                                    torch.randint(0, args.num_classes, (k,), generator=g))
    return make(n), make(max(n // 4, args.test_set_batch_size))


def build_model(args):
    import torchvision
    from torchvision.models.resnet import BasicBlock, Bottleneck

    from xla_fsdp import XlaFullyShardedDataParallel as FSDP, checkpoint_module
    from xla_fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    with seeded(0):
        model = getattr(torchvision.models, args.model)(num_classes=args.num_classes)
    kwargs = dict(flatten_parameters=args.flatten_parameters, compute_dtype=getattr(torch, args.compute_dtype),
                  fp32_reduce_scatter=args.fp32_reduce_scatter, shard_param_on_dim_0=args.shard_param_on_dim_0,
                  transport=args.transport)
    maybe_ckpt = checkpoint_module if args.use_gradient_checkpointing else (lambda m: m)
    if args.use_nested_fsdp:
        for name, child in model.named_children():
            if any(True for _ in child.parameters()):
                setattr(model, name, FSDP(maybe_ckpt(child), **kwargs))
    elif args.auto_wrap_policy != "none":
        kwargs["auto_wrap_policy"] = (
            functools.partial(size_based_auto_wrap_policy, min_num_params=args.auto_wrap_min_num_params)
            if args.auto_wrap_policy == "size_based"
            else functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={BasicBlock, Bottleneck}))
        if args.use_gradient_checkpointing:
            kwargs["auto_wrapper_callable"] = lambda m, *a, **kw: FSDP(checkpoint_module(m), *a, **kw)
    return FSDP(model, **kwargs)


def lr_factor(args, steps_per_epoch: int):
    """Linear warmup for num_warmup_epochs, then divide by the divisor every n epochs."""
    warmup = max(1, int(args.num_warmup_epochs * steps_per_epoch))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return args.lr_scheduler_divisor ** -(step // (args.lr_scheduler_divide_every_n_epochs * steps_per_epoch))
    return factor


@torch.no_grad()
def evaluate(model, test, args, ctx) -> float:
    model.eval()
    correct = total = 0
    # its own generator: an iterator otherwise draws its seed from torch's CPU generator, which XLA:CPU
    # rank threads share, and a rank still building its model under the seeded lock got other weights
    for x, y in torch.utils.data.DataLoader(test, args.test_set_batch_size, generator=torch.Generator()):
        pred = model(x.to(ctx.device)).argmax(1)
        ctx.sync()
        correct += int((pred.cpu() == y).sum())
        total += len(y)
    model.train()
    return 100.0 * correct / total


def train(ctx, args):
    from tqdm import tqdm

    import xla_fsdp

    train_set, test_set = datasets(args)
    sampler = torch.utils.data.distributed.DistributedSampler(train_set, ctx.world_size, ctx.rank, shuffle=True,
                                                              drop_last=True)
    loader = torch.utils.data.DataLoader(train_set, args.batch_size, sampler=sampler, drop_last=True,
                                         generator=torch.Generator())  # not the shared CPU generator (above)
    model = build_model(args)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=1e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(args, len(loader)))
    acc, best, start, seen = 0.0, 0.0, time.perf_counter(), 0
    for epoch in range(1, args.num_epochs + 1):
        sampler.set_epoch(epoch)
        bar = tqdm(loader, disable=not ctx.is_master, desc=f"epoch {epoch}", leave=False)
        for step, (x, y) in enumerate(bar):
            opt.zero_grad()
            loss = F.cross_entropy(model(x.to(ctx.device)).float(), y.to(ctx.device))
            loss.backward()
            opt.step()
            sched.step()
            ctx.sync()
            seen += len(y) * ctx.world_size
            if step % args.log_steps == 0:
                bar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{sched.get_last_lr()[0]:.4f}")
        if (not args.test_only_at_end and epoch % args.eval_interval == 0) or epoch == args.num_epochs:
            acc = evaluate(model, test_set, args, ctx)
            best = max(best, acc)
            ctx.log(f"epoch {epoch}: top-1 {acc:.2f}% (best {best:.2f}%)")
    elapsed = time.perf_counter() - start
    b = state_bytes(model, opt)
    if args.ckpt_prefix:
        os.makedirs(os.path.dirname(os.path.abspath(args.ckpt_prefix)), exist_ok=True)
        xla_fsdp.save_sharded_checkpoint(model, opt, args.ckpt_prefix)
    ctx.log(f"SUMMARY example=imagenet model={args.model} world_size={ctx.world_size} epochs={args.num_epochs} "
            f"samples/s={seen / elapsed:.1f} top1={acc:.2f} best_top1={best:.2f} param_bytes={b['param_bytes']} "
            f"grad_bytes={b['grad_bytes']} optimizer_bytes={b['optimizer_bytes']} peak_rss_mib={peak_rss_mib():.0f} "
            f"compilations={compilations(ctx)}")


if __name__ == "__main__":
    launch(train, parse_args())
