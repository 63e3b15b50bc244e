"""Preemption under torchrun (issue 26): one rank of the language-model example is SIGKILLed at a
random point of a random step (forward, backward, collectives or a checkpoint write), torchrun
(--max_restarts 1) starts the job again, --resume auto continues from the newest complete
checkpoint, and the job ends with the uninterrupted run's final and eval loss. TRIALS kill points;
every wait is bounded (a hang fails the test), and after each the checkpoint folder holds only
complete, readable checkpoints and no temporary files."""
import glob
import os
import random
import subprocess
import sys

import pytest

from xla_fsdp.checkpoints import ShardedCheckpoint

from test_lm_example import summary

HERE = os.path.dirname(os.path.abspath(__file__))
TRIALS = 10
STEPS, EVERY = 30, 5
TOL = 1e-6  # same world size, same data order: the same arithmetic


def torchrun(out_dir, env, restarts, timeout=180):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           f"--max_restarts={restarts}", "--monitor_interval=0.1", os.path.join(HERE, "preempted_lm.py"),
           "--num_steps", str(STEPS), "--ckpt_every", str(EVERY), "--out_dir", out_dir, "--resume", "auto"]
    log = out_dir + ".log"
    with open(log, "w") as f:
        job = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            code = job.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
            code = "hung"
    out = open(log).read()
    assert code == 0, f"exit {code} (log {log}):\n{out[-4000:]}"
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    folder = tmp_path_factory.mktemp("preempt")
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # README's setting
               HF_HOME=str(folder / "hf"), HF_DATASETS_OFFLINE="1",
               KILL_RANK="-1", KILL_STEP="0", KILL_DELAY="0", KILL_MARKER=str(folder / "unused"))
    env.pop("PJRT_DEVICE", None)
    return str(folder), env


def test_a_rank_killed_at_random_points_restarts_and_ends_with_the_same_loss(env):
    folder, base = env
    reference = summary(torchrun(os.path.join(folder, "reference"), base, restarts=0))
    rng = random.Random(26)
    outcomes = []
    for trial in range(TRIALS):
        out_dir = os.path.join(folder, f"trial{trial}")
        marker = os.path.join(folder, f"killed{trial}")
        # half the kills land right after a checkpointing step: inside its save, or just after it
        step = rng.choice(range(EVERY, STEPS, EVERY)) if trial % 2 else rng.randrange(1, STEPS)
        kill = dict(KILL_RANK=str(rng.randrange(2)), KILL_STEP=str(step), KILL_DELAY=f"{rng.uniform(0, 0.03):.4f}",
                    KILL_MARKER=marker)
        out = torchrun(out_dir, dict(base, **kill), restarts=1)
        assert os.path.exists(marker), f"trial {trial}: the rank was not killed ({kill})"
        result = summary(out)
        outcomes.append((open(marker).read().strip(), result["start_step"]))
        assert result["end_step"] == str(STEPS), (trial, kill)
        assert abs(float(result["final_loss"]) - float(reference["final_loss"])) <= TOL, (trial, kill, result)
        assert abs(float(result["eval_loss"]) - float(reference["eval_loss"])) <= TOL, (trial, kill, result)
        ckpt = os.path.join(out_dir, "ckpt")
        names = sorted(os.listdir(ckpt))
        assert not [n for n in names if n.endswith(".tmp")], (trial, names)
        assert names == [f"step-{s:09d}{tail}" for s in (STEPS - EVERY, STEPS) for tail in
                         [".complete", "_rank-00000000-of-00000002.pth", "_rank-00000001-of-00000002.pth"]]
        ShardedCheckpoint(os.path.join(ckpt, f"step-{STEPS:09d}")).verify()  # every CRC-32 and checksum
    print("\n".join(f"{k}: resumed at step {s}" for k, s in outcomes))
    assert len({s for _, s in outcomes}) > 2  # the kills landed at different points
    assert glob.glob(os.path.join(folder, "trial*", "ckpt", "step-*.complete"))


