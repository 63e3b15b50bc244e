"""MNIST-style digit classification with xla_fsdp, a sharded checkpoint and its consolidation.

    python3 examples/train_mnist_fsdp_with_ckpt.py                    # 2 XLA:CPU devices, real digits
    python3 examples/train_mnist_fsdp_with_ckpt.py --use_nested_fsdp --use_gradient_checkpointing
    PJRT_DEVICE=TPU python3 examples/train_mnist_fsdp_with_ckpt.py --datadir /tmp/mnist-data

Data: torchvision MNIST from --datadir when it is there; otherwise the handwritten digits that ship
with scikit-learn (1,797 images, 8x8, resized to 28x28), so no download is ever needed. Flags follow
torch_xla's test_train_mp_mnist_fsdp_with_ckpt.py. After training it saves a sharded checkpoint,
consolidates it, loads it into the plain (unwrapped) model and checks the accuracy is the same.
Exit code 21 if the best accuracy is below --target_accuracy.
"""
from __future__ import annotations

import functools
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from example_utils import (ExampleParser, ON_TPU, add_launch_flags, at_least, compilations, launch, peak_rss_mib,
                           positive_float, seeded, state_bytes)


class MNIST(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.bn1 = nn.BatchNorm2d(10)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.bn2 = nn.BatchNorm2d(20)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = self.bn1(x)
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = self.bn2(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def parse_args(argv=None):
    p = ExampleParser(__doc__)
    p.add_argument("--datadir", default="/tmp/mnist-data")
    p.add_argument("--fake_data", action="store_true")
    p.add_argument("--batch_size", type=at_least(1), default=128 if ON_TPU else 32, help="per rank")
    p.add_argument("--num_epochs", type=at_least(1), default=18 if ON_TPU else 15)
    p.add_argument("--lr", type=positive_float, default=0.01 if ON_TPU else 0.05, help="scaled by the world size")
    p.add_argument("--momentum", type=at_least(0.0, float), default=0.5)
    p.add_argument("--target_accuracy", type=at_least(0.0, float), default=98.0 if ON_TPU else 95.0)
    p.add_argument("--drop_last", action="store_true")
    p.add_argument("--log_steps", type=at_least(1), default=20)
    p.add_argument("--flatten_parameters", action="store_true")
    p.add_argument("--auto_wrap_policy", choices=["none", "size_based", "type_based"], default="none")
    p.add_argument("--auto_wrap_min_num_params", type=at_least(0), default=1000)
    p.add_argument("--use_nested_fsdp", action="store_true")
    p.add_argument("--use_gradient_checkpointing", action="store_true")
    p.add_argument("--ckpt_prefix", default="/tmp/mnist-fsdp/final_ckpt")
    p.add_argument("--no_ckpt_consolidation", dest="ckpt_consolidation", action="store_false")
    p.add_argument("--compute_dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    p.add_argument("--fp32_reduce_scatter", action="store_true")
    p.add_argument("--shard_param_on_dim_0", action="store_true")
    p.add_argument("--no_pin_layout_in_collective_ops", dest="pin_layout_in_collective_ops", action="store_false")
    add_launch_flags(p)
    return p.parse_args(argv)


def load_data(args):
    """(train_x, train_y, test_x, test_y) on the host, images 1x28x28 normalized."""
    if args.fake_data:
        g = torch.Generator().manual_seed(0)
        return (torch.randn(512, 1, 28, 28, generator=g), torch.randint(0, 10, (512,), generator=g),
                torch.randn(128, 1, 28, 28, generator=g), torch.randint(0, 10, (128,), generator=g))
    if os.path.isdir(os.path.join(args.datadir, "MNIST")):
        import torchvision
        def tensors(train):
            ds = torchvision.datasets.MNIST(args.datadir, train=train, download=False)
            x = ds.data.float().div(255).unsqueeze(1)
            return (x - 0.1307) / 0.3081, ds.targets
        return (*tensors(True), *tensors(False))
    from sklearn.datasets import load_digits
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    split = int(0.8 * len(y))
    return x[order[:split]], y[order[:split]], x[order[split:]], y[order[split:]]


def wrap(args, model):
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP, checkpoint_module
    from xla_fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    kwargs = dict(flatten_parameters=args.flatten_parameters, compute_dtype=getattr(torch, args.compute_dtype),
                  fp32_reduce_scatter=args.fp32_reduce_scatter, shard_param_on_dim_0=args.shard_param_on_dim_0,
                  pin_layout_in_collective_ops=args.pin_layout_in_collective_ops, transport=args.transport)
    if args.use_nested_fsdp:
        for name in ("conv1", "conv2", "fc1", "fc2"):
            child = getattr(model, name)
            if args.use_gradient_checkpointing:
                child = checkpoint_module(child)
            setattr(model, name, FSDP(child, **kwargs))
    elif args.auto_wrap_policy != "none":
        policy = (functools.partial(size_based_auto_wrap_policy, min_num_params=args.auto_wrap_min_num_params)
                  if args.auto_wrap_policy == "size_based"
                  else functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Conv2d, nn.Linear}))
        kwargs["auto_wrap_policy"] = policy
        if args.use_gradient_checkpointing:
            kwargs["auto_wrapper_callable"] = lambda m, *a, **kw: FSDP(checkpoint_module(m), *a, **kw)
    return FSDP(model, **kwargs)


@torch.no_grad()
def accuracy(model, x, y, device, batch=256) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(y), batch):
        out = model(x[i:i + batch].to(device))
        correct += int((out.argmax(1).cpu() == y[i:i + batch]).sum())
    model.train()
    return 100.0 * correct / len(y)


