"""examples/train_lm_fsdp.py under torchrun, with one rank SIGKILLed on the first attempt: rank
KILL_RANK kills its own process KILL_DELAY seconds after its optimizer's step KILL_STEP (so the
kill lands anywhere in the next step: forward, collectives, a checkpoint write). Arguments are the
example's; the kill is set by environment variables so the example itself stays unchanged."""
import os
import runpy
import signal
import sys
import threading

from torch.optim.optimizer import register_optimizer_step_post_hook

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def arm(kill_step: int, delay: float, marker: str) -> None:
    steps = 0

    def after_step(optimizer, args, kwargs):
        nonlocal steps
        steps += 1
        if steps == kill_step:
            with open(marker, "w") as f:
                f.write(f"rank {os.environ['RANK']} killed {delay:.3f} s after step {kill_step}\n")
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()

    register_optimizer_step_post_hook(after_step)


if __name__ == "__main__":
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ["RANK"] == os.environ["KILL_RANK"]:
        arm(int(os.environ["KILL_STEP"]), float(os.environ["KILL_DELAY"]), os.environ["KILL_MARKER"])
    example = os.path.join(ROOT, "examples", "train_lm_fsdp.py")
    sys.path.insert(0, os.path.dirname(example))
    sys.argv = [example, *sys.argv[1:]]
    runpy.run_path(example, run_name="__main__")
