"""The language-model example past one machine, run with README's own commands: two
torchrun agents of 2 gloo ranks each (a c10d rendezvous on this machine's loopback) train, save
every 20 steps and finish; the consolidated model, scored in one process without FSDP, gives the
run's eval loss; a job that lost its last checkpoint resumes from the one before, at the same and
at another world size, and ends with the uninterrupted run's loss. The XLA:CPU transport
(torch_xla.launch) stops, resumes at another device count with host offload, and matches the gloo run."""
import os
import re
import shlex
import subprocess
import sys

import pytest

from ranks import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5


def readme_lines():
    """The shell lines of README's language-model block, in order."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## Training a language model"):]
    block = section[section.index("```bash") + len("```bash"):]
    block = block[:block.index("```")]
    return [line.strip() for line in block.strip().splitlines() if line.strip()]


def summary(text):
    """The last SUMMARY line's key=value pairs."""
    lines = [line for line in text.splitlines() if line.startswith("SUMMARY")]
    assert lines, f"no SUMMARY line in:\n{text[-3000:]}"
    return dict(item.split("=", 1) for item in lines[-1].split()[1:])


def command(line, port):
    """(argv, environment variables) of a README line."""
    args = shlex.split(line.split("#")[0].replace("127.0.0.1:$port", f"127.0.0.1:{port}"))
    args = [a for a in args if a != "&"]
    env = {}
    while "=" in args[0]:
        name, value = args.pop(0).split("=", 1)
        env[name] = value
    if args[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *args[1:]], env
    assert args[0] == "python", line
    return [sys.executable, *args[1:]], env


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder laid out like a checkout (examples/ linked), with HF caches kept inside it."""
    folder = tmp_path_factory.mktemp("lm")
    os.symlink(os.path.join(ROOT, "examples"), folder / "examples")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HOME=str(folder / "hf"), HF_DATASETS_OFFLINE="1",
               PYTHONPATH=ROOT)
    env.pop("PJRT_DEVICE", None)
    env.pop("CPU_NUM_DEVICES", None)
    return str(folder), env


def run(cmd, cwd, env, timeout=300, extra_env=None):
    done = subprocess.run(cmd, cwd=cwd, env=dict(env, **(extra_env or {})), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def two_nodes(lines, cwd, env):
    """The README's two torchrun lines, one per simulated node, at once; their joint output."""
    port = free_port()
    commands = [command(line, port) for line in lines]
    nodes = [subprocess.Popen(argv, cwd=cwd, env=dict(env, **extra), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for argv, extra in commands]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=300)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.communicate()
    assert all(n.returncode == 0 for n in nodes), "\n---\n".join(o[-3000:] for o in outputs)
    return "\n".join(outputs)


def unmark(ckpt_dir, step):
    """As if the job died after writing step's files but before marking them complete."""
    os.unlink(os.path.join(ckpt_dir, f"step-{step:09d}.complete"))


@pytest.fixture(scope="module")
def uninterrupted(workdir):
    cwd, env = workdir
    lines = readme_lines()
    torchruns = [line for line in lines if " torchrun " in f" {line}"]
    assert len(torchruns) == 2 and torchruns[0].rstrip(" &") == torchruns[1] and "--resume auto" in torchruns[1]
    return summary(two_nodes(torchruns, cwd, env))


def test_readme_block_is_two_nodes_then_consolidate_and_score():
    lines = readme_lines()
    assert [line.split()[0] for line in lines] == [
        "port=$(python", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "wait",
        "python", "python"]
    assert "--nnodes 2 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:$port" in lines[1]
    # the first line picks a free port (a port written in, 29400, is busy if another job has it)
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")  # the venv's python, as activated
    picked = subprocess.run(["bash", "-c", lines[0] + "\necho $port"], capture_output=True, text=True, check=True,
                            env=dict(os.environ, PATH=path))
    assert 0 < int(picked.stdout.split()[-1]) < 65536, picked


