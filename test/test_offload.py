"""Host offload (``cpu_offload=True``): master shards, gradients and optimizer state in host memory.

Sharded training with offload equals the same model trained unsharded in one process (fp32, 5 steps,
SGD and AdamW, within 1e-5 on losses, gradients, parameters and clip norms) at world sizes 1, 2 and
4, on gloo processes and on XLA:CPU device threads; after every step the parameters, their
gradients and the optimizer state are host tensors, no unit holds gathered parameters or device
copies of shards, and (XLA) no step after the first compiles a graph. Checkpoints move between
offloading and device-resident models, at the same and at another world size. Every offload
configuration of a (transport, world size) trains in one launch (harness.OFFLOAD).
"""
import copy
import pytest
import torch
import torch.nn as nn

import harness
import models
from xla_fsdp import XlaFullyShardedDataParallel as FSDP
from xla_fsdp.checkpoints.shard_merge import consolidate_sharded_state_dicts
from xla_fsdp.resize import main as resize_cli

TOL = 1e-5
FP32 = [n for n in harness.OFFLOAD if "bf16" not in n]
_RUNS, _REFS = {}, {}
WORST = {}  # (transport, kind) -> largest deviation seen (printed at the end of the module)


@pytest.fixture(scope="module", autouse=True)
def _print_figures():
    yield
    if WORST:
        print("\nlargest deviation from unsharded training with cpu_offload: " + ", ".join(
            f"{t} {k} {v:.1e}" for (t, k), v in sorted(WORST.items())))


def runs(transport, world_size):
    key = (transport, world_size)
    if key not in _RUNS:
        run = harness.run_gloo if transport == "torch" else harness.run_xla
        _RUNS[key] = run(harness.OFFLOAD, world_size)
    return _RUNS[key]


def reference(name, world_size, **kwargs):
    key = (name, world_size, tuple(sorted(kwargs.items())))
    if key not in _REFS:
        _REFS[key] = harness.train_reference(name, world_size, **kwargs)
    return _REFS[key]


def _deviation(transport, kind, value):
    WORST[(transport, kind)] = max(WORST.get((transport, kind), 0.0), value)
    return value


def _assert_on_host(ranks, dtype="torch.float32"):
    """Between steps: shards, gradients and optimizer state on the host, nothing left on the device."""
    for r in ranks:
        assert len(r["residency"]) == harness.STEPS
        for step in r["residency"]:
            assert step["offloading_units"] == step["units"] > 0
            assert step["params"] == step["grads"] == step["optimizer"] == ["cpu"], step
            assert step["dtypes"] == step["grad_dtypes"] == [dtype], step
            assert step["with_grad"] == step["trainable"] > 0 and step["optimizer_tensors"] > 0
            assert step["gathered"] == 0 and step["device_copies"] == 0, step
        compiles = [step["compiles"] for step in r["residency"]]
        if compiles[0] is not None:  # XLA: every graph compiled in the first step, none after
            assert compiles[0] > 0 and len(set(compiles)) == 1, compiles


@pytest.mark.parametrize("name", FP32)
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("transport", ["torch", "xla"])
def test_offload_matches_unsharded(transport, world_size, name):
    ranks = runs(transport, world_size)[name]
    ref = reference(name, world_size)
    losses = [sum(r["losses"][s] for r in ranks) / world_size for s in range(harness.STEPS)]
    assert _deviation(transport, "loss", max(abs(a - b) for a, b in zip(losses, ref["losses"]))) <= TOL
    full = harness.consolidate(ranks)
    assert set(full) == set(ref["state_dict"])
    for key, want in ref["state_dict"].items():
        assert full[key].dtype == want.dtype == torch.float32
        assert _deviation(transport, "param", (full[key] - want).abs().max().item()) <= TOL, key
    # the last step's gradients (after clipping where the config clips), consolidated from the host shards' .grad
    grads = consolidate_sharded_state_dicts([r["grad_state_dict"] for r in harness.first_replica(ranks)],
                                           ranks[0]["metadata"])
    assert ref["grads"] and set(ref["grads"]) <= set(grads)
    for key, want in ref["grads"].items():
        assert _deviation(transport, "grad", (grads[key] - want).abs().max().item()) <= TOL, key
    cfg = harness.CONFIGS[name]
    if cfg.get("clip"):
        for r in ranks:
            assert len(r["norms"]) == harness.STEPS
            assert _deviation(transport, "norm", max(abs(a - b) for a, b in zip(r["norms"], ref["norms"]))) <= TOL
    if cfg.get("check_freed") or cfg.get("check_kept"):  # ZeRO-3 frees after forward, ZeRO-2 keeps
        assert all(all(r["freed_after_forward"]) and len(r["freed_after_forward"]) == harness.STEPS for r in ranks)
    _assert_on_host(ranks)


