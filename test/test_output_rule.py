"""One rule for what every tool writes, the CLIs and the API alike: the output's
folders are created; an earlier output of the same kind is replaced (once the new one is complete);
anything else at the output path is refused, left as it is, unless --overwrite; inputs are never
written over. Nothing is created before every argument is checked."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import harness


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return harness.small_checkpoint(tmp_path_factory.mktemp("output_rule"), _model)


# tool -> (arguments, the output path where an unrelated file or folder is planted)
TOOLS = {
    "consolidate_pth": (["xla_fsdp.consolidate_sharded_ckpts", "--ckpt_prefix", "{in}/ck", "--save_path",
                         "{out}/full.pth"], "full.pth"),
    "consolidate_safetensors": (["xla_fsdp.consolidate_sharded_ckpts", "--ckpt_prefix", "{in}/ck", "--format",
                                 "safetensors", "--optimizer", "--save_path", "{out}/full.safetensors"],
                                "full.safetensors.optimizer.pth"),
    "consolidate_hf_folder": (["xla_fsdp.consolidate_sharded_ckpts", "--ckpt_prefix", "{in}/ck", "--format",
                               "safetensors", "--save_path", "{out}/hf/", "--max_shard_size", "4KB"],
                              "hf/model.safetensors.index.json"),
    "resize": (["xla_fsdp.resize", "--ckpt_prefix", "{in}/ck", "--world_size", "2", "--out_prefix", "{out}/ws2"],
                "ws2_rank-00000001-of-00000002.pth"),
    "convert_to_dcp": (["xla_fsdp.convert", "--to", "dcp", "--ckpt_prefix", "{in}/ck", "--out", "{out}/dcp"],
                       "dcp/notes.txt"),
    "convert_from_dcp": (["xla_fsdp.convert", "--from", "dcp", "--ckpt_dir", "{in}/dcp", "--world_size", "2",
                          "--out_prefix", "{out}/back"], "back_rank-00000000-of-00000002.pth"),
}


def _run(args, ckpt, out, *extra):
    argv = [a.replace("{in}", str(ckpt)).replace("{out}", str(out)) for a in args] + list(extra)
    return subprocess.run([sys.executable, "-m"] + argv, capture_output=True, text=True)


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_tool_follows_the_one_overwrite_rule(ckpt, tmp_path, tool):
    """Before: consolidate to .pth overwrote any file silently, safetensors refused with '[Errno 17]
    File exists', convert refused every existing folder, and output folders that did not exist were
    refused by the CLIs although the API created them."""
    args, planted = TOOLS[tool]
    out = tmp_path / "new" / "folders"  # does not exist: created
    first = _run(args, ckpt, out)
    assert first.returncode == 0 and not first.stderr, first.stderr
    written = sorted(os.listdir(out))
    again = _run(args, ckpt, out)  # an earlier output of the same kind: replaced
    assert again.returncode == 0 and sorted(os.listdir(out)) == written, again.stderr

    other = tmp_path / "other"
    target = other / planted
    target.parent.mkdir(parents=True)
    target.write_text("the user's own file")
    before = sorted(str(p.relative_to(other)) for p in other.rglob("*"))
    refused = _run(args, ckpt, other)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert lines[0].startswith("error: the output '") and "exists and is not a" in lines[0] and \
        "it is left as it is; choose another output, or pass --overwrite" in lines[0], lines[0]
    assert target.read_text() == "the user's own file"
    assert sorted(str(p.relative_to(other)) for p in other.rglob("*")) == before  # nothing else was written
    forced = _run(args, ckpt, other, "--overwrite")
    assert forced.returncode == 0, forced.stderr
    assert not target.exists() or target.read_text(errors="replace") != "the user's own file"


def test_outputs_that_cannot_be_written_are_refused_before_anything_is_created(ckpt, tmp_path):
    """Before: a folder given as a .pth path got an error naming an internal temp file
    ('ckpt.a2dfd17a.tmp'); an invalid --max_shard_size left an empty output folder."""
    folder = tmp_path / "a_folder"
    folder.mkdir()
    done = _run(TOOLS["consolidate_pth"][0][:3] + ["--save_path", str(folder)], ckpt, tmp_path)
    assert done.returncode == 2 and done.stderr.strip() == (
        f"error: the output '{folder}' is a folder: give a file name (a Hugging Face model folder is --format "
        "safetensors)"), done.stderr
    done = _run(TOOLS["consolidate_hf_folder"][0][:-1] + ["two gigs"], ckpt, tmp_path)
    assert done.returncode == 2 and "cannot read the size 'two gigs'" in done.stderr, done.stderr
    assert sorted(os.listdir(tmp_path)) == ["a_folder"]  # no hf/ folder
    assert os.listdir(folder) == []


@pytest.mark.fast
def test_the_api_follows_the_same_rule(ckpt, tmp_path):
    from xla_fsdp.checkpoints import CheckpointError, write_consolidated
    from xla_fsdp.checkpoints import ShardedCheckpoint
    from xla_fsdp.checkpoints.resizing import resize_checkpoint
    path = tmp_path / "deep" / "full.pth"
    write_consolidated(ShardedCheckpoint(str(ckpt / "ck")), str(path))  # folders created, as the CLI does
    write_consolidated(ShardedCheckpoint(str(ckpt / "ck")), str(path))  # its own earlier output: replaced
    (tmp_path / "notes.pth").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not a torch.save file"):
        write_consolidated(ShardedCheckpoint(str(ckpt / "ck")), str(tmp_path / "notes.pth"))
    (tmp_path / "notes_rank-00000000-of-00000001.pth").write_text("mine too")
    with pytest.raises(CheckpointError, match="exists and is not a torch.save file"):
        resize_checkpoint(str(ckpt / "ck"), 1, str(tmp_path / "notes"))
    resize_checkpoint(str(ckpt / "ck"), 1, str(tmp_path / "notes"), overwrite=True)
    assert (tmp_path / "notes.pth").read_text() == "mine"
