"""Checkpoint tools never lose data, never run code and never pass damage on: outputs that are
inputs are refused, files are unpickled with weights_only, every record's CRC-32 is checked whoever
wrote the file, and a fuzz of random damage never yields a silent wrong consolidation, a traceback or
a modified input."""
import hashlib
import os
import random
import shutil
import stat
import subprocess
import sys

import pytest
import torch

import harness
import models
from ranks import on_gloo, run_multiprocess, xla_cpu_devices
from xla_fsdp.checkpoints import CheckpointError
from xla_fsdp.checkpoints.files import rank_path
from xla_fsdp.consolidate_sharded_ckpts import main as consolidate_cli
from xla_fsdp.resize import main as resize_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HERE = os.path.dirname(os.path.abspath(__file__))
INSPECT = ["-m", "xla_fsdp.inspect"]


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _digests(folder):
    return {f: _sha(os.path.join(folder, f)) for f in sorted(os.listdir(folder))
            if os.path.isfile(os.path.join(folder, f))}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """'ours': 2 ranks saved by save_sharded_checkpoint (per-parameter shards, nested units, AdamW);
    'plain': the same files written the torch_xla way (plain torch.save, no checksums of ours)."""
    root = tmp_path_factory.mktemp("safety")
    harness.copy_session_checkpoint("torch", 2, "zero3_nested_adamw", str(root / "ours"))
    for rank in range(2):
        ckpt = torch.load(root / f"ours_rank-{rank:08d}-of-00000002.pth", weights_only=True)
        ckpt["shard_metadata"].pop("checksums")
        torch.save(ckpt, root / f"plain_rank-{rank:08d}-of-00000002.pth")
    return root


def _copy(src, dst):
    for f in os.listdir(src):
        if "_rank-" in f:
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))


# ----------------------------------------------------------------------------- 1. outputs that are inputs
@pytest.mark.parametrize("spelling", ["same", "dot", "symlink", "hardlink"])
def test_no_tool_writes_over_its_inputs(ckpts, tmp_path, capsys, spelling):
    _copy(ckpts, tmp_path)
    rank0 = str(tmp_path / "ours_rank-00000000-of-00000002.pth")
    if spelling == "same":
        target = rank0
    elif spelling == "dot":
        target = str(tmp_path / "." / "ours_rank-00000000-of-00000002.pth")
    else:
        os.mkdir(tmp_path / "elsewhere")
        target = str(tmp_path / "elsewhere" / "out.pth")
        (os.symlink if spelling == "symlink" else os.link)(rank0, target)
    before = _digests(tmp_path)
    prefix = str(tmp_path / "ours")
    for extra in ([], ["--format", "safetensors"], ["--optimizer"], ["--format", "safetensors", "--optimizer"]):
        assert consolidate_cli(["--ckpt_prefix", prefix, "--save_path", target] + extra) == 2
        err = capsys.readouterr().err
        assert "is the input file" in err and "ours_rank-00000000-of-00000002.pth" in err, err
    from xla_fsdp import consolidate_sharded_model_checkpoints
    with pytest.raises(CheckpointError, match="is the input file"):
        consolidate_sharded_model_checkpoints(prefix, save_path=target)
    # resize into the input's prefix spelled otherwise: same world size (would rewrite the inputs) or not
    for ws in ("2", "3"):
        assert resize_cli(["--ckpt_prefix", prefix, "--world_size", ws, "--out_prefix",
                            str(tmp_path / "." / "ours")]) == 2
        assert "is the input's prefix" in capsys.readouterr().err
    assert _digests(tmp_path) == before
    assert not any(f.endswith(".tmp") for f in os.listdir(tmp_path))