@pytest.mark.parametrize("transport", ["torch", "xla"])
def test_bf16_storage_offload_tracks_fp32(transport):
    """``param_storage_dtype=torch.bfloat16``: bf16 master shards, gradients and AdamW state on the
    host; the run follows fp32 training as bf16 weights can (measured at ws 1-4: losses 2.6e-4 to
    9e-4, parameters <= 4.2e-3, the spacing of bf16 in [0.5, 1) being 3.9e-3). Over all parameters
    the distance to the fp32 run (L2, 0.017 at gloo ws 2) is a tenth of how far training moved them."""
    name = "offload_bf16_storage_adamw"
    ranks = runs(transport, 2)[name]
    ref = reference(name, 2)
    losses = [sum(r["losses"][s] for r in ranks) / 2 for s in range(harness.STEPS)]
    assert 0 < max(abs(a - b) for a, b in zip(losses, ref["losses"])) <= 5e-3
    full = harness.consolidate(ranks)
    initial = models.make_model("mlp").state_dict()
    for key, want in ref["state_dict"].items():
        assert full[key].dtype == torch.bfloat16
        assert (full[key].float() - want).abs().max().item() <= 1e-2, key
    distance = sum(((full[k].float() - v) ** 2).sum() for k, v in ref["state_dict"].items()) ** 0.5
    moved = sum(((v - initial[k]) ** 2).sum() for k, v in ref["state_dict"].items()) ** 0.5
    assert distance < moved / 5, (distance, moved)
    _assert_on_host(ranks, dtype="torch.bfloat16")


@pytest.mark.xla
def test_checkpoints_move_between_offload_and_device(tmp_path):
    """A sharded checkpoint saved by an offloading model (host shards, gloo) loads into a device-resident
    one (XLA:CPU, device shards) and the reverse, and training continues as the uninterrupted unsharded
    run (1e-5): file for file at the same world size, and resized while loading from a copy at
    another world size (into the host shards in place). The full state dicts (model and optimizer)
    of the offloading run equal the device-resident run's."""
    offload, plain = "offload_zero3_adamw", "zero3_nested_adamw"
    prefix = str(tmp_path / "{name}")
    saved = harness.run_gloo([offload, plain], 2, steps=3, save_prefix=prefix, full_state=True)
    for key, value in saved[plain][0]["full"].items():
        assert (saved[offload][0]["full"][key] - value).abs().max().item() <= TOL, key
    for name, values in saved[plain][0]["full_optim"]["state"].items():
        for field, v in values.items():
            assert (saved[offload][0]["full_optim"]["state"][name][field] - v).abs().max().item() <= TOL
    at_four = str(tmp_path / "offload_ws4")
    assert resize_cli(["--ckpt_prefix", prefix.format(name=offload), "--world_size", "4",
                        "--out_prefix", at_four]) == 0
    sources = {"from_offload": prefix.format(name=offload), "from_plain": prefix.format(name=plain),
               "from_offload_ws4": at_four}
    names = [f"{plain}@from_offload", f"{offload}@from_plain", f"{offload}@from_offload_ws4",
             f"{plain}@from_offload_ws4"]
    resumed = harness.run_xla(names, 2, steps=2, start=3, load_prefix=sources)
    for name in names:
        ranks = resumed[name]
        ref = reference(name.split("@")[0], 2, steps=5)
        losses = [sum(r["losses"][i] for r in ranks) / 2 for i in range(2)]
        assert max(abs(a - b) for a, b in zip(losses, ref["losses"][3:])) <= TOL, name
        full = harness.consolidate(ranks)
        for key, want in ref["state_dict"].items():
            assert (full[key] - want).abs().max().item() <= TOL, (name, key)
        if name.startswith("offload"):
            assert all(step["params"] == step["optimizer"] == ["cpu"] for r in ranks for step in r["residency"])


