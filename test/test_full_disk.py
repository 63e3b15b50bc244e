"""A disk that fills up: every tool and every training save ends in one clear error
naming the folder and the bytes, leaves nothing partial and the previous checkpoint intact, and never
aborts the process. A full disk is simulated with the file size limit (RLIMIT_FSIZE, SIGXFSZ ignored:
writes past it fail with EFBIG, as they fail with ENOSPC on a full disk) and, for the check made before
writing, with a smaller free-space figure."""
import os
import resource
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import harness
from ranks import on_gloo

LIMIT = 24 * 1024  # bytes: every output below is larger (the inputs are read, not written)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))  # 16576 parameters, 66304 bytes


def _limited():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))


def _listing(folder):
    return {os.path.relpath(os.path.join(d, f), folder): os.path.getsize(os.path.join(d, f))
            for d, _, files in os.walk(folder) for f in files}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return harness.small_checkpoint(tmp_path_factory.mktemp("full_disk"), _model)


TOOLS = {
    "consolidate_pth": ["xla_fsdp.consolidate_sharded_ckpts", "--ckpt_prefix", "{in}/ck", "--save_path",
                        "{out}/full.pth"],
    "consolidate_safetensors": ["xla_fsdp.consolidate_sharded_ckpts", "--ckpt_prefix", "{in}/ck", "--format",
                                "safetensors", "--save_path", "{out}/full.safetensors", "--optimizer"],
    "consolidate_hf_folder": ["xla_fsdp.consolidate_sharded_ckpts", "--ckpt_prefix", "{in}/ck", "--format",
                              "safetensors", "--save_path", "{out}/hf/", "--max_shard_size", "40KB"],
    "resize": ["xla_fsdp.resize", "--ckpt_prefix", "{in}/ck", "--world_size", "2", "--out_prefix", "{out}/ws2"],
    "convert_to_dcp": ["xla_fsdp.convert", "--to", "dcp", "--ckpt_prefix", "{in}/ck", "--out", "{out}/dcp"],
    "convert_from_dcp": ["xla_fsdp.convert", "--from", "dcp", "--ckpt_dir", "{in}/dcp", "--world_size", "2",
                         "--out_prefix", "{out}/back"],
}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_a_tool_that_runs_out_of_room_says_so_in_one_line_and_leaves_nothing(ckpt, tmp_path, tool):
    """Before: consolidate aborted (exit 134, "unexpected pos", a 61-line traceback), resize aborted
    leaving a rank file, convert printed a 54-line traceback. Later, convert --to dcp's failure was
    still DCP's traceback when the limit was reached inside DCP's writer."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "earlier.pth").write_bytes(b"an earlier file")  # what a folder already holds stays as it was
    if tool == "resize":  # an earlier output at the same prefix (files of its kind: replaceable) stays whole
        for r in range(2):
            torch.save({"earlier set": torch.tensor([r])}, out / f"ws2_rank-{r:08d}-of-00000002.pth")
    before = _listing(out)
    args = [a.replace("{in}", str(ckpt)).replace("{out}", str(out)) for a in TOOLS[tool]]
    done = subprocess.run([sys.executable, "-m"] + args, capture_output=True, text=True, preexec_fn=_limited)
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in done.stderr, done.stderr[-3000:]
    # the limit and its fix, not the disk's free space (it once said "free space there")
    assert "the file size limit (ulimit -f) is reached: at most" in lines[0], lines[0]
    assert str(out) in lines[0] and "raise the limit (ulimit -f unlimited)" in lines[0], lines[0]
    assert "free space" not in lines[0] and "free in" not in lines[0], lines[0]
    assert _listing(out) == before, (_listing(out), before)  # no partial file, no temporary file, nothing replaced


def test_the_tools_check_the_free_space_before_writing(ckpt, tmp_path, monkeypatch, capsys):
    """Where the size is known, a folder without room for it is refused before a byte is written."""
    from xla_fsdp.checkpoints import files
    from xla_fsdp.consolidate_sharded_ckpts import main as consolidate_cli
    monkeypatch.setattr(files, "free_bytes", lambda directory: 1000)
    assert consolidate_cli(["--ckpt_prefix", str(ckpt / "ck"), "--save_path", str(tmp_path / "full.pth")]) == 2
    err = capsys.readouterr().err
    assert f"not enough space in '{tmp_path}'" in err, err
    assert "it needs 64.8 KiB (66304 bytes), 1000 bytes are free" in err, err  # 16576 fp32 parameters
    assert not list(tmp_path.iterdir())


def _step(model, opt):
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _full_disk_worker(me, folder):
    """Two ranks; rank 1 runs out of room in each kind of save; rank 0 is told there is no room in
    the check before writing. What each rank saw, and whether the previous checkpoints stayed."""
    import xla_fsdp
    from xla_fsdp.checkpoints import CheckpointError, files, latest_checkpoint, save_training_checkpoint
    rank = me.rank
    seen = {}
    model = xla_fsdp.XlaFullyShardedDataParallel(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt)
    prefix = os.path.join(folder, "ck")
    xla_fsdp.save_sharded_checkpoint(model, opt, prefix)  # the previous checkpoint at this prefix
    save_training_checkpoint(model, opt, os.path.join(folder, "run"), 1)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, opt)
    if rank == 1:
        _limited()
    for kind in ("blocking", "async", "training"):
        try:
            if kind == "blocking":
                xla_fsdp.save_sharded_checkpoint(model, opt, prefix)
            elif kind == "async":
                pending = xla_fsdp.save_sharded_checkpoint(model, opt, prefix, blocking=False)
                _step(model, opt)  # training goes on meanwhile
                pending.wait()
            else:
                save_training_checkpoint(model, opt, os.path.join(folder, "run"), 2)
            seen[kind] = "saved"
        except CheckpointError as e:
            seen[kind] = str(e)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    free_bytes = files.free_bytes
    if rank == 0:
        files.free_bytes = lambda directory: 1000
    try:
        xla_fsdp.save_sharded_checkpoint(model, opt, prefix)
        seen["checked"] = "saved"
    except CheckpointError as e:
        seen["checked"] = str(e)
    files.free_bytes = free_bytes
    _step(model, opt)  # training was never stopped
    seen["latest_step"] = latest_checkpoint(os.path.join(folder, "run")).step
    xla_fsdp.load_sharded_checkpoint(model, opt, prefix)
    seen["previous_intact"] = all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    return seen


def test_training_saves_on_a_full_disk_fail_on_every_rank_and_keep_the_previous_checkpoint(tmp_path):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    zero, one = on_gloo(_full_disk_worker, 2, str(folder))
    for kind in ("blocking", "async", "training"):
        own, peer = one[kind], zero[kind]
        assert own.startswith("the save to ") and "failed on this rank: cannot write '" in own, own
        assert "_rank-00000001-of-00000002.pth" in own, own
        assert "the file size limit (ulimit -f) is reached: at most " in own and "ulimit -f unlimited" in own, own
        assert "failed on rank 1: cannot write" in peer and own.split("failed on this rank: ")[1] == \
            peer.split("failed on rank 1: ")[1], (own, peer)
        assert "no rank's file was replaced" in peer
    checked_own, checked_peer = zero["checked"], one["checked"]
    assert f"failed on this rank: not enough space in '{folder}'" in checked_own, checked_own
    assert f"failed on rank 0: not enough space in '{folder}'" in checked_peer and "1000 bytes are free" in checked_peer
    for seen in (zero, one):
        assert seen["previous_intact"] and seen["latest_step"] == 1
    leftovers = [f for f in _listing(folder) if f.endswith(".tmp") or "step-000000002" in f]
    assert not leftovers, leftovers


@pytest.mark.fast
def test_files_written_together_appear_together_or_not_at_all(tmp_path):
    """The second file of a set fails: the first, already written, never takes its name."""
    from xla_fsdp.checkpoints.files import FileSet
    (tmp_path / "a.pth").write_bytes(b"earlier a")

    def fail(tmp):
        raise OSError(28, "No space left on device")
    with pytest.raises(Exception, match="the disk is full"):
        with FileSet() as files:
            files.torch_save({"x": torch.ones(3)}, str(tmp_path / "a.pth"))
            files.write(str(tmp_path / "b.pth"), fail)
    assert _listing(tmp_path) == {"a.pth": 9}
    with FileSet() as files:
        files.torch_save({"x": torch.ones(3)}, str(tmp_path / "a.pth"))
        files.torch_save({"y": torch.ones(3)}, str(tmp_path / "b.pth"))
    assert sorted(_listing(tmp_path)) == ["a.pth", "b.pth"]
    assert torch.equal(torch.load(tmp_path / "b.pth", weights_only=True)["y"], torch.ones(3))