def test_two_nodes_train_save_and_the_consolidated_model_scores_the_same(workdir, uninterrupted):
    cwd, env = workdir
    assert uninterrupted["world_size"] == "4" and uninterrupted["start_step"] == "0"
    assert uninterrupted["end_step"] == "60" and float(uninterrupted["final_loss"]) < 3.0  # it learned (5.5 at init)
    ckpt = os.path.join(cwd, "runs", "lm", "ckpt")
    names = sorted(os.listdir(ckpt))
    assert names == [f"step-{s:09d}{tail}" for s in (40, 60) for tail in
                     [".complete"] + [f"_rank-{r:08d}-of-00000004.pth" for r in range(4)]]  # keeps 2
    consolidate, score = readme_lines()[4:]
    run(command(consolidate, 0)[0], cwd, env)
    scored = summary(run(command(score, 0)[0], cwd, env))
    assert abs(float(scored["eval_loss"]) - float(uninterrupted["eval_loss"])) <= TOL
    assert scored["params"] == uninterrupted["params"]
    # a rank file given instead (it once listed the shards' internal names as "missing")
    rank_file = os.path.join(ckpt, "step-000000060_rank-00000000-of-00000004.pth")
    argv = command(score, 0)[0][:-1] + [rank_file]
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: '{rank_file}' is one rank's file of a sharded checkpoint, not a consolidated one; consolidate it "
        f"first: python -m xla_fsdp.consolidate_sharded_ckpts --ckpt_prefix {ckpt}/step-000000060 --save_path "
        "model.pth, then --eval_consolidated model.pth"), done.stderr[-3000:]


def test_a_job_that_lost_its_last_checkpoint_resumes_to_the_same_loss(workdir, uninterrupted):
    cwd, env = workdir
    ckpt = os.path.join(cwd, "runs", "lm", "ckpt")
    torchruns = [line for line in readme_lines() if " torchrun " in f" {line}"]
    unmark(ckpt, 60)  # step 60's files stay, unmarked: never picked
    resumed = summary(two_nodes(torchruns, cwd, env))
    assert resumed["start_step"] == "40" and resumed["world_size"] == "4"
    assert abs(float(resumed["final_loss"]) - float(uninterrupted["final_loss"])) <= TOL
    assert abs(float(resumed["eval_loss"]) - float(uninterrupted["eval_loss"])) <= TOL
    # ... and at another world size: one node of 2 ranks continues the 4-rank checkpoint
    unmark(ckpt, 60)
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "examples/train_lm_fsdp.py", "--resume", "auto"], cwd, env)
    assert "saved at world size 4, now 2" in out
    two = summary(out)
    assert two["start_step"] == "40" and two["world_size"] == "2"
    assert abs(float(two["final_loss"]) - float(uninterrupted["final_loss"])) <= TOL
    assert abs(float(two["eval_loss"]) - float(uninterrupted["eval_loss"])) <= TOL
    assert sorted(os.listdir(ckpt))[-1] == "step-000000060_rank-00000001-of-00000002.pth"  # the 4-rank set replaced


@pytest.mark.xla
def test_xla_devices_stop_and_resume_at_another_device_count_with_host_offload(workdir):
    cwd, env = workdir
    out_dir = os.path.join(cwd, "xla")
    common = ["examples/train_lm_fsdp.py", "--num_steps", "20", "--ckpt_every", "10", "--out_dir", out_dir]
    gloo = summary(run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        *common[:-1], out_dir + "-gloo"], cwd, env))
    first = summary(run([sys.executable, *common, "--stop_after_step", "13"], cwd, env, timeout=400))
    assert first["end_step"] == "13" and first["world_size"] == "2"
    # resumed at 4 devices, with host offload this time (the checkpoint does not depend on where shards live)
    out = run([sys.executable, *common, "--resume", "auto", "--num_devices", "4", "--cpu_offload"], cwd, env,
              timeout=400)
    assert re.search(r"resumed from .*step-000000010 \(step 10, saved at world size 2, now 4\)", out)
    xla = summary(out)
    assert xla["start_step"] == "10" and xla["world_size"] == "4" and xla["cpu_offload"] == "True"
    assert abs(float(xla["final_loss"]) - float(gloo["final_loss"])) <= TOL
    assert abs(float(xla["eval_loss"]) - float(gloo["eval_loss"])) <= TOL