# --------------------------------------------------------------------------- one process, one rank
def test_the_offload_path_runs_where_host_and_device_are_one(gloo, monkeypatch):
    """On gloo the device is the host, yet every gather reads a device copy of the shard (never the
    master itself, which the full parameter must not alias at one rank) and every gradient shard is
    copied into a host .grad of its own."""
    from xla_fsdp.unit.offload import HostOffload
    calls = []
    to_device, store = HostOffload.to_device, HostOffload._store
    monkeypatch.setattr(HostOffload, "to_device", lambda self, *a: calls.append("to_device") or to_device(self, *a))
    monkeypatch.setattr(HostOffload, "_store", lambda self, *a: calls.append("store") or store(self, *a))
    model = FSDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), cpu_offload=True)
    out = model(torch.ones(3, 4))
    for group in model.gather_groups:  # the root keeps its gathered parameters for backward
        assert group.comms.is_allocated(group.full) and group.full.data_ptr() != group.shard.data_ptr()
    out.sum().backward()
    assert calls == ["to_device"] * 4 + ["store"] * 4
    for group in model.gather_groups:
        assert not group.comms.is_allocated(group.full)
        assert group.shard.grad is not None and group.shard.grad.data_ptr() != group.shard.data_ptr()


SPELLINGS = {
    "True": (lambda fsdp: True, True),
    "False": (lambda fsdp: False, False),
    "CPUOffload(offload_params=True)": (lambda fsdp: fsdp.CPUOffload(offload_params=True), True),
    "CPUOffload()": (lambda fsdp: fsdp.CPUOffload(), False),
    "CPUOffloadPolicy()": (lambda fsdp: fsdp.CPUOffloadPolicy(), True),
    "CPUOffloadPolicy(pin_memory=False)": (lambda fsdp: fsdp.CPUOffloadPolicy(pin_memory=False), True),
    "OffloadPolicy()": (lambda fsdp: fsdp.OffloadPolicy(), False),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_cpu_offload_takes_pytorchs_spellings(gloo, spelling):
    import torch.distributed.fsdp as fsdp
    make, on = SPELLINGS[spelling]
    model = FSDP(nn.Linear(4, 4), cpu_offload=make(fsdp))
    assert model.cpu_offload is on and (model._runtime.offload is not None) is on
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.fast
def test_moving_an_offloading_model_keeps_its_shards_on_the_host(gloo):
    """``model.to(...)``/``.double()``, as Trainers call on the wrapped model, move buffers and leave
    the host shards as they are (objects, dtype, order: the optimizer's references stay valid)."""
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model = FSDP(nn.Sequential(FSDP(bn, cpu_offload=True), nn.Linear(4, 2)), cpu_offload=True)
    before = [(n, id(p)) for n, p in model.named_parameters()]
    model.to(torch.float64)
    assert [(n, id(p)) for n, p in model.named_parameters()] == before
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.module[0].module[1].running_mean.dtype == torch.float64  # buffers do move
    plain = FSDP(nn.Linear(4, 4)).to(torch.float64)  # without offload _apply is nn.Module's
    assert all(p.dtype == torch.float64 for p in plain.parameters())


def test_bad_offload_input_names_the_fix(gloo):
    with pytest.raises(TypeError, match=r"cpu_offload must be True/False.*CPUOffload\(offload_params=...\)"):
        FSDP(nn.Linear(2, 2), cpu_offload="yes")
    with pytest.raises(TypeError, match="cpu_offload must be"):
        FSDP(nn.Linear(2, 2), cpu_offload=1)
    with pytest.raises(ValueError, match=r"param_storage_dtype must be torch.float32 .* or torch.bfloat16.*compute_"):
        FSDP(nn.Linear(2, 2), cpu_offload=True, param_storage_dtype=torch.float16)
    with pytest.raises(TypeError, match=r"float64; parameters are sharded as float32, bfloat16 or float16"):
        FSDP(nn.Linear(2, 2).double(), cpu_offload=True)


def test_a_bf16_model_offloads_as_it_is(gloo):
    """A model loaded in bf16 (no param_storage_dtype): its host shards, gradients and AdamW state are bf16,
    as the unsharded model's would be, and its inputs are not cast (nothing asked for a compute dtype)."""
    torch.manual_seed(0)
    plain = nn.Linear(4, 4).to(torch.bfloat16)
    model = FSDP(copy.deepcopy(plain), cpu_offload=True)
    assert model.compute_dtype is torch.bfloat16 and not model.cast_forward_inputs
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.ones(2, 4, dtype=torch.bfloat16)
    model(x).float().sum().backward()
    opt.step()
    for p in model.parameters():
        assert p.device.type == "cpu" and p.dtype == p.grad.dtype == torch.bfloat16
        assert all(v.dtype == torch.bfloat16 for k, v in opt.state[p].items() if k != "step")
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain(x).float().sum().backward()
    ref_opt.step()
    from xla_fsdp.checkpoints import full_state_dict
    for name, value in full_state_dict(model, rank0_only=False).items():
        assert torch.equal(value, plain.state_dict()[name]), name


def test_bf16_storage_without_offload_and_from_a_bf16_model(gloo):
    """param_storage_dtype works for device-resident shards too and takes a model already in bf16;
    compute and buffers default to the storage dtype; the optimizer state follows the parameters."""
    for module in (nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16)):
        model = FSDP(module, param_storage_dtype=torch.bfloat16)
        assert model.compute_dtype is torch.bfloat16
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.ones(2, 4)).float().sum().backward()
        opt.step()
        for p in model.parameters():
            assert p.dtype == p.grad.dtype == torch.bfloat16
            assert all(v.dtype == torch.bfloat16 for k, v in opt.state[p].items() if k != "step")


