"""An FSDP2 client unchanged: torchtitan 0.3.0's own training loop (Llama 3 debug model, 2 gloo
ranks, a generated tokenizer and dataset) with ``torch.distributed.fsdp.fully_shard`` bound to xla_fsdp's
trains as with PyTorch's FSDP2, and resumes through torchtitan's checkpointer from a checkpoint it wrote.
torchtitan accepts PyTorch >= 2.11, so this runs in the newest environment (make test installs it there)."""
import os
import re
import subprocess
import sys

import pytest

from ranks import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 4


def _train(tmp_path, name: str, *extra: str, xla_fsdp: bool = True) -> str:
    assets = tmp_path / "assets"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
               "--max_restarts=0", os.path.join(HERE, "torchtitan_run.py"), *(["--xla_fsdp"] if xla_fsdp else []),
               "--module", "llama3", "--config", "llama3_debugmodel", "--hf_assets_path", str(assets / "tokenizer"),
               "--dataloader.dataset_path", str(assets / "data"), "--training.seq_len", "64",
               "--training.local_batch_size", "2", "--training.steps", str(STEPS), "--debug.seed", "0",
               "--dump_folder", str(tmp_path / name), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    env.pop("PJRT_DEVICE", None)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)


def _steps(log: str) -> dict:
    """Step -> (loss, grad norm) as torchtitan logs them (every rank logs the same; the first kept)."""
    found: dict = {}
    for step, loss, norm in re.findall(r"step:\s*(\d+)\s+loss:\s*([\d.]+)\s+grad_norm:\s*([\d.]+)", log):
        found.setdefault(int(step), (loss, norm))
    return found


def test_torchtitan_trains_and_resumes_on_xla_fsdps_fully_shard_as_on_fsdp2(tmp_path):
    pytest.importorskip("torchtitan", reason="make test-newest installs torchtitan (Makefile, NEWEST_CLIENTS)")
    subprocess.run([sys.executable, os.path.join(HERE, "torchtitan_run.py"), "assets", str(tmp_path / "assets")],
                   check=True)
    fsdp2 = _steps(_train(tmp_path, "fsdp2", xla_fsdp=False))
    ours_log = _train(tmp_path, "ours", "--checkpoint.enable", "--checkpoint.interval", "2")
    assert "xla_fsdp.fully_shard sharded 9 modules" in ours_log  # 6 blocks, embeddings, [norm, lm_head], root
    assert sorted(fsdp2) == list(range(1, STEPS + 1))
    assert _steps(ours_log) == fsdp2  # the logged figures, digit for digit
    resumed = tmp_path / "resumed" / "checkpoint"
    resumed.mkdir(parents=True)
    os.rename(tmp_path / "ours" / "checkpoint" / "step-2", resumed / "step-2")
    resumed_log = _train(tmp_path, "resumed", "--checkpoint.enable", "--checkpoint.interval", "2")
    assert "Loading the checkpoint from" in resumed_log and "step-2" in resumed_log
    assert _steps(resumed_log) == {s: fsdp2[s] for s in range(3, STEPS + 1)}