def _as_shown(text):
    """What a terminal shows of ``text``: each line with its carriage returns applied."""
    shown = []
    for line in text.split("\n"):
        screen = ""
        for part in line.split("\r"):
            screen = part + screen[len(part):]
        shown.append(screen.rstrip())
    return shown


def test_the_example_says_what_it_did_instead_of_nan(workdir):
    """Before: a run stopped by --stop_after_step printed eval_loss=nan, a run resumed
    at its --num_steps printed final_loss=nan tokens/s=nan, and the 'step N: loss' lines were written
    through the progress bar (on a terminal: 'step 10: loss 4.9327...|' over the bar's remains)."""
    cwd, env = workdir
    out_dir = os.path.join(cwd, "said")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "--log-dir", os.path.join(out_dir, "torchrun"), "examples/train_lm_fsdp.py", "--num_steps", "4",
            "--log_every", "2", "--ckpt_every", "2", "--resume", "auto", "--out_dir", out_dir]

    def merged(*extra):  # stdout and the bar's stderr into one stream, as on a terminal
        done = subprocess.run(argv + list(extra), cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:]
        return done.stdout
    stopped = merged("--stop_after_step", "2")
    assert "stopped after step 2 of 4 (--stop_after_step): no evaluation" in stopped, stopped[-2000:]
    assert "eval_loss" not in summary(stopped) and "=nan" not in stopped
    shown = [line for line in _as_shown(stopped) if line.startswith("step ")]
    assert len(shown) == 1 and re.fullmatch(r"step 2: loss \d+\.\d{6}", shown[0]), shown
    finished = merged()
    assert {"final_loss", "eval_loss", "tokens/s"} <= set(summary(finished))
    again = merged()
    assert "nothing to train: the run is at step 4, and it ends at step 4 (--num_steps): it is finished" in again
    assert "=nan" not in again and "final_loss" not in summary(again) and "tokens/s" not in summary(again)


@pytest.mark.xla
def test_a_programs_own_exit_on_xla_devices_prints_its_one_line(workdir):
    """Before: SystemExit inside xla_fsdp.launch (here the example's own check of
    --data_files) printed a 15-line traceback per rank before the intended line."""
    cwd, env = workdir
    done = subprocess.run([sys.executable, "examples/train_lm_fsdp.py", "--data_files", "nope/*.txt", "--out_dir",
                           os.path.join(cwd, "nope")], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == ["error: --data_files nope/*.txt matches no file"], done.stderr[-3000:]


def test_init_from_the_consolidated_model_starts_where_it_ended(workdir, uninterrupted, tmp_path):
    """--init_from the consolidated file of the run above (written here), fine-tuned one
    step at lr 1e-9 on 2 gloo ranks: its eval loss is the trained model's (TOL), not the 5.5 of an init."""
    cwd, env = workdir
    consolidate = command(readme_lines()[4], 0)[0]
    consolidated = str(tmp_path / "trained.pth")
    run(consolidate[:consolidate.index("--save_path") + 1] + [consolidated], cwd, env)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
            "examples/train_lm_fsdp.py", "--init_from", consolidated, "--num_steps", "1", "--lr", "1e-9",
            "--warmup_steps", "0", "--out_dir", str(tmp_path / "ft"), "--ckpt_every", "0"]
    tuned = summary(run(argv, cwd, env))
    assert abs(float(tuned["eval_loss"]) - float(uninterrupted["eval_loss"])) <= TOL, (tuned, uninterrupted)