# ----------------------------------------------------------------------------- 2. no code runs
class _RunsCode:
    """Unpickling this calls open(marker, 'w'): a file named like a rank file that runs code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.fast
def test_a_crafted_rank_file_runs_no_code(tmp_path, capsys, gloo):
    import xla_fsdp
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    marker = tmp_path / "code_ran"
    torch.save({"model": {"w": torch.zeros(2)}, "shard_metadata": _RunsCode(str(marker)), "optimizer": None},
               tmp_path / "evil_rank-00000000-of-00000001.pth")
    prefix = str(tmp_path / "evil")
    assert consolidate_cli(["--ckpt_prefix", prefix]) == 2
    assert consolidate_cli(["--ckpt_prefix", prefix, "--verify"]) == 2
    assert resize_cli(["--ckpt_prefix", prefix, "--world_size", "2", "--out_prefix", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("evil_rank-00000000-of-00000001.pth") == 3 and "Unsupported global" in err, err
    # one line each, and never torch's advice to retry with weights_only=False
    assert err.count("\n") == 3 and "weights_only=False" not in err and "nothing in it was run" in err, err
    proc = subprocess.run([sys.executable, *INSPECT, "--ckpt_prefix", prefix], capture_output=True, text=True)
    assert proc.returncode == 2 and "evil_rank-00000000-of-00000001.pth" in proc.stderr, proc.stderr
    with pytest.raises(CheckpointError, match="evil_rank-00000000-of-00000001.pth"):
        xla_fsdp.load_sharded_checkpoint(FSDP(models.MLP()), None, prefix)
    assert not marker.exists()


# ----------------------------------------------------------------------------- 3. CRC-32 of every record
def _flip_in_tensor(path, rng):
    """Flip one bit inside the bytes of the largest tensor of a rank file."""
    ckpt = torch.load(path, weights_only=True)
    biggest = max(ckpt["model"].values(), key=lambda t: t.numel())
    data = bytearray(open(path, "rb").read())
    at = bytes(data).find(biggest.contiguous().view(-1).view(torch.uint8).numpy().tobytes()[:32])
    assert at > 0
    data[at + rng.randrange(32)] ^= 1 << rng.randrange(8)
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("writer", ["ours", "plain"])
def test_flipped_bits_are_caught_in_files_of_any_writer(ckpts, tmp_path, capsys, writer, gloo):
    _copy(ckpts, tmp_path)
    bad = tmp_path / f"{writer}_rank-00000001-of-00000002.pth"
    _flip_in_tensor(bad, random.Random(0))
    before = _digests(tmp_path)
    prefix = str(tmp_path / writer)
    for argv in (["--verify"], [], ["--format", "safetensors"], ["--optimizer"]):
        assert consolidate_cli(["--ckpt_prefix", prefix] + argv) == 2
        err = capsys.readouterr().err
        assert bad.name in err and "CRC-32" in err, err
    assert resize_cli(["--ckpt_prefix", prefix, "--world_size", "3", "--out_prefix", str(tmp_path / "o")]) == 2
    assert bad.name in capsys.readouterr().err
    proc = subprocess.run([sys.executable, *INSPECT, "--ckpt_prefix", prefix], capture_output=True, text=True)
    assert proc.returncode == 2 and "CRC-32" in proc.stderr, proc.stderr
    assert _digests(tmp_path) == before


def test_load_checks_the_crc_of_a_plain_torch_save_file(tmp_path, gloo):
    """A file written with plain torch.save carries no checksums of ours: the zip's CRC-32 still
    catches a flipped bit before it reaches the model."""
    import xla_fsdp
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    torch.manual_seed(0)
    model = FSDP(models.MLP())
    path = tmp_path / "p_rank-00000000-of-00000001.pth"
    torch.save({"model": model.state_dict(), "shard_metadata": model.get_shard_metadata(), "optimizer": None}, path)
    _flip_in_tensor(path, random.Random(1))
    with pytest.raises(CheckpointError, match="p_rank-00000000-of-00000001.pth.*CRC-32"):
        xla_fsdp.load_sharded_checkpoint(FSDP(models.MLP()), None, str(tmp_path / "p"))


# ----------------------------------------------------------------------------- 11. modes, other files, names
def test_written_files_get_the_umask_mode_and_other_files_a_clear_error(ckpts, tmp_path, capsys):
    _copy(ckpts, tmp_path)
    old = os.umask(0o022)
    try:
        assert (
            consolidate_cli(["--ckpt_prefix", str(tmp_path / "ours"), "--save_path", str(tmp_path / "full.pth")]) == 0
        )
        assert resize_cli(["--ckpt_prefix", str(tmp_path / "ours"), "--world_size", "1",
                            "--out_prefix", str(tmp_path / "one")]) == 0
    finally:
        os.umask(old)
    capsys.readouterr()
    for name in ("full.pth", "one_rank-00000000-of-00000001.pth"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o644, name  # as torch.save would make it
    (tmp_path / "notes_rank-00000000-of-00000001.pth").write_text("not a checkpoint\n")
    assert consolidate_cli(["--ckpt_prefix", str(tmp_path / "notes")]) == 2
    err = capsys.readouterr().err
    assert "not a file written by torch.save (not a zip archive)" in err and "mmap" not in err, err


def test_errors_name_parameters_as_the_user_knows_them(ckpts, tmp_path, capsys):
    """A damaged tensor is named by its original parameter name, never by the internal attribute
    (_fsdp_shard_FSDP_SHARD_SEPARATOR_...)."""
    _copy(ckpts, tmp_path)
    path = tmp_path / "ours_rank-00000000-of-00000002.pth"
    ckpt = torch.load(path, weights_only=True)
    key = next(k for k in ckpt["model"] if "_FSDP_SHARD_SEPARATOR_" in k)
    ckpt["model"][key] = ckpt["model"][key] + 1  # rewritten whole: its CRC-32 is right, our checksum is not
    torch.save(ckpt, path)
    assert consolidate_cli(["--ckpt_prefix", str(tmp_path / "ours"), "--verify"]) == 2
    err = capsys.readouterr().err
    original = key.split("_FSDP_SHARD_SEPARATOR_")[-1]
    assert "_FSDP_SHARD_SEPARATOR_" not in err and f".{original}' is corrupted" in err, err


# ----------------------------------------------------------------------------- fuzz
DAMAGE = ["flip_tensor", "flip_anywhere", "zero_block", "truncate", "swap_ranks", "duplicate_rank"]


def _damage(folder, writer, kind, rng):
    files = [os.path.join(folder, f"{writer}_rank-{r:08d}-of-00000002.pth") for r in range(2)]
    victim = files[rng.randrange(2)]
    data = bytearray(open(victim, "rb").read())
    if kind == "flip_tensor":
        _flip_in_tensor(victim, rng)
    elif kind == "flip_anywhere":
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        open(victim, "wb").write(bytes(data))
    elif kind == "zero_block":
        at = rng.randrange(len(data) - 64)
        data[at:at + 64] = bytes(64)
        open(victim, "wb").write(bytes(data))
    elif kind == "truncate":
        open(victim, "wb").write(bytes(data[:rng.randrange(len(data))]))
    elif kind == "swap_ranks":
        os.rename(files[0], files[0] + ".x")
        os.rename(files[1], files[0])
        os.rename(files[0] + ".x", files[1])
    elif kind == "duplicate_rank":
        shutil.copy(files[0], files[1])


@pytest.mark.parametrize("writer", ["ours", "plain"])
def test_fuzz_random_damage_is_never_silent(ckpts, tmp_path, capsys, writer):
    """Random damage of a 2-rank checkpoint: consolidation either fails with one line naming a file
    (exit 2), or succeeds with output identical to the undamaged checkpoint's (the damage hit bytes
    nothing reads, e.g. a zip comment); `--verify` never passes damage that changes the output;
    inputs are never modified; no traceback escapes (the CLI's main would raise)."""
    clean = tmp_path / "clean"
    os.mkdir(clean)
    _copy(ckpts, clean)
    assert consolidate_cli(["--ckpt_prefix", str(clean / writer), "--save_path", str(tmp_path / "ref.pth")]) == 0
    reference = torch.load(tmp_path / "ref.pth", weights_only=True)["model"]
    rng = random.Random(f"fuzz-{writer}")
    outcomes = {}
    trials = 120
    for trial in range(trials):
        kind = DAMAGE[trial % len(DAMAGE)]
        work = tmp_path / f"t{trial}"
        os.mkdir(work)
        _copy(ckpts, work)
        _damage(work, writer, kind, rng)
        before = _digests(work)
        out = tmp_path / f"out{trial}.pth"
        verified = consolidate_cli(["--ckpt_prefix", str(work / writer), "--verify"])
        code = consolidate_cli(["--ckpt_prefix", str(work / writer), "--save_path", str(out)])
        err = capsys.readouterr().err
        assert code in (0, 2) and verified in (0, 2)
        if code == 2:
            assert err.startswith("error: ") and f"{writer}_rank-" in err, (kind, err)
            outcome = "refused"
        else:
            got = torch.load(out, weights_only=True)["model"]
            assert list(got) == list(reference) and all(torch.equal(got[k], reference[k]) for k in got), kind
            outcome = "identical output"
            os.unlink(out)
        assert verified == 2 or outcome == "identical output", (kind, err)
        assert _digests(work) == before, kind
        shutil.rmtree(work)
        outcomes[(kind, outcome)] = outcomes.get((kind, outcome), 0) + 1
    print(
        f"\nfuzz ({writer}, {trials} trials): "
        + ", ".join(f"{k} -> {o}: {n}" for (k, o), n in sorted(outcomes.items()))
    )
    assert sum(n for (k, o), n in outcomes.items() if o == "refused") >= trials // 2


# ----------------------------------------------------------------------------- 4. ranks agree on a failed load
def _save_then_load(rank, device, folder, damage_rank, damage="flip"):
    """Save a 2-rank checkpoint, damage it, load on every rank: what each saw. ``damage``: "flip" a
    byte of ``damage_rank``'s file; "swap" the two files' names; "other_save": ``damage_rank``'s file
    replaced by its file of a later save (each file sound on its own)."""
    import xla_fsdp
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    from xla_fsdp.checkpoints.sharded import values_over_ranks
    torch.manual_seed(0)
    model = FSDP(models.MLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prefix = os.path.join(folder, "ck")
    path = xla_fsdp.save_sharded_checkpoint(model, opt, prefix)
    if damage == "other_save":
        for p in model.parameters():
            p.data.mul_(0.5)
        later = xla_fsdp.save_sharded_checkpoint(model, opt, os.path.join(folder, "later"))
        if rank == damage_rank:
            shutil.copy(later, path)
    elif damage == "swap" and rank == 0:
        files = [rank_path(prefix, r, 2) for r in range(2)]
        os.replace(files[0], files[0] + ".x")
        os.replace(files[1], files[0])
        os.replace(files[0] + ".x", files[1])
    elif damage == "flip" and rank == damage_rank:
        _flip_in_tensor(path, random.Random(rank))
    elif damage == "missing" and rank == damage_rank:
        os.unlink(path)
    values_over_ranks(model, 0)  # every rank's damage done before any rank loads
    before = [p.detach().cpu().clone() for p in model.parameters()]
    for p in model.parameters():  # what a load would overwrite
        p.data.add_(1.0)
    try:
        xla_fsdp.load_sharded_checkpoint(model, opt, prefix)
        outcome = "loaded"
    except CheckpointError as e:
        outcome = f"CheckpointError: {e}"
    untouched = all(torch.equal(p.detach().cpu(), b + 1.0) for p, b in zip(model.parameters(), before))
    return outcome, untouched


def _gloo_load_worker(me, folder, damage_rank, damage):
    return _save_then_load(me.rank, me.device, folder, damage_rank, damage)


def _xla_load_worker(folder, damage_rank, damage):
    import torch_xla
    import torch_xla.runtime as xr
    return _save_then_load(xr.global_ordinal(), torch_xla.device(), folder, damage_rank, damage)


def _load_damaged(transport, tmp_path, damage):
    if transport == "torch":
        return on_gloo(_gloo_load_worker, 2, str(tmp_path), 1, damage, weights_only=False)
    with xla_cpu_devices(2):
        by_rank = run_multiprocess(_xla_load_worker, str(tmp_path), 1, damage)
    return [by_rank[r] for r in range(2)]


@pytest.mark.parametrize("transport", ["torch", "xla"])
def test_every_rank_raises_when_one_rank_file_is_damaged(transport, tmp_path):
    """Before: on gloo rank 1 raised while rank 0 went on with a loaded model; on 2 XLA:CPU devices
    the error never showed, only XLA's rendezvous abort. Later, rank 0 said only that rank 1 failed
    ("its error is in that rank's output": on a cluster, another host's log)."""
    (own, own_untouched), (peer, peer_untouched) = _load_damaged(transport, tmp_path, "flip")[::-1]
    assert "ck_rank-00000001-of-00000002.pth" in own and "CRC-32" in own, own
    assert peer.startswith("CheckpointError") and "rank 1" in peer and "ck_rank-00000001-of-00000002.pth" in peer, peer
    assert "CRC-32" in peer, peer  # rank 1's own reason, not "its error is in that rank's output"
    assert "no rank has loaded anything" in peer and own_untouched and peer_untouched


@pytest.mark.parametrize("transport", ["torch", "xla"])
@pytest.mark.parametrize("damage", ["swap", "other_save", "missing"])
def test_rank_files_that_are_sound_alone_but_not_this_ranks_are_refused(transport, damage, tmp_path):
    """Before: rank files swapped by name (or one file from a later save) loaded
    silently at the same world size, every tensor another rank's (or another step's); only the CLIs
    and a load at another world size compared the rank in the file with the one reading it. And a
    missing file of this world size was told to resize."""
    results = _load_damaged(transport, tmp_path, damage)
    for rank, (outcome, untouched) in enumerate(results):
        assert outcome.startswith("CheckpointError"), (rank, outcome)
        assert untouched, rank
        if damage == "swap":
            assert "holds the shards of rank" in outcome, outcome
            assert "renamed or copied over each other" in outcome, outcome
        elif damage == "missing":  # before: "resize with ... --world_size 2", which cannot bring it back
            assert "missing rank file" in outcome and "resize" not in outcome, outcome
            assert "The other 1 rank file(s) of this world size are there: restore this one" in outcome, outcome
        else:
            assert "come from different saves" in outcome and "no rank has loaded anything" in outcome, outcome


# ------------------------------------------------------------- 7. a prefix re-used at another world size
def test_a_save_replaces_an_older_checkpoint_of_another_world_size(ckpts, tmp_path, gloo, capsys):
    """An example re-run with another device count and the default prefix trained fully, then died
    with 'different world sizes' because the old rank files remained."""
    import xla_fsdp
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    _copy(ckpts, tmp_path)  # ours: 2 ranks
    prefix = str(tmp_path / "ours")
    torch.manual_seed(0)
    model = FSDP(models.MLP())
    with pytest.warns(UserWarning, match="replaced an older checkpoint.*ours_rank-00000001-of-00000002.pth"):
        xla_fsdp.save_sharded_checkpoint(model, None, prefix)
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("ours_rank")) == [
        "ours_rank-00000000-of-00000001.pth"
    ]
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("plain_")) == [  # other prefixes untouched
        "plain_rank-00000000-of-00000002.pth", "plain_rank-00000001-of-00000002.pth"]
    assert consolidate_cli(["--ckpt_prefix", prefix]) == 0
    full = torch.load(prefix + "_consolidated.pth", weights_only=True)["model"]
    torch.manual_seed(0)
    assert all(torch.equal(full[k], v) for k, v in models.MLP().state_dict().items())