def _model_and_optimizer(seed=0):
    import torch
    import torch.nn as nn

    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    torch.manual_seed(seed)
    model = FSDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), transport="torch")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)


def _train(model, optimizer, schedule, steps):
    import torch
    for _ in range(steps):
        model(torch.randn(3, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()


def test_resume_picks_the_newest_marked_checkpoint_and_restores_everything(gloo, tmp_path, monkeypatch):
    import torch

    import xla_fsdp
    ckpt = str(tmp_path / "ckpt")
    model, optimizer, schedule = _model_and_optimizer()
    assert xla_fsdp.resume_training(model, optimizer, ckpt, lr_scheduler=schedule) is None  # nothing yet
    for step in (1, 2, 3):
        _train(model, optimizer, schedule, 1)
        xla_fsdp.save_training_checkpoint(model, optimizer, ckpt, step, lr_scheduler=schedule,
                                          data_state={"seen": step * 3}, extra={"note": "x"}, keep=2)
    expected_params = [p.detach().clone() for p in model.parameters()]
    expected_draw = torch.rand(3)  # the RNG continues from the saved state
    names = sorted(os.listdir(ckpt))
    assert names == ["step-000000002.complete", "step-000000002_rank-00000000-of-00000001.pth",
                     "step-000000003.complete", "step-000000003_rank-00000000-of-00000001.pth"]  # keep=2
    # a later checkpoint whose marker was never written (killed while saving) is never picked
    open(os.path.join(ckpt, "step-000000004_rank-00000000-of-00000001.pth"), "wb").write(b"half written")
    open(os.path.join(ckpt, "step-000000004_rank-00000000-of-00000001.pth.1a2b3c4d.tmp"), "wb").write(b"x")
    open(os.path.join(ckpt, "step-000000003.complete.5e6f7a8b.tmp"), "w").write("{")  # a killed marker write
    assert xla_fsdp.latest_checkpoint(ckpt).step == 3
    fresh, fresh_opt, fresh_schedule = _model_and_optimizer(seed=1)
    torch.manual_seed(123)
    resumed = xla_fsdp.resume_training(fresh, fresh_opt, ckpt, lr_scheduler=fresh_schedule)
    assert (resumed.step, resumed.data_state, resumed.extra, resumed.saved_world_size) == (3, {"seen": 9},
                                                                                          {"note": "x"}, 1)
    assert torch.equal(torch.rand(3), expected_draw)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), expected_params))
    assert fresh_schedule.last_epoch == 3 and fresh_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert fresh_opt.state_dict()["state"][0]["step"] == 3
    # the next save removes the unmarked leftovers it is newer than, and killed writers' temp files
    xla_fsdp.save_training_checkpoint(fresh, fresh_opt, ckpt, 5, lr_scheduler=fresh_schedule, keep=2)
    assert sorted(os.listdir(ckpt)) == ["step-000000003.complete", "step-000000003_rank-00000000-of-00000001.pth",
                                        "step-000000005.complete", "step-000000005_rank-00000000-of-00000001.pth"]
    # torchrun restarts sharing its store: warned, with the fix
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.warns(UserWarning, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        xla_fsdp.resume_training(fresh, fresh_opt, ckpt, lr_scheduler=fresh_schedule)


def test_a_checkpoint_without_training_state_is_a_clear_error(gloo, tmp_path):
    import xla_fsdp
    from xla_fsdp.checkpoints import CheckpointError
    ckpt = str(tmp_path / "ckpt")
    model, optimizer, schedule = _model_and_optimizer()
    xla_fsdp.save_training_checkpoint(model, optimizer, ckpt, 1)
    with pytest.raises(CheckpointError, match="no LR scheduler state"):
        xla_fsdp.resume_training(model, optimizer, ckpt, lr_scheduler=schedule)
    open(os.path.join(ckpt, "step-000000002.complete"), "w").write("not json")
    with pytest.raises(CheckpointError, match="not a checkpoint marker"):
        xla_fsdp.latest_checkpoint(ckpt)