def train(ctx, args):
    from tqdm import tqdm

    import xla_fsdp

    train_x, train_y, test_x, test_y = load_data(args)
    with seeded(0):
        net = MNIST()
    model = wrap(args, net)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * ctx.world_size, momentum=args.momentum)
    per_step = args.batch_size * ctx.world_size
    steps = len(train_y) // per_step  # the last partial global batch is dropped (ranks stay in step)
    best, start = 0.0, time.perf_counter()
    for epoch in range(1, args.num_epochs + 1):
        order = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(epoch))
        bar = tqdm(range(steps), disable=not ctx.is_master, desc=f"epoch {epoch}", leave=False)
        for step in bar:
            idx = order[step * per_step:(step + 1) * per_step][ctx.rank::ctx.world_size]
            x, y = train_x[idx].to(ctx.device), train_y[idx].to(ctx.device)
            opt.zero_grad()
            loss = F.nll_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            ctx.sync()
            if step % args.log_steps == 0:
                bar.set_postfix(loss=f"{loss.item():.4f}")
        acc = accuracy(model, test_x, test_y, ctx.device)
        ctx.sync()
        best = max(best, acc)
        ctx.log(f"epoch {epoch}: test accuracy {acc:.2f}%")
    elapsed = time.perf_counter() - start
    final_acc = acc
    bytes_ = state_bytes(model, opt)
    os.makedirs(os.path.dirname(os.path.abspath(args.ckpt_prefix)), exist_ok=True)
    xla_fsdp.save_sharded_checkpoint(model, opt, args.ckpt_prefix)
    reloaded = None
    if args.ckpt_consolidation and ctx.is_master:
        full, path = xla_fsdp.consolidate_sharded_model_checkpoints(args.ckpt_prefix, "_rank-*-of-*.pth")
        plain = MNIST()
        plain.load_state_dict(full)
        reloaded = accuracy(plain, test_x, test_y, torch.device("cpu"))
        ctx.log(f"consolidated checkpoint {path}: plain model test accuracy {reloaded:.2f}%")
    ctx.log(f"SUMMARY example=mnist world_size={ctx.world_size} epochs={args.num_epochs} seconds={elapsed:.1f} "
            f"best_accuracy={best:.2f} final_accuracy={final_acc:.2f} "
            f"reloaded_accuracy={'n/a' if reloaded is None else f'{reloaded:.2f}'} "
            f"param_bytes={bytes_['param_bytes']} grad_bytes={bytes_['grad_bytes']} "
            f"optimizer_bytes={bytes_['optimizer_bytes']} peak_rss_mib={peak_rss_mib():.0f} "
            f"compilations={compilations(ctx)}")
    if ctx.is_master and reloaded is not None and abs(reloaded - final_acc) > 1e-6:
        raise SystemExit(f"consolidated model accuracy {reloaded:.2f} differs from the sharded model's {final_acc:.2f}")
    if ctx.is_master and best < args.target_accuracy:
        print(f"accuracy {best:.2f}% is below the target {args.target_accuracy}%", file=sys.stderr)
        os._exit(21)


if __name__ == "__main__":
    launch(train, parse_args())
