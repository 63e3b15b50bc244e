"""Programs written for torch_xla's FSDP work unchanged: the HF Trainer's file names and
``model.module.module``, keyword arguments through ``checkpoint_module``, a forward that raised,
and rank files any torch.load(weights_only=True) reads."""
import os
import shutil

import pytest
import torch
import torch.nn as nn

import harness
import models
import xla_fsdp
from ranks import run_multiprocess
from xla_fsdp import XlaFullyShardedDataParallel as FSDP, checkpoint_module
from xla_fsdp.checkpoints.files import CheckpointError

TRAINER_SUFFIX = "rank*-of-*-pytorch_model.bin"


@pytest.fixture(scope="module")
def trainer_ckpt(tmp_path_factory):
    """The nested ZeRO-3 MLP of the session's 2-rank gloo run, written as the HF Trainer does: plain
    torch.save of {'model', 'shard_metadata'} to ``{dir}/rank{r}-of-{ws}-pytorch_model.bin``."""
    results, _ = harness.session_run("torch", 2)
    ranks = results["zero3_nested_adamw"]
    folder = tmp_path_factory.mktemp("trainer")
    for r in ranks:
        md = r["metadata"]
        torch.save({"model": r["state_dict"], "shard_metadata": md},
                   folder / f"rank{md['rank']}-of-{md['world_size']}-pytorch_model.bin")
    return str(folder) + os.sep, ranks[0]["full"]


def test_consolidation_takes_any_suffix_glob_with_ranks_from_metadata(trainer_ckpt):
    prefix, full = trainer_ckpt
    state, _ = xla_fsdp.consolidate_sharded_model_checkpoints(prefix, TRAINER_SUFFIX, save_model=False)
    assert set(state) == set(full)
    assert all(torch.equal(state[k], v) for k, v in full.items())


@pytest.mark.parametrize("case", ["duplicate", "gap", "mixed_world_sizes", "not_a_rank_file"])
def test_any_suffix_glob_still_refuses_bad_sets(trainer_ckpt, tmp_path, case):
    prefix, _ = trainer_ckpt
    for name in os.listdir(prefix):
        shutil.copy(os.path.join(prefix, name), tmp_path / name)
    if case == "duplicate":
        shutil.copy(tmp_path / "rank0-of-2-pytorch_model.bin", tmp_path / "rank9-of-2-pytorch_model.bin")
        expected = "rank 0 appears twice"
    elif case == "gap":
        os.remove(tmp_path / "rank1-of-2-pytorch_model.bin")
        expected = "missing rank files for ranks \\[1\\]"
    elif case == "mixed_world_sizes":
        ckpt = torch.load(tmp_path / "rank1-of-2-pytorch_model.bin", weights_only=True)
        ckpt["shard_metadata"] = dict(ckpt["shard_metadata"], world_size=4)
        torch.save(ckpt, tmp_path / "rank1-of-2-pytorch_model.bin")
        expected = "different world sizes"
    else:
        torch.save({"weights": torch.zeros(2)}, tmp_path / "rank5-of-2-pytorch_model.bin")
        expected = "not a sharded checkpoint"
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    with pytest.raises(CheckpointError, match=expected):
        xla_fsdp.consolidate_sharded_model_checkpoints(str(tmp_path) + os.sep, TRAINER_SUFFIX, save_model=False)
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == before  # inputs untouched


def test_metadata_and_rank_files_load_with_weights_only(trainer_ckpt, tmp_path, gloo):
    prefix, _ = trainer_ckpt
    for name in os.listdir(prefix):  # plain torch.save of get_shard_metadata() (the Trainer's resume)
        assert "shard_metadata" in torch.load(os.path.join(prefix, name), weights_only=True)
    model = FSDP(models.MLP())
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 12)).sum().backward()
    opt.step()
    xla_fsdp.save_sharded_checkpoint(model, opt, str(tmp_path / "ck"))  # the save helper's files
    for path in tmp_path.glob("ck_rank-*.pth"):
        ckpt = torch.load(path, weights_only=True)
        assert type(ckpt["shard_metadata"]["library_versions"]["torch"]) is str


def test_module_module_is_the_users_module_and_names_stay(gloo):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.config = {"hidden": 4}

        def forward(self, x):
            return self.b(self.a(x))

    net = Net()
    names = [n for n, _ in Net().named_parameters()]
    net.a, net.b = FSDP(net.a), FSDP(net.b)
    model = FSDP(net)
    assert model.module.module is net  # torch_xla: flatten wrapper, then the user's module
    assert isinstance(model.module, Net) and model.module.config == {"hidden": 4}
    assert model.module.a.module.module is net.a._fsdp_wrapped_module
    assert model.module.b.module.module is not model.module.a.module.module
    assert not hasattr(net, "module")  # the user's module itself is not changed

    def unwrap(m):  # transformers.modeling_utils.unwrap_model: follows .module while it exists
        return unwrap(m.module) if hasattr(m, "module") else m
    assert unwrap(model) is net
    sharded_keys = list(model.state_dict())
    from xla_fsdp.checkpoints import full_state_dict
    assert sorted(full_state_dict(model)) == sorted(names) and sharded_keys == list(model.state_dict())


