"""Checkpoints that travel to and from PyTorch Distributed Checkpoint: FSDP2 on gloo saves
with DCP, ``python -m xla_fsdp.convert --from dcp`` gives xla_fsdp rank files for another world
size, and xla_fsdp continues the run as FSDP2 continues it; xla_fsdp's checkpoint goes back with
``--to dcp`` to FSDP2 and to a plain model. Model and AdamW state both (1e-5 on losses and
parameters: the frameworks sum gradients in different orders)."""
import os

import pytest

import fsdp2_runs
import harness
import models
from ranks import on_gloo, run_multiprocess, xla_cpu_devices
from training_program import BUILD_LOCK
from xla_fsdp.convert import main as convert_cli

K = 3  # steps per leg
GLOBAL_BATCH = 8
TOL = 1e-5


def _close(got, want, what):
    worst = max(abs(a - b) for a, b in zip(got, want))
    print(f"{what}: losses within {worst:.2e}")
    assert worst <= TOL, (what, got, want)


def _params_close(full, want):
    assert set(want) <= set(full), set(want) - set(full)
    worst = max((full[k].float() - v.float()).abs().max().item() for k, v in want.items())
    print(f"  parameters within {worst:.2e}")
    assert worst <= TOL


@pytest.mark.parametrize("name", ["flatten_nested_adamw"])  # flat units: the layout furthest from FSDP2's
def test_fsdp2_and_xla_fsdp_continue_each_others_runs(name, tmp_path):
    # FSDP2, 2 ranks: K steps, save with DCP; and its own continuation, the reference
    first = str(tmp_path / "fsdp2_step3")
    fsdp2_runs.run(name, 2, K, per_rank=GLOBAL_BATCH // 2, save_dir=first)
    fsdp2_continued = fsdp2_runs.run(name, 2, K, start=K, per_rank=GLOBAL_BATCH // 2, load_dir=first)

    # DCP -> xla_fsdp rank files for 4 ranks -> xla_fsdp continues (and saves)
    imported = str(tmp_path / "imported")
    assert convert_cli(["--from", "dcp", "--ckpt_dir", first, "--world_size", "4", "--out_prefix", imported]) == 0
    ours = str(tmp_path / "ours_step6")
    run = harness.run_gloo([name], 4, steps=K, start=K, per_rank=GLOBAL_BATCH // 4, load_prefix=imported,
                           save_prefix=ours)[name]
    ours_losses = [sum(r["losses"][i] for r in run) / 4 for i in range(K)]
    _close(ours_losses, fsdp2_continued["losses"], "xla_fsdp continuing FSDP2's run")
    _params_close(harness.consolidate(run), fsdp2_continued["full"])

    # xla_fsdp (4 ranks) -> DCP -> FSDP2 (2 ranks) continues == xla_fsdp continuing itself
    exported = str(tmp_path / "ours_step6_dcp")
    assert convert_cli(["--to", "dcp", "--ckpt_prefix", ours, "--out", exported]) == 0
    ours_continued = harness.run_gloo([name], 4, steps=K, start=2 * K, per_rank=GLOBAL_BATCH // 4,
                                      load_prefix=ours)[name]
    ours_continued_losses = [sum(r["losses"][i] for r in ours_continued) / 4 for i in range(K)]
    theirs = fsdp2_runs.run(name, 2, K, start=2 * K, per_rank=GLOBAL_BATCH // 2, load_dir=exported)
    _close(theirs["losses"], ours_continued_losses, "FSDP2 continuing xla_fsdp's run")
    _params_close(theirs["full"], harness.consolidate(ours_continued))

    # ... and a plain, unwrapped model with a plain AdamW, one process, the whole global batch
    plain_losses, plain_state = _plain_continues(name, exported)
    _close(plain_losses, ours_continued_losses, "a plain model continuing xla_fsdp's run")
    _params_close(plain_state, harness.consolidate(ours_continued))


def test_a_torchtitan_checkpoint_continues_on_xla_fsdp_at_another_world_size(tmp_path):
    """torchtitan's DCP layout (model keys at the top level, optimizer state flattened per parameter,
    lr_scheduler/train_state beside them), found without --model_key: FSDP2 at 2 ranks -> xla_fsdp
    at 4 continues as the unsharded run does; the AdamW state and lr come across."""
    import torch.distributed.checkpoint as dcp
    name, saved = "zero3_nested_adamw", str(tmp_path / "titan_step3")
    fsdp2_runs.run(name, 2, K, per_rank=GLOBAL_BATCH // 2, save_dir=saved, layout="torchtitan")
    names = set(dcp.FileSystemReader(saved).read_metadata().state_dict_metadata)
    assert any(n.startswith("optimizer.param_groups.") and not n.split(".")[2].isdigit() for n in names)
    assert not any(n.startswith("model.") for n in names) and "train_state.step" in names
    imported = str(tmp_path / "imported")
    assert convert_cli(["--from", "dcp", "--ckpt_dir", saved, "--world_size", "4", "--out_prefix", imported]) == 0
    run = harness.run_gloo([name], 4, steps=K, start=K, per_rank=GLOBAL_BATCH // 4, load_prefix=imported)[name]
    ours = [sum(r["losses"][i] for r in run) / 4 for i in range(K)]
    reference = harness.train_reference(name, 4, steps=2 * K, per_rank=GLOBAL_BATCH // 4)
    _close(ours, reference["losses"][K:], "xla_fsdp continuing torchtitan-layout FSDP2 run")
    _params_close(harness.consolidate(run), reference["state_dict"])


def _plain_continues(name, dcp_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    cfg = harness.CONFIGS[name]
    model = models.make_model(cfg["model"], seed=1)  # other initial weights: the load must replace them
    opt = harness.make_optimizer(cfg["opt"], model)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = []
    for step in range(2 * K, 3 * K):
        opt.zero_grad()
        x, y = models.batch(cfg["model"], step, 0, GLOBAL_BATCH)
        loss = models.loss_fn(cfg["model"], model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.fast
def test_convert_refuses_bad_input_clearly(tmp_path, capsys):
    harness.copy_session_checkpoint("torch", 2, "zero3_nested_adamw", str(tmp_path / "ck"))
    out = tmp_path / "dcp"
    assert convert_cli(["--to", "dcp", "--ckpt_prefix", str(tmp_path / "ck"), "--out", str(out)]) == 0
    assert convert_cli(["--to", "dcp", "--ckpt_prefix", str(tmp_path / "ck"), "--out", str(out)]) == 0  # replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    assert convert_cli(["--to", "dcp", "--ckpt_prefix", str(tmp_path / "ck"), "--out", str(tmp_path / "mine")]) == 2
    assert "exists and is not a DCP checkpoint folder" in capsys.readouterr().err
    assert convert_cli(["--from", "dcp", "--ckpt_dir", str(tmp_path), "--world_size", "2",
                        "--out_prefix", str(tmp_path / "x")]) == 2
    assert "not a DCP checkpoint folder" in capsys.readouterr().err
    assert convert_cli(["--from", "dcp", "--ckpt_dir", str(out), "--world_size", "2", "--out_prefix",
                        str(tmp_path / "x"), "--model_key", "weights"]) == 2
    assert "no entries under 'weights.'" in capsys.readouterr().err
    assert not any(f.startswith("x_rank") or ".tmp" in f for f in os.listdir(tmp_path))
    with pytest.raises(SystemExit):
        convert_cli(["--to", "dcp", "--ckpt_prefix", str(tmp_path / "ck")])  # no --out


def _state_dict_api_worker(me, name, phase, dcp_dir, out_dir):
    """The FSDP2 tutorial's checkpoint code, run on an xla_fsdp model with xla_fsdp's functions."""
    _state_dict_api_steps(me.rank, me.world_size, name, phase, dcp_dir, out_dir)


def _state_dict_api_steps(rank, world_size, name, phase, dcp_dir, out_dir):
    import torch
    import torch.distributed.checkpoint as dcp

    from xla_fsdp.checkpoints.files import CheckpointError
    from xla_fsdp.checkpoints.state_dict_api import StateDictOptions, get_state_dict, set_state_dict
    cfg = harness.CONFIGS[name]
    model = cfg["wrap"](models.make_model(cfg["model"]))
    opt = harness.make_optimizer(cfg["opt"], model)
    full = StateDictOptions(full_state_dict=True)
    start = 0
    if phase == "load":
        model_sd, optim_sd = get_state_dict(model, opt, options=full)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=dcp_dir)
        # the tutorial's other way: rank 0 holds the dict, the others an empty one
        from_rank0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_state_dict(model, opt, model_state_dict=state["model"] if rank == 0 else {},
                       optim_state_dict=state["optim"] if rank == 0 else {}, options=from_rank0)
        start = K
    losses = []
    for step in range(start, start + K):
        opt.zero_grad()
        x, y = models.batch(cfg["model"], step, rank, GLOBAL_BATCH // world_size)
        loss = models.loss_fn(cfg["model"], model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if phase == "save":  # the tutorial's options: full tensors, on rank 0's host
        offload = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, optim_sd = get_state_dict(model, opt, options=offload)
        assert (len(model_sd) > 0) == (rank == 0) and (len(optim_sd) > 0) == (rank == 0)
        with pytest.raises(CheckpointError, match="save_sharded_checkpoint"):
            get_state_dict(model, opt, options=StateDictOptions(full_state_dict=False))
        # PyTorch's own functions would read each rank's shard as the whole tensor: one clear error instead
        import torch.distributed.checkpoint.state_dict as upstream
        with pytest.raises(CheckpointError, match="need DTensor parameters.*xla_fsdp.checkpoints.state_dict_api"):
            upstream.get_state_dict(model, opt, options=offload)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=dcp_dir)
    torch.save({"losses": losses}, os.path.join(out_dir, f"{phase}{rank}.pt"))


def test_the_fsdp2_tutorials_state_dict_code_runs_on_xla_fsdp_across_world_sizes(tmp_path):
    """get_state_dict(full_state_dict=True) -> dcp.save at 2 ranks; dcp.load -> set_state_dict at 4
    ranks (broadcast_from_rank0=True, the dicts on rank 0 only); the 4-rank run continues as the
    uninterrupted unsharded run does (1e-5)."""
    import torch
    name, folder = "zero3_nested_adamw", str(tmp_path / "dcp")
    on_gloo(_state_dict_api_worker, 2, name, "save", folder, str(tmp_path))
    on_gloo(_state_dict_api_worker, 4, name, "load", folder, str(tmp_path))
    ranks = [torch.load(tmp_path / f"load{r}.pt", weights_only=True)["losses"] for r in range(4)]
    resumed = [sum(r[i] for r in ranks) / 4 for i in range(K)]
    reference = harness.train_reference(name, 4, steps=2 * K, per_rank=GLOBAL_BATCH // 4)["losses"][K:]
    _close(resumed, reference, "the state dict API through DCP, 2 -> 4 ranks")


def _through_dcp(model, opt, tmp_path) -> str:
    """Save the rank files at tmp_path/ck, export them to DCP (tmp_path/dcp) and import that for 2 ranks at
    tmp_path/back; returns the first prefix."""
    import xla_fsdp
    ck = str(tmp_path / "ck")
    xla_fsdp.save_sharded_checkpoint(model, opt, ck)
    assert convert_cli(["--to", "dcp", "--ckpt_prefix", ck, "--out", str(tmp_path / "dcp")]) == 0
    assert convert_cli(["--from", "dcp", "--ckpt_dir", str(tmp_path / "dcp"), "--world_size", "2",
                        "--out_prefix", str(tmp_path / "back")]) == 0
    return ck


@pytest.mark.fast
def test_a_dcp_round_trip_keeps_the_optimizer_state_with_its_parameters(tmp_path, gloo):
    """Rank files -> --to dcp -> --from dcp -> consolidate --optimizer: the
    optimizer's parameters in the unwrapped model's order, as the direct consolidation gives them.
    Before: the export wrote the wrapped model's order (the root unit's parameters first) into DCP's
    metadata, the import took it as the model's, and a plain AdamW(model.parameters()) loading the
    result gave each layer another layer's moments (silently, where shapes matched)."""
    import torch
    import torch.nn as nn

    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    from xla_fsdp.consolidate_sharded_ckpts import main as consolidate_cli

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    base = make()
    inner = [base[0], base[2]]  # units around the first two layers: the root's own (layer 4) come first
    model = FSDP(base, auto_wrap_policy=lambda module, recurse, **k: recurse or any(module is m for m in inner))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).square().sum().backward()
    opt.step()
    ck = _through_dcp(model, opt, tmp_path)
    for prefix in (ck, str(tmp_path / "back")):
        assert consolidate_cli(["--ckpt_prefix", prefix, "--optimizer"]) == 0
    direct = torch.load(ck + "_consolidated.pth", weights_only=True)
    via_dcp = torch.load(str(tmp_path / "back") + "_consolidated.pth", weights_only=True)
    plain = make()
    names = [n for n, _ in plain.named_parameters()]
    assert direct["optimizer"]["param_groups"][0]["params"] == names
    assert via_dcp["optimizer"]["param_groups"][0]["params"] == names
    for full in (direct, via_dcp):
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
        plain_opt.load_state_dict(full["optimizer"])
        for name, p in plain.named_parameters():  # each parameter's own moments, by name
            assert torch.equal(plain_opt.state[p]["exp_avg"], direct["optimizer"]["state"][name]["exp_avg"]), name
    assert all(torch.equal(direct["model"][k], via_dcp["model"][k]) for k in direct["model"])


class _ScaledByZeroD(__import__("torch").nn.Module):
    """A model with a 0-d parameter (a learnt scalar, as gates and temperatures are written)."""

    def __init__(self):
        import torch
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.t = torch.nn.Parameter(torch.tensor(0.5))
        self.b = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.b(self.a(x) * self.t)


@pytest.mark.fast
@pytest.mark.parametrize("flatten", [False, True])
def test_a_zero_d_parameters_moments_survive_dcp_and_the_full_optimizer_state(flatten, tmp_path, gloo):
    """A 0-d parameter's Adam moments are per element like every other's (all its fields are 0-d, so
    their shape cannot tell): rank files -> --to dcp -> --from dcp at 2 ranks -> consolidate gives the
    moments of a plain AdamW trained the same (1e-6), the imported files resume as the plain run
    continues (1e-6), and load_full_optim_state_dict of the plain
    optimizer's state gives the shard the same moments as the wrapped optimizer's own."""
    import torch

    import xla_fsdp
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    from xla_fsdp.checkpoints import full_optim_state_dict, full_state_dict, load_full_optim_state_dict
    from xla_fsdp.consolidate_sharded_ckpts import main as consolidate_cli

    def make():
        torch.manual_seed(0)
        return _ScaledByZeroD()

    x = torch.randn(4, 6)
    plain = make()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    model = FSDP(make(), flatten_parameters=flatten)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for m, o in ((plain, plain_opt), (model, opt)):
        for _ in range(2):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    ck = _through_dcp(model, opt, tmp_path)
    want = {n: plain_opt.state[p] for n, p in plain.named_parameters()}
    assert want["t"]["exp_avg"].dim() == 0 and want["t"]["exp_avg"].abs().item() > 0
    for prefix in (ck, str(tmp_path / "back")):
        assert consolidate_cli(["--ckpt_prefix", prefix, "--optimizer"]) == 0
        got = torch.load(prefix + "_consolidated.pth", weights_only=True)["optimizer"]["state"]
        for name, st in want.items():
            for field in ("exp_avg", "exp_avg_sq"):
                assert got[name][field].shape == st[field].shape, (prefix, name, field)
                assert (got[name][field] - st[field]).abs().max().item() <= 1e-6, (prefix, name, field)
    full = full_optim_state_dict(model, opt, rank0_only=False)
    for field in ("exp_avg", "exp_avg_sq"):
        assert (full["state"]["t"][field] - want["t"][field]).abs().max().item() <= 1e-6, field
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_full_optim_state_dict(model, fresh, full)
    own = opt.state_dict()["state"]
    for idx, st in fresh.state_dict()["state"].items():
        for field in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[field], own[idx][field]), (idx, field)
    # the imported files resume: one more step from them is one more plain step
    assert convert_cli(["--from", "dcp", "--ckpt_dir", str(tmp_path / "dcp"), "--world_size", "1",
                        "--out_prefix", str(tmp_path / "one")]) == 0
    resumed = FSDP(make(), flatten_parameters=flatten)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    xla_fsdp.load_sharded_checkpoint(resumed, resumed_opt, str(tmp_path / "one"))
    for m, o in ((plain, plain_opt), (resumed, resumed_opt)):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()
    after = full_state_dict(resumed, rank0_only=False)
    for name, q in plain.named_parameters():
        assert (after[name].reshape(q.shape) - q.detach()).abs().max().item() <= 1e-6, name


class _RunsCode:
    """A pickle that, loaded with plain pickle, creates ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _dcp_copy(src, tmp_path, name):
    import shutil
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst, next(p for p in dst.iterdir() if p.suffix == ".distcp")


@pytest.mark.fast
def test_convert_from_dcp_runs_no_code_and_names_damage(tmp_path, capsys):
    """Before: DCP's .metadata was unpickled with plain pickle (a crafted one
    ran os.system, then a traceback, exit 1); a truncated .metadata or .distcp gave a raw traceback,
    exit 1, and left the output folder behind; a flipped byte in a .distcp converted silently and
    inspect then reported the new files plainly "ok"."""
    import pickle

    from xla_fsdp.inspect import main as inspect_cli
    marker = tmp_path / "code_ran"
    src = harness.small_checkpoint(tmp_path, models.MLP, input_width=12) / "dcp"
    evil, _ = _dcp_copy(src, tmp_path, "evil")
    with open(evil / ".metadata", "wb") as f:
        pickle.dump(_RunsCode(marker), f)
    trunc_meta, _ = _dcp_copy(src, tmp_path, "trunc_meta")
    raw = (trunc_meta / ".metadata").read_bytes()
    (trunc_meta / ".metadata").write_bytes(raw[:len(raw) // 2])
    trunc_data, data = _dcp_copy(src, tmp_path, "trunc_data")
    data.write_bytes(data.read_bytes()[:data.stat().st_size // 2])
    expected = {evil: ["is refused, nothing in it was run", "posix.system"],
                trunc_meta: ["is damaged (truncated or not DCP metadata", "copy the checkpoint folder again"],
                trunc_data: ["from the DCP checkpoint", "failed", "damaged or incomplete"]}
    for folder, words in expected.items():
        out = tmp_path / f"out_{folder.name}" / "deeper"
        assert convert_cli(["--from", "dcp", "--ckpt_dir", str(folder), "--world_size", "2",
                            "--out_prefix", str(out / "ck")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
        assert all(w in err for w in words), (folder.name, err)
        assert not (tmp_path / f"out_{folder.name}").exists()  # the folders it made are gone again
    assert not marker.exists()

    flipped, data = _dcp_copy(src, tmp_path, "flipped")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    assert convert_cli(["--from", "dcp", "--ckpt_dir", str(flipped), "--world_size", "2",
                        "--out_prefix", str(tmp_path / "imported")]) == 0
    assert "DCP keeps no checksums" in capsys.readouterr().out
    assert inspect_cli(["--ckpt_prefix", str(tmp_path / "imported")]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("checksums")]
    assert len(lines) == 2 and all("its values are unverified" in line and str(flipped) in line for line in lines)


@pytest.mark.fast
def test_a_dcp_export_past_the_file_size_limit_is_one_line(tmp_path):
    """Before: under ``ulimit -f`` DCP's CheckpointException came out as a traceback,
    exit 1 (its per-rank failures are (exception, traceback) pairs, which the no-room search missed)."""
    import subprocess
    import sys
    harness.small_checkpoint(tmp_path, models.MLP, input_width=12)
    size = os.path.getsize(tmp_path / "in" / "ck_rank-00000000-of-00000001.pth")
    limit_kib = max(1, size // 1024 // 2)
    # the limit set in the child only (preexec), after Python and torch are imported there
    code = ("import resource, sys; from xla_fsdp.convert import main; "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit_kib * 1024}, resource.RLIM_INFINITY)); "
            "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "--to", "dcp", "--ckpt_prefix", str(tmp_path / "in" / "ck"),
                           "--out", str(tmp_path / "out" / "dcp")], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "the file size limit (ulimit -f) is reached" in done.stderr, done.stderr
    assert "ulimit -f unlimited" in done.stderr and "free space" not in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def _broadcast_from_rank0_on_xla(how: str, folder: str):
    """Rank 0's full state dicts loaded into a differently initialized model on every rank with
    broadcast_from_rank0=True, the tutorial's xla process group initialized; then the tutorial's
    collective DCP save of the first model's full dicts and collective load into a third model."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch_xla

    import xla_fsdp
    from xla_fsdp.checkpoints.state_dict_api import StateDictOptions, get_state_dict, set_state_dict
    dist.init_process_group("xla", init_method="xla://")
    try:
        def build(seed):
            with BUILD_LOCK:
                torch.manual_seed(seed)
                net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
            net = net.to(torch_xla.device())
            if how == "fully_shard":
                xla_fsdp.fully_shard(net[0])
                model = xla_fsdp.fully_shard(net)
            else:
                model = xla_fsdp.XlaFullyShardedDataParallel(net, flatten_parameters=how == "flat")
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            model(torch.ones(2, 6, device=torch_xla.device())).square().mean().backward()
            opt.step()
            xla_fsdp.sync()
            return model, opt
        model, opt = build(0)
        saved = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        other, other_opt = build(1)
        rank = dist.get_rank()
        set_state_dict(other, other_opt, model_state_dict=saved[0] if rank == 0 else {},
                       optim_state_dict=saved[1] if rank == 0 else {},
                       options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        full = StateDictOptions(full_state_dict=True)
        want, got = get_state_dict(model, opt, options=full), get_state_dict(other, other_opt, options=full)
        dcp.save({"model": want[0], "optim": want[1]}, checkpoint_id=folder)  # every rank, on the xla group
        third, third_opt = build(2)
        template = get_state_dict(third, third_opt, options=full)
        state = {"model": template[0], "optim": template[1]}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(third, third_opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=full)
        return {"want": want, "got": got, "dcp": get_state_dict(third, third_opt, options=full)}
    finally:
        dist.destroy_process_group()




@pytest.mark.xla
@pytest.mark.parametrize("how", ["fully_shard", "flat"])
def test_the_tutorials_checkpoint_calls_on_the_xla_group(how, tmp_path):
    """On 2 XLA:CPU devices with the xla process group initialized, as the FSDP2
    tutorial's program: set_state_dict(..., broadcast_from_rank0=True) (before: 'Check failed:
    device.type() == at::kXLA (cpu vs. xla)' inside torch_xla) and the collective dcp.save / dcp.load
    of get_state_dict's full dicts (before: 'Argument gather_list must be specified on destination
    rank', then the same check failure: torch's object collectives broadcast host tensors) give every
    rank the saved model and optimizer state exactly."""
    with xla_cpu_devices(2):
        results = run_multiprocess(_broadcast_from_rank0_on_xla, how, str(tmp_path / "dcp"))
    for rank, r in results.items():
        for got_key in ("got", "dcp"):
            _same_state(r["want"], r[got_key], (rank, got_key))


def _same_state(want, got, where) -> None:
    import torch
    want_model, want_optim = want
    got_model, got_optim = got
    assert want_model.keys() == got_model.keys(), where
    for k in want_model:
        assert torch.equal(want_model[k], got_model[k]), (where, k)
    assert want_optim["state"].keys() == got_optim["state"].keys(), where
    for k, fields in want_optim["state"].items():
        for f, v in fields.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(got_optim["state"][k][f])), (where, k, f)