def test_examples_refuse_num_devices_with_the_torch_transport():
    """--num_devices 2 --transport torch silently trained with world size 1."""
    root = os.path.dirname(HERE)
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "examples/train_resnet_fsdp_auto_wrap.py", "--transport", "torch",
                           "--num_devices", "2", "--num_steps", "1"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "torchrun --nproc_per_node 2" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "SUMMARY" not in proc.stdout


def test_an_interrupted_write_leaves_no_partial_file(tmp_path):
    """What Ctrl-C in an XLA:CPU device process does before exiting: unfinished writes are removed,
    the final name never holds a partial file."""
    from xla_fsdp.checkpoints.files import atomic_write, remove_unfinished_writes
    seen = []

    def write(tmp):
        open(tmp, "wb").write(b"half")
        seen.append(remove_unfinished_writes())  # the interrupt lands here
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(str(tmp_path / "ck.pth"), write)
    assert len(seen[0]) == 1 and seen[0][0].endswith(".tmp") and not list(tmp_path.iterdir())


# ------------------------------------------------------------- 8. saves in the background
def test_async_save_writes_the_state_at_the_save_while_training_goes_on(gloo, tmp_path):
    """blocking=False: the file holds the shards as they were at the call (the next step changes them
    while it is written) and equals a blocking save of that state byte for byte in every tensor; the
    next save waits for it; a failed background write raises at wait()."""
    import xla_fsdp
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    from xla_fsdp.checkpoints import CheckpointError
    torch.manual_seed(0)
    model = FSDP(models.MLP())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step():
        model(torch.randn(4, 12)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    step()
    xla_fsdp.save_sharded_checkpoint(model, opt, str(tmp_path / "blocking"))
    pending = xla_fsdp.save_sharded_checkpoint(model, opt, str(tmp_path / "async"), blocking=False)
    step()  # changes every shard and the optimizer state while the save may still be writing
    assert pending.wait() == str(tmp_path / "async_rank-00000000-of-00000001.pth")
    a = torch.load(tmp_path / "async_rank-00000000-of-00000001.pth", weights_only=True)
    b = torch.load(tmp_path / "blocking_rank-00000000-of-00000001.pth", weights_only=True)
    for k, v in b["model"].items():
        assert torch.equal(a["model"][k], v), k
    for i, st in b["optimizer"]["state"].items():
        assert all(torch.equal(a["optimizer"]["state"][i][f], v) for f, v in st.items())
    assert not torch.equal(a["model"][next(iter(a["model"]))], next(iter(model.state_dict().values())))

    first = xla_fsdp.save_sharded_checkpoint(model, opt, str(tmp_path / "one"), blocking=False)
    second = xla_fsdp.save_sharded_checkpoint(model, opt, str(tmp_path / "two"), blocking=False)
    assert first.done() and first.wait()  # the second save waited for the first
    second.wait()

    (tmp_path / "a_file").write_text("")  # a folder path through a file: the background write fails
    failing = xla_fsdp.save_sharded_checkpoint(model, opt, str(tmp_path / "a_file" / "x"), blocking=False)
    with pytest.raises(CheckpointError, match="could not write .*a_file/x_rank-00000000-of-00000001.pth"):
        failing.wait()


def test_a_load_by_name_writes_into_a_stepped_optimizer_in_place(gloo, tmp_path):
    """Resuming a run whose optimizer already has state (another wrapping, another lr): the shards
    and the optimizer's own state tensors are overwritten in place with the checkpoint's, and the
    saved hyperparameters come back; the next step is the saved run's next step."""
    import xla_fsdp
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    from xla_fsdp.checkpoints import full_optim_state_dict, full_state_dict

    def step(model, opt, seed):
        g = torch.Generator().manual_seed(seed)
        model(torch.randn(4, 12, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    torch.manual_seed(0)
    a = FSDP(models.MLP())
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    step(a, opt_a, 1)
    step(a, opt_a, 2)
    xla_fsdp.save_sharded_checkpoint(a, opt_a, str(tmp_path / "a"))
    torch.manual_seed(1)
    b = FSDP(models.MLP(), flatten_parameters=True)
    opt_b = torch.optim.AdamW(b.parameters(), lr=5e-3)
    step(b, opt_b, 3)
    held = [t for st in opt_b.state.values() for t in st.values()]
    xla_fsdp.load_sharded_checkpoint(b, opt_b, str(tmp_path / "a"))
    assert [t for st in opt_b.state.values() for t in st.values()] == held  # the same tensor objects
    assert opt_b.param_groups[0]["lr"] == 1e-2
    want, got = full_state_dict(a, rank0_only=False), full_state_dict(b, rank0_only=False)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    want_opt = full_optim_state_dict(a, opt_a, rank0_only=False)
    got_opt = full_optim_state_dict(b, opt_b, rank0_only=False)
    for name, st in want_opt["state"].items():
        assert all(torch.equal(got_opt["state"][name][f], v) for f, v in st.items()), name
    step(a, opt_a, 4)
    step(b, opt_b, 4)
    want, got = full_state_dict(a, rank0_only=False), full_state_dict(b, rank0_only=False)
    assert all((got[k] - v).abs().max().item() <= 1e-6 for k, v in want.items())


# ------------------------------------------------------------- 9. Ctrl-C while a rank file is written
_INTERRUPTED_SAVE = """
import os, signal, sys, torch, torch.nn as nn, torch.distributed as dist
from xla_fsdp import XlaFullyShardedDataParallel as FSDP
from xla_fsdp.checkpoints import resume_training, safe_file, save_training_checkpoint
writes, original = [0], safe_file.NoAbortFile.write
def write(self, data):  # Ctrl-C (SIGINT to this rank) on its Nth write into torch's zip writer
    writes[0] += 1
    if writes[0] == int(os.environ.get("INTERRUPT_AT", "0")):
        os.kill(os.getpid(), signal.SIGINT)
    return original(self, data)
safe_file.NoAbortFile.write = write
dist.init_process_group("gloo")
torch.manual_seed(0)
model = FSDP(nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]))
opt = torch.optim.AdamW(model.parameters())
try:
    resumed = resume_training(model, opt, sys.argv[1])
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    save_training_checkpoint(model, opt, sys.argv[1], (resumed.step if resumed else 0) + 1)
    print("saved", flush=True)
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr, flush=True)
    raise SystemExit(130)
finally:
    del model, opt
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("at", [2, 9])  # early in the file; in the optimizer's records
def test_ctrl_c_while_saving_stops_every_rank_cleanly(tmp_path, at):
    """Before: a KeyboardInterrupt landing inside torch's zip writer (in the write it
    calls) left it broken, and its destructor aborted each rank: "terminate called after throwing an
    instance of 'c10::Error' ... unexpected pos" and ~30 C++ frames. Now each rank's own handler sees
    one KeyboardInterrupt (here: "interrupted", exit 130), no temporary file is left, the checkpoint
    before is intact and the next run resumes from it."""
    script = tmp_path / "prog.py"
    script.write_text(_INTERRUPTED_SAVE)
    ckpt = tmp_path / "ckpt"

    def run(n, interrupt_at):
        env = dict(os.environ, INTERRUPT_AT=str(interrupt_at))
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               "--log-dir", str(tmp_path / f"logs{n}"), "--redirects", "3", str(script), str(ckpt)],
                              env=env, capture_output=True, text=True, timeout=300)
    first = run(1, 0)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run(2, at)
    logs = [open(path).read() for path in sorted(tmp_path.glob("logs2/**/stderr.log"))]
    assert len(logs) == 2 and second.returncode != 0
    for log in logs:
        assert "interrupted" in log and "terminate called" not in log and "c10::Error" not in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    assert "exitcode: 130" in second.stderr and "exitcode: -6" not in second.stderr, second.stderr[-3000:]
    assert not [f for f in os.listdir(ckpt) if f.endswith(".tmp")], os.listdir(ckpt)
    assert sorted(f for f in os.listdir(ckpt) if f.startswith("step-")) == [
        "step-000000001.complete", "step-000000001_rank-00000000-of-00000002.pth",
        "step-000000001_rank-00000001-of-00000002.pth"]
    third = run(3, 0)
    assert third.returncode == 0, third.stderr[-3000:]
    assert os.path.exists(ckpt / "step-000000002.complete")


# ------------------------------------------------------------- 10. messages that name the cause and the fix
@pytest.mark.fast
def test_messages_name_the_cause_and_the_fix(ckpts, tmp_path, capsys, monkeypatch):
    """Each before -> after: the free-space check of a consolidation with --optimizer
    counted the model only; an unwritable folder named our temporary file; a rank file's name or a
    folder given as the prefix found nothing, with no hint."""
    import errno

    from xla_fsdp.checkpoints import files
    _copy(ckpts, tmp_path)
    prefix = str(tmp_path / "ours")
    assert consolidate_cli(["--ckpt_prefix", prefix, "--optimizer", "--save_path", str(tmp_path / "a.pth")]) == 0
    size = os.path.getsize(tmp_path / "a.pth")
    capsys.readouterr()
    model_bytes = sum(t.numel() * t.element_size() for t in torch.load(tmp_path / "a.pth", weights_only=True)[
        "model"].values())
    monkeypatch.setattr(files, "free_bytes", lambda directory: 2 * model_bytes)  # room for the model only
    assert consolidate_cli(["--ckpt_prefix", prefix, "--optimizer", "--save_path", str(tmp_path / "b.pth")]) == 2
    err = capsys.readouterr().err
    needed = int(err.split("(")[1].split(" bytes")[0])
    assert "not enough space" in err and 2 * model_bytes < needed <= size, (err, model_bytes, size)
    monkeypatch.undo()

    real_open = os.open

    def read_only(path, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(os, "open", read_only)
    assert consolidate_cli(["--ckpt_prefix", prefix, "--save_path", str(tmp_path / "out.pth")]) == 2
    err = capsys.readouterr().err
    monkeypatch.undo()
    assert f"cannot write '{tmp_path / 'out.pth'}': cannot create files in '{tmp_path}' (Read-only file system)" \
        in err and ".tmp" not in err, err

    rank0 = prefix + "_rank-00000000-of-00000002.pth"
    for given, hint in [(rank0, f"is a rank file's name: did you mean --ckpt_prefix {prefix}?"),
                        (str(tmp_path), f"is a folder, and the prefix is the rank files' path up to '_rank-': did "
                                        f"you mean --ckpt_prefix {tmp_path / 'plain'} (or {prefix})?")]:
        assert consolidate_cli(["--ckpt_prefix", given]) == 2
        err = capsys.readouterr().err
        assert hint in err and err.count("\n") == 1, err


@pytest.mark.fast
def test_modules_that_cannot_be_sharded_are_named_with_the_fix(gloo):
    """Before: nn.Embedding(sparse=True) failed in backward with
    'reshape is not implemented for sparse tensors'; a complex64 parameter was told to 'register
    non-trainable integer tensors as buffers'."""
    import torch.nn as nn

    from xla_fsdp import XlaFullyShardedDataParallel as FSDP

    class Complex(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, dtype=torch.complex64))

        def forward(self, x):
            return x * self.w
    with pytest.raises(TypeError, match=r"parameter '1.weight' belongs to Embedding\(sparse=True\).*sparse=False"):
        FSDP(nn.Sequential(nn.Linear(2, 2), nn.Embedding(10, 4, sparse=True)))
    with pytest.raises(TypeError, match=r"parameter 'w' is torch.complex64; complex parameters cannot be sharded.*"
                                        r"view_as_real"):
        FSDP(Complex())
    with pytest.raises(TypeError, match=r"parameter .0.weight. belongs to Embedding\(max_norm=1.0\), which renorm"):
        FSDP(nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 2)))  # renorm edits the weight in forward
    frozen = nn.Embedding(10, 4, sparse=True).requires_grad_(False)  # no gradient: nothing sparse to reduce
    FSDP(nn.Sequential(frozen, nn.Linear(4, 2)))


