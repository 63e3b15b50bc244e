"""Mixed precision: low-precision compute for every layer type, fp32 master shards, fp32
reduce-scatter, buffer and output dtypes, and bf16 training tracking fp32 training."""
import functools


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import harness
from ranks import run_multiprocess, xla_cpu_devices
from training_program import BUILD_LOCK
from xla_fsdp import XlaFullyShardedDataParallel as FSDP
from xla_fsdp.unit import group_comms, runtime
from xla_fsdp.wrap import lambda_auto_wrap_policy


class Zoo(nn.Module):
    """One of every layer type users wrap: Embedding, Conv2d, BatchNorm2d, GroupNorm, Linear, LayerNorm."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.gn = nn.GroupNorm(2, 8)
        self.fc = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)
        self.seen = {}

    def forward(self, ids):
        x = self.emb(ids)                                   # (b, 4, 4, 8)
        x = x.permute(0, 3, 1, 2)
        x = F.relu(self.gn(self.bn(self.conv(x))))
        x = self.ln(self.fc(x.mean(dim=(2, 3))))
        self.seen = {"hidden": x.dtype, "conv_weight": self.conv.weight.dtype}
        return self.head(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_layer_type_computes_in_low_precision(gloo, dtype):
    torch.manual_seed(0)
    policy = functools.partial(lambda_auto_wrap_policy,
                               lambda_fn=lambda x: isinstance(x, (nn.Conv2d, nn.LayerNorm)))
    zoo = Zoo()
    # BatchNorm with fp32 statistics: its own fp32 unit handing low precision back (CPU kernels
    # take bf16 activations with fp32 parameters and statistics, not bf16 parameters).
    zoo.bn = FSDP(zoo.bn, compute_dtype=torch.float32, output_dtype=dtype)
    model = FSDP(zoo, compute_dtype=dtype, output_dtype=torch.float32, fp32_reduce_scatter=True,
                 auto_wrap_policy=policy)
    ids = torch.randint(0, 10, (2, 4, 4))
    out = model(ids)
    inner = model.module
    assert inner.seen == {"hidden": dtype, "conv_weight": dtype}
    assert out.dtype == torch.float32                       # output_dtype on the root only
    assert inner.bn.running_mean.dtype == torch.float32
    F.cross_entropy(out, torch.tensor([0, 1])).backward()
    for p in model.parameters():                            # fp32 master shards and gradients
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
        assert torch.isfinite(p.grad).all()


@pytest.mark.fast
def test_master_shards_keep_updates_below_low_precision_resolution(gloo):
    """An update of 1e-4 on weights of 1.0 vanishes in bf16 (spacing 2^-7); the fp32 shard keeps it."""
    lin = nn.Linear(4, 4, bias=False)
    nn.init.ones_(lin.weight)
    model = FSDP(lin, compute_dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    model(torch.ones(1, 4)).sum().backward()               # d(sum)/dW = 1 everywhere
    opt.step()
    shard = next(model.parameters())
    assert shard.dtype == torch.float32
    assert torch.allclose(shard, torch.full_like(shard, 1 - 1e-4), atol=1e-7)
    assert torch.equal(shard.detach().to(torch.bfloat16).float(), torch.ones_like(shard))


@pytest.mark.parametrize("fp32_reduce_scatter", [True, False])
def test_fp32_reduce_scatter_reduces_in_fp32(gloo, monkeypatch, fp32_reduce_scatter):
    """The gradient is reduced in fp32 or in the compute dtype as asked; what the reduction
    hands back (here at one rank, where the reduction is the identity) is in that dtype."""
    model = FSDP(nn.Linear(4, 4), compute_dtype=torch.bfloat16, fp32_reduce_scatter=fp32_reduce_scatter)
    seen = []
    original = group_comms.shard_grad_of
    for module in (group_comms, runtime):  # (the reduce-scatter's, and one rank's, where nothing is reduced)
        monkeypatch.setattr(module, "shard_grad_of",
                            lambda group, reduced, post: seen.append(reduced.dtype) or original(group, reduced, post))
    model(torch.ones(2, 4)).float().sum().backward()
    assert seen and set(seen) == {torch.float32 if fp32_reduce_scatter else torch.bfloat16}
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


STEPS = 50
CURVE_TOL = 0.01  # relative, per step: bf16 keeps ~3 significant digits (spacing 2^-8 = 0.4%)


@pytest.mark.parametrize("transport", ["torch", "xla"])
def test_bf16_training_tracks_fp32_loss_curve(transport):
    """The small transformer sharded at ws 2 in bf16 (fp32 master shards, fp32 reduce-scatter,
    fp32 logits) follows the unsharded fp32 run's loss within 1% at every one of 50 AdamW steps.
    Measured: 2.9e-4 (gloo) and 4.3e-4 (XLA:CPU) largest relative deviation."""
    name = "mp_bf16_lm_adamw"
    run = harness.run_gloo if transport == "torch" else harness.run_xla
    ranks = run([name], 2, steps=STEPS)[name]
    ref = harness.train_reference(name, 2, steps=STEPS)["losses"]
    bf16 = [sum(r["losses"][s] for r in ranks) / 2 for s in range(STEPS)]
    rel = [abs(a - b) / b for a, b in zip(bf16, ref)]
    assert max(rel) <= CURVE_TOL, max(rel)
    assert max(rel) > 0  # really computed in bf16: an fp32 run would match to ~1e-7
    assert ref[-1] < ref[0] - 0.05 and bf16[-1] < bf16[0] - 0.05  # the curve goes somewhere




def _autocast_programs():
    """torch.autocast("xla", bf16) over fp32 parameters, as the HF Trainer's bf16=True runs it: the
    same model unwrapped, wrapped, and through fully_shard; every rank the same batches."""
    import torch_xla

    import xla_fsdp
    device = torch_xla.device()

    def build():
        with BUILD_LOCK:  # XLA:CPU device threads share the CPU generator
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16), nn.GELU()),
                                 nn.Linear(16, 4)).to(device)

    def train(model):
        batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(step)) for step in range(3)]
        return harness.xla_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches,
                                 lambda: torch.autocast("xla", dtype=torch.bfloat16))

    results = {"unwrapped": train(build())}
    results["wrapper"] = train(FSDP(build()))
    model = build()
    xla_fsdp.fully_shard(model[2])
    xla_fsdp.fully_shard(model)
    results["fully_shard"] = train(model)
    return results


@pytest.mark.xla
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_torch_autocast_on_xla_trains_as_unwrapped(world_size):
    """Before: the weight-saving nn.Linear forward xla_fsdp puts on XLA got fp32
    weights and a bf16 gradient under autocast: XLA's HLO verifier rejected the step at 2 devices
    ("Seen floating point types of different precisions"), and at 1 device the second loss differed
    (0.056638 vs 0.056705). Under autocast the layer runs F.linear as plain torch_xla does."""
    with xla_cpu_devices(world_size):
        by_rank = run_multiprocess(_autocast_programs)
    for rank, results in by_rank.items():
        for name in ("wrapper", "fully_shard"):
            worst = max(abs(a - b) for a, b in zip(results[name], results["unwrapped"]))
            assert worst <= 1e-6, (rank, name, results)
