"""The README's CPU-only install lines, as written, in a venv that has nothing else:
no test extra brings NumPy or anything else the package forgot to require. There a program trains on
2 gloo ranks, saves training checkpoints, consolidates one (with the optimizer) and resumes from
another with the losses of the uninterrupted run. Before: every save failed there ("Numpy is not
available": checksums read tensor bytes through ``.numpy()``).

Runs once per ``make test``, in its second environment (the one without torch_xla): it builds its
own venv (about a minute here)."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import HAS_TORCH_XLA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = os.path.join(ROOT, "test", "plain_install_program.py")


def readme_cpu_install_lines():
    """The commands of the README's 'CPU only' row, in order."""
    row = next(line for line in open(os.path.join(ROOT, "README.md")) if line.startswith("| CPU only"))
    install_cell = row.split("|")[2]
    return re.findall(r"`([^`]+)`", install_cell)


def test_the_readme_names_two_plain_install_lines():
    lines = readme_cpu_install_lines()
    assert lines == ["pip install torch --index-url https://download.pytorch.org/whl/cpu", "pip install -e ."], lines


@pytest.mark.skipif(HAS_TORCH_XLA, reason="runs once per make test, in the environment without torch_xla")
@pytest.mark.timeout(1200)
def test_a_plain_cpu_install_trains_saves_consolidates_and_resumes(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    bin_dir = venv / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    # These machines reach only the package registries: pip falls back from PyTorch's CPU index to the
    # local CPU wheel (pip.conf's find-links), after retrying each of torch's requirements' pages there.
    # One retry, not five: the line is unchanged and 84 s of waiting go (112 s -> 28 s here).
    env["PIP_RETRIES"] = "1"
    for line in readme_cpu_install_lines():  # as written, from the clone's root
        done = subprocess.run(line, shell=True, cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, (line, done.stdout[-2000:], done.stderr[-2000:])
    python = str(bin_dir / "python")
    probe = subprocess.run([python, "-c", "import importlib.util as u; import torch, xla_fsdp; "
                            "print(u.find_spec('numpy') is None, xla_fsdp.__file__)"],
                           env=env, capture_output=True, text=True, check=True)
    no_numpy, where = probe.stdout.split()
    assert no_numpy == "True", "the plain install brought NumPy: this test would no longer prove anything"
    assert where.startswith(ROOT), where  # this checkout, editable

    def run(*args):
        done = subprocess.run([str(bin_dir / "torchrun"), "--standalone", "--nproc_per_node", "2",
                               "--log-dir", str(tmp_path / f"torchrun{len(args)}"), PROGRAM,
                               *args], env=env, capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(done.stdout.strip().splitlines()[-1])["losses"]

    whole = run("--ckpt_dir", str(tmp_path / "a"), "--steps", "4")
    # the checkpoint of step 2 alone in another folder: the resumed run continues from it
    os.makedirs(tmp_path / "b")
    for name in os.listdir(tmp_path / "a"):
        if name.startswith("step-000000002"):
            shutil.copy(tmp_path / "a" / name, tmp_path / "b" / name)
    resumed = run("--ckpt_dir", str(tmp_path / "b"), "--steps", "4", "--resume")
    assert sorted(resumed) == ["2", "3"] and resumed == {k: whole[k] for k in ("2", "3")}, (whole, resumed)

    prefix = str(tmp_path / "a" / "step-000000004")
    done = subprocess.run([python, "-m", "xla_fsdp.consolidate_sharded_ckpts", "--ckpt_prefix", prefix,
                           "--optimizer"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    full = torch.load(prefix + "_consolidated.pth", weights_only=True)
    assert sorted(full["model"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert full["optimizer"]["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert int(full["optimizer"]["state"]["0.weight"]["step"]) == 4