def test_clip_grad_norm_reads_host_gradients(gloo):
    """clip_grad_norm_ of an offloading model equals torch's on the unsharded one and scales the host
    .grad tensors in place."""
    torch.manual_seed(0)
    ref = nn.Linear(6, 3)
    torch.manual_seed(0)
    model = FSDP(nn.Linear(6, 3), cpu_offload=True)
    x = torch.randn(5, 6)
    ref(x).pow(2).sum().backward()
    model(x).pow(2).sum().backward()
    grads = [p.grad for p in model.parameters()]
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    got = model.clip_grad_norm_(0.1)
    assert abs(got.item() - want.item()) <= 1e-5 and all(p.grad is g for p, g in zip(model.parameters(), grads))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad.reshape(-1)[:p.grad.numel()].reshape(p.grad.shape), atol=1e-6)


def test_bf16_storage_loads_an_fp32_checkpoint_and_back(gloo, tmp_path):
    """Checkpoints hold the shards in their storage dtype; loading casts: an fp32 run's checkpoint
    loads into bf16 host shards (rounded once) and a bf16 run's into fp32 shards (exactly)."""
    import xla_fsdp

    def make(**kw):
        model = FSDP(models.make_model("mlp"), **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.ones(2, 12)).sum().backward()
        opt.step()
        return model, opt

    fp32, fp32_opt = make()
    bf16, bf16_opt = make(cpu_offload=True, param_storage_dtype=torch.bfloat16)
    xla_fsdp.save_sharded_checkpoint(fp32, fp32_opt, str(tmp_path / "fp32"))
    xla_fsdp.save_sharded_checkpoint(bf16, bf16_opt, str(tmp_path / "bf16"))
    rounded = [p.detach().to(torch.bfloat16) for p in fp32.parameters()]
    saved_bf16 = [p.detach().clone() for p in bf16.parameters()]
    xla_fsdp.load_sharded_checkpoint(bf16, bf16_opt, str(tmp_path / "fp32"))
    assert all(torch.equal(p, want) for p, want in zip(bf16.parameters(), rounded))
    assert all(v.dtype == torch.bfloat16 for st in bf16_opt.state.values() for k, v in st.items() if k != "step")
    xla_fsdp.load_sharded_checkpoint(fp32, fp32_opt, str(tmp_path / "bf16"))
    for p, want in zip(fp32.parameters(), saved_bf16):
        assert p.dtype == torch.float32 and torch.equal(p, want.float())