def test_checkpoint_module_takes_keyword_arguments(gloo):
    torch.manual_seed(0)
    plain = nn.Linear(4, 4)
    torch.manual_seed(0)
    model = FSDP(checkpoint_module(nn.Linear(4, 4)))
    x = torch.randn(3, 4)
    out = model(input=x)  # keywords only, and no input requiring grad
    assert torch.allclose(out, plain(x))
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_forward_that_raised_leaves_no_unit_stuck(gloo):
    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = FSDP(nn.Linear(4, 4))
            self.fail = True

        def forward(self, x):
            y = self.inner(x)
            if self.fail:
                raise ValueError("bad batch")
            return y

    model = FSDP(Flaky())
    with pytest.raises(ValueError, match="bad batch"):
        model(torch.randn(2, 4))
    model.module.fail = False
    model(torch.randn(2, 4)).sum().backward()  # was: "unit in state forward, expected one of ['idle']"
    assert all(p.grad is not None for p in model.parameters())


def _xla_fully_shard_forward_raises():
    import torch_xla
    from xla_fsdp import fully_shard
    dev = torch_xla.device()

    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.out, self.fail = nn.Linear(4, 4), nn.Linear(4, 2), True

        def forward(self, x):
            y = self.inner(x)
            if self.fail:
                raise ValueError("bad batch")
            return self.out(y)

    torch.manual_seed(0)
    plain = Flaky()
    plain.fail = False
    model = Flaky()
    model.load_state_dict(plain.state_dict())
    model.to(dev)
    fully_shard(model.inner)
    fully_shard(model)
    x = torch.randn(3, 4)
    try:
        model(x.to(dev))
    except ValueError as e:
        raised = str(e)
    model.fail = False

    def interrupt(module, args):  # Ctrl-C inside the inner unit's forward: no always_call post-hook runs
        raise KeyboardInterrupt

    handle = model.inner.register_forward_pre_hook(interrupt)
    try:
        model(x.to(dev))
    except KeyboardInterrupt:
        stuck = [u.training_state.value for u in xla_fsdp.fsdp2._units(model, True)]
    handle.remove()
    try:  # a forward inside a handler of the program's own: the hooks must not take it for the module raising
        raise KeyError("the program's own")
    except KeyError:
        model(x.to(dev)).sum().backward()
    xla_fsdp.sync()
    plain(x).sum().backward()
    grads = {n: p.grad for n, p in plain.named_parameters()}
    return raised, stuck, [u.training_state.value for u in xla_fsdp.fsdp2._units(model, True)], {
        n: (p.grad.cpu() - grads[n][:p.shape[0]]).abs().max().item() for n, p in model.named_parameters()}


@pytest.mark.xla
def test_a_fully_shard_forward_that_raised_leaves_no_unit_stuck_on_xla(monkeypatch):
    """fully_shard's forward hooks (as FSDP2's): the module raising leaves every unit idle and resharded
    (the post-hook runs with always_call), and the next forward trains as unsharded; a forward the program
    makes inside its own exception handler is not taken for one that raised. A KeyboardInterrupt (which
    skips always_call hooks) leaves the units in forward until the next forward begins, which ends them."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "1")
    raised, stuck, states, errors = run_multiprocess(_xla_fully_shard_forward_raises)[0]
    assert raised == "bad batch" and set(states) == {"idle"}, (raised, states)
    assert stuck == ["forward", "forward"], stuck
    assert max(errors.values()) < 1e-6, errors


def _xla_checkpoint_with_keywords():
    import torch_xla
    dev = torch_xla.device()

    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, mask=None, scale=1.0):
            return self.fc(x) * mask * scale

    torch.manual_seed(0)
    model = FSDP(checkpoint_module(Gated()))
    x = torch.randn(3, 4).to(dev).requires_grad_()
    mask = torch.rand(3, 4).to(dev).requires_grad_()
    out = model(x, mask=mask, scale=2.0)
    out.sum().backward()
    xla_fsdp.sync()
    return out.detach().cpu(), x.grad.cpu(), mask.grad.cpu()


@pytest.mark.xla
def test_checkpoint_module_takes_keyword_arguments_on_xla(monkeypatch):
    """torch_xla's checkpoint rejects keywords; keyword tensors must still get their gradients."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "1")
    out, x_grad, mask_grad = run_multiprocess(_xla_checkpoint_with_keywords)[0]
    torch.manual_seed(0)
    fc = nn.Linear(4, 4)
    x = torch.randn(3, 4).requires_grad_()
    mask = torch.rand(3, 4).requires_grad_()
    want = fc(x) * mask * 2.0
    want.sum().backward()
    assert torch.allclose(out, want, atol=1e-5)
    assert torch.allclose(x_grad, x.grad, atol=1e-5) and torch.allclose(mask_grad, mask.grad, atol=1e-5)