_TERMINATED_RESIZE = """
import os, signal, sys
from xla_fsdp.checkpoints import rank_writer
from xla_fsdp.resize import main
real, calls = rank_writer.RankFileWriter.write, []
def write(self, metadata):  # the second rank file: half written when SIGTERM arrives
    calls.append(self.path)
    if len(calls) == 2:
        with open(self.tmp, "ab") as f:
            f.write(b"half")
        os.kill(os.getpid(), signal.SIGTERM)
    return real(self, metadata)
rank_writer.RankFileWriter.write = write
sys.exit(main(sys.argv[1:]))
"""


def test_resize_stopped_or_refused_leaves_no_temporary_file_and_says_why(ckpts, tmp_path):
    """Before: python -m xla_fsdp.resize killed by SIGTERM left *.tmp files a rerun
    did not clean, and a folder where a rank file goes, or a parent it cannot write, gave a raw
    [Errno 21] / [Errno 30]."""
    _copy(ckpts, tmp_path)
    before = _digests(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    argv = ["--ckpt_prefix", str(tmp_path / "ours"), "--world_size", "3", "--out_prefix", str(out / "r")]
    proc = subprocess.run([sys.executable, "-c", _TERMINATED_RESIZE, *argv], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: stopped by SIGTERM; removed 0 unfinished temporary file(s); files already finished are whole and "
        "the inputs are untouched: run the command again"], proc.stderr[-2000:]
    assert os.listdir(out) == [] and _digests(tmp_path) == before  # the set is all or nothing
    assert resize_cli(argv) == 0 and len(os.listdir(out)) == 3  # the rerun writes the set
    for f in os.listdir(out):
        os.remove(out / f)
    os.mkdir(rank_path(str(out / "r"), 1, 3))  # a folder where a rank file goes
    proc = subprocess.run([sys.executable, "-m", "xla_fsdp.resize", *argv], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"error: the output '{rank_path(str(out / 'r'), 1, 3)}' is a folder"), lines
    assert sorted(os.listdir(out)) == [os.path.basename(rank_path(str(out / "r"), 1, 3))]