@pytest.mark.parametrize("name, parameters_order", [("zero3_nested_adamw", True), ("wd_groups_flat_lm_adamw", False)])
def test_torch_xla_style_files_resize_and_consolidate_with_optimizer_state(name, parameters_order, tmp_path, capsys):
    """Rank files written as torch_xla documents it: plain torch.save of the model's state dict,
    get_shard_metadata() and the optimizer's state dict (no optimizer map, run id or checksums)."""
    from xla_fsdp.checkpoints import rank_path
    from xla_fsdp.consolidate_sharded_ckpts import main as consolidate_cli
    from xla_fsdp.resize import main as resize_cli
    results, prefix = harness.session_run("torch", 2)
    folder = tmp_path / "plain"
    folder.mkdir()
    for rank in range(2):
        ckpt = torch.load(rank_path(prefix.format(name=name), rank, 2), weights_only=True)
        metadata = {k: v for k, v in ckpt["shard_metadata"].items()
                    if k not in ("optimizer_param_keys", "run_id", "checksums")}
        torch.save({"model": ckpt["model"], "shard_metadata": metadata, "optimizer": ckpt["optimizer"]},
                   folder / f"rank{rank}-of-2-pytorch_model.bin")
    out = str(tmp_path / "full.pth")
    code = consolidate_cli(["--ckpt_prefix", str(folder) + os.sep, "--ckpt_suffix", TRAINER_SUFFIX,
                            "--optimizer", "--save_path", out])
    if not parameters_order:  # optimizer groups by name: the order cannot be guessed; say how to save it
        assert code == 2 and "optimizer_param_keys(model, optimizer)" in capsys.readouterr().err
        return
    assert code == 0
    want = results[name][0]["full_optim"]
    got = torch.load(out, weights_only=True)["optimizer"]
    for pname, state in want["state"].items():
        assert all(torch.equal(got["state"][pname][f], v) for f, v in state.items() if isinstance(v, torch.Tensor))
    resized = str(tmp_path / "ws4")
    assert resize_cli(["--ckpt_prefix", str(folder) + os.sep, "--ckpt_suffix", TRAINER_SUFFIX,
                        "--world_size", "4", "--out_prefix", resized]) == 0
    out4 = str(tmp_path / "full4.pth")
    assert consolidate_cli(["--ckpt_prefix", resized, "--optimizer", "--save_path", out4]) == 0
    again = torch.load(out4, weights_only=True)
    assert all(torch.equal(again["model"][k], v) for k, v in torch.load(out, weights_only=True)["model"].items())
    for pname, state in want["state"].items():
        assert all(torch.equal(again["optimizer"]["state"][pname][f], v)
                   for f, v in state.items() if isinstance(v, torch.Tensor))


def test_torch_xlas_parameter_attributes_are_kept_current(gloo):
    """Clients of torch_xla's FSDP read these (Lightning's XLAFSDPStrategy finds the optimizer's shards
    by ``_is_sharded``; torch_xla's tests read ``_has_full_param``). Before: none existed."""
    torch.manual_seed(0)
    net = models.MLP()
    net.fc2 = FSDP(net.fc2)
    model = FSDP(net, reshard_after_forward=True, disable_reshard_on_root=False)
    shards = dict(model.named_parameters())
    assert all(p._is_sharded for p in shards.values())
    for name, p in shards.items():
        assert p._name == name.rsplit(".", 1)[-1]
        assert "_fsdp_wrapped_module." in p._orig_name
    inner = model.fc2
    group = inner.gather_groups[0]
    assert group.shard._orig_size == torch.Size(group.full_shape) and group.full._sharded_param is group.shard
    seen = []
    inner.module.register_forward_pre_hook(lambda *_: seen.append(group.full._has_full_param))
    model(torch.randn(2, 12)).sum().backward()
    assert seen == [True]  # gathered for its forward
    assert group.full._has_full_param == group.is_unsharded()  # at one rank the shard itself stays installed


@pytest.mark.xla
def test_lightning_fabrics_xla_fsdp_strategy_trains_saves_and_loads(tmp_path):
    """Lightning Fabric's ``XLAFSDPStrategy``, unchanged, on 2 XLA:CPU devices under
    ``python -m xla_fsdp.compat``: it trains, saves a sharded checkpoint, loads it into a new model and
    optimizer, and the loaded run's next losses equal the uninterrupted run's. Before: setup_optimizers
    refused every optimizer ('does not seem to reference any XLAFSDP parameters')."""
    import subprocess
    import sys
    import json
    script = os.path.join(os.path.dirname(__file__), "lightning_fabric_xla_fsdp.py")
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2")
    proc = subprocess.run([sys.executable, "-m", "xla_fsdp.compat", script, str(tmp_path / "ckpt")], env=env,
                          capture_output=True, text=True, timeout=300)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == 2, proc.stderr[-3000:]
    for result in results:
        assert result["world_size"] == 2 and result["step"] == 2
        assert result["after_load"] == result["continued"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == [f"checkpoint_rank-0000000{r}-of-00000002.pth" for r in range(2)]
