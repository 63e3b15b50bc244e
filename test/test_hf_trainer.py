"""The Hugging Face Trainer's XLA FSDP path, unchanged, runs on xla_fsdp: tiny GPT-2 from a
config, synthetic tokens, ``python -m xla_fsdp.compat test/hf_trainer_xla_fsdp.py`` at 1, 2 and 4
XLA:CPU devices, grad checkpointing on and off, size- and transformer-based wrap (a covering set of
runs, not every combination: each run costs a launch).

Every run sees the same global batches (8 sequences), so it must log the same losses as the 1-device
run, step by step, and reach the same eval loss (Trainer logs losses rounded to 4 decimals: 2e-4).
The rank files the Trainer saved consolidate with our CLI into a state dict that a plain GPT-2 loads
strictly and that scores the wrapped model's eval loss (1e-4); the Trainer's own consolidated file
holds the same tensors. A run resumed from the step-3 checkpoint (2 devices) logs the uninterrupted run's losses.
The runs train with the Trainer's weight decay, its groups kept on the shards by ``shard_names_of``: the
2-device run logs the plain Trainer's losses (no FSDP, 1 device).
The Trainer's FSDPv2 path (``xla_fsdp_v2``) runs on xla_fsdp's SPMD mode the same way.
The 4-device run and the resumed run start from a ``save_pretrained`` folder holding the 1-device run's
initial weights, the low-memory way (meta parameters, storage only at wrap, ``LoadPretrained``
when training starts): the 4-device run must log the 1-device run's losses, so the load gave every
value and drew nothing, and the resumed run must continue from its checkpoint's weights (which
``LoadPretrained`` loads: the Trainer's own load before wrapping gives a meta model nothing).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="test extra: pip install -e .[test]")

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, SAVE_STEPS = 6, 3
RUNS = {  # name: (devices, wrap, grad checkpointing, from a save_pretrained folder the low-memory way)
    "1dev_transformer": (1, "transformer", False, False),
    "2dev_size_ckpt": (2, "size", True, False),
    "4dev_transformer_ckpt": (4, "transformer", True, True),
}  # every device count, both wrap policies, checkpointing on and off, both ways in
LOSS_TOL, EVAL_TOL = 2e-4, 1e-4
#: the runs above train with the Trainer's weight decay (every step takes 1.5 % of each decayed weight), its
#: groups carried to the shards by ShardedDecayTrainer: the plain Trainer's run checks them too
WEIGHT_DECAY = 5.0

pytestmark = pytest.mark.xla  # every test here runs on XLA:CPU devices


def _launch(out, devices, wrap, grad_ckpt, init_from=None, resume=None, model="gpt2", v2=False, weight_decay=0.0,
            plain=False, lora=False, packages=None):
    cmd = [sys.executable, "-m", "xla_fsdp.compat", os.path.join(HERE, "hf_trainer_xla_fsdp.py"), str(out),
           "--steps", str(STEPS), "--save_steps", str(SAVE_STEPS), "--wrap", wrap, "--model", model,
           "--weight_decay", str(weight_decay)]
    if plain:
        cmd.append("--plain")
    if lora:
        cmd.append("--lora")
    if grad_ckpt:
        cmd.append("--grad_ckpt")
    if v2:
        cmd.append("--v2")
    if resume:
        cmd += ["--resume", str(resume)]
    if init_from:
        cmd += ["--init_from", str(init_from)]
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    if packages:  # a folder of packages that come before the environment's own
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(packages), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(out, "result.json")) as f:
        result = json.load(f)
    result["losses"] = {int(k): v for k, v in result["losses"].items()}
    return result


def _harness():
    sys.path.insert(0, HERE)
    try:
        import hf_trainer_xla_fsdp as harness
    finally:
        sys.path.remove(HERE)
    return harness


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A ``save_pretrained`` folder of the runs' initial GPT-2: ``from_pretrained`` gives those values."""
    harness = _harness()
    folder = tmp_path_factory.mktemp("pretrained")
    harness.initial_model().save_pretrained(folder)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    initial = harness.INITIAL_STATES["gpt2"]
    assert sorted(loaded) == sorted(initial) and all(torch.equal(loaded[k], v) for k, v in initial.items())
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pretrained):
    folder = tmp_path_factory.mktemp("hf_trainer")
    return {name: (folder / name, _launch(folder / name, devices, wrap, ckpt, init_from=pretrained if low else None,
                                          weight_decay=WEIGHT_DECAY))
            for name, (devices, wrap, ckpt, low) in RUNS.items()}


def _plain_eval_loss(state_dict, kind="gpt2"):
    """The eval loss of a plain GPT-2 holding ``state_dict``, as the Trainer computes it: the mean
    over batches (equal sizes) of the summed token loss divided by the batch's label count, which
    transformers 4.57 passes as ``num_items_in_batch`` (one label more per sequence than it predicts:
    15/16 of the plain mean here, in training losses and eval loss alike)."""
    harness = _harness()
    model = harness.build_model(kind)
    model.load_state_dict(state_dict, strict=True)
    model.eval()
    ids = harness.eval_data().ids
    with torch.no_grad():
        batches = [ids[i:i + 4] for i in range(0, len(ids), 4)]
        return torch.stack([model(input_ids=b, labels=b, num_items_in_batch=torch.tensor(b.numel())).loss
                            for b in batches]).mean().item()


@pytest.mark.parametrize("name", sorted(RUNS))
def test_trainer_trains_like_one_device(runs, name):
    _, result = runs[name]
    _, base = runs["1dev_transformer"]
    assert result["fsdp_class"] == "xla_fsdp.fully_sharded_data_parallel.XlaFullyShardedDataParallel"
    assert result["world_size"] == RUNS[name][0]
    assert sorted(result["losses"]) == list(range(1, STEPS + 1))
    for step, loss in base["losses"].items():
        assert abs(result["losses"][step] - loss) <= LOSS_TOL, (step, result["losses"], base["losses"])
    assert abs(result["eval_loss"] - base["eval_loss"]) <= EVAL_TOL, (result, base)
    assert result["losses"][STEPS] < result["losses"][1] - 0.1, result["losses"]  # it learns


@pytest.mark.parametrize("name", sorted(RUNS))
def test_trainer_rank_files_consolidate_to_the_wrapped_model(runs, name, tmp_path):
    out, result = runs[name]
    ckpt = out / f"checkpoint-{STEPS}"
    devices = RUNS[name][0]
    assert sorted(p.name for p in ckpt.glob("rank*-of-*-pytorch_model.bin")) == [
        f"rank{r}-of-{devices}-pytorch_model.bin" for r in range(devices)]
    save = tmp_path / "consolidated.pth"
    proc = subprocess.run([sys.executable, "-m", "xla_fsdp.consolidate_sharded_ckpts", "--ckpt_prefix", f"{ckpt}/",
                           "--ckpt_suffix", "rank*-of-*-pytorch_model.bin", "--save_path", str(save)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours = torch.load(save, weights_only=True)["model"]
    # The Trainer's own consolidation (through xla_fsdp); save_pretrained keeps one name of the tied pair.
    trainers = torch.load(ckpt / "pytorch_model.bin", weights_only=True)
    assert set(trainers) <= set(ours) and len(ours) - len(trainers) <= 1
    for key, value in trainers.items():
        assert torch.equal(ours[key], value), key
    assert abs(_plain_eval_loss(ours) - result["eval_loss"]) <= EVAL_TOL


def test_trainer_resumes_from_its_checkpoint(runs, pretrained, tmp_path):
    # Two devices, grad checkpointing: the rank threads load their files apart and must still meet
    # at the first forward (test_xla_defects: a rank late to the first forward). Built the low-memory
    # way: LoadPretrained loads the checkpoint's (step 3's) weights, not the folder's.
    out, full = runs["2dev_size_ckpt"]
    devices, wrap, grad_ckpt, _ = RUNS["2dev_size_ckpt"]
    resumed = _launch(tmp_path / "resumed", devices, wrap, grad_ckpt, init_from=pretrained,
                      resume=out / f"checkpoint-{SAVE_STEPS}", weight_decay=WEIGHT_DECAY)
    assert full["steps_run"] == STEPS and resumed["steps_run"] == STEPS - SAVE_STEPS, (full, resumed)
    # The log history holds the checkpoint's steps and the ones this run computed.
    assert sorted(resumed["losses"]) == list(range(1, STEPS + 1)), resumed["losses"]
    for step, loss in resumed["losses"].items():
        assert abs(loss - full["losses"][step]) <= LOSS_TOL, (step, resumed["losses"], full["losses"])
    assert abs(resumed["eval_loss"] - full["eval_loss"]) <= EVAL_TOL


def _consolidate(ckpt, out):
    proc = subprocess.run([sys.executable, "-m", "xla_fsdp.consolidate_sharded_ckpts", "--ckpt_prefix", f"{ckpt}/",
                           "--ckpt_suffix", "rank*-of-*-pytorch_model.bin", "--save_path", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return torch.load(out, weights_only=True)["model"]


def test_trainer_fsdpv2_path_runs_on_the_spmd_mode(tmp_path):
    """``xla_fsdp_v2: true``: the Trainer builds FSDPv2 from torch_xla's path, which xla_fsdp.compat serves
    with xla_fsdp.spmd (one process, 4 devices, grad checkpointing). A tiny Llama (the Trainer's FSDPv2
    output marking raises on GPT-2's output type). Same losses and eval loss as the per-device path at one
    device; the Trainer's checkpoints hold real weight names (transformers#36004 lost them) and resume at 2."""
    base = _launch(tmp_path / "v1", 1, "transformer", False, model="llama")
    v2 = _launch(tmp_path / "v2", 4, "transformer", True, model="llama", v2=True)
    assert v2["fsdp_class"] == "xla_fsdp.spmd.wrapper.SpmdFullyShardedDataParallel"
    assert sorted(v2["losses"]) == list(range(1, STEPS + 1))
    for step, loss in base["losses"].items():
        assert abs(v2["losses"][step] - loss) <= LOSS_TOL, (step, v2["losses"], base["losses"])
    assert abs(v2["eval_loss"] - base["eval_loss"]) <= EVAL_TOL, (v2, base)

    ckpt = tmp_path / "v2" / f"checkpoint-{STEPS}"
    assert {p.name for p in ckpt.glob("rank*")} == {"rank0-of-1-pytorch_model.bin", "rank0-of-1-optimizer.pt"}
    ours = _consolidate(ckpt, tmp_path / "consolidated.pth")
    trainers = torch.load(ckpt / "pytorch_model.bin", weights_only=True)  # save_pretrained: tied head once
    assert set(trainers) <= set(ours) and len(ours) - len(trainers) <= 1
    for key, value in trainers.items():
        assert torch.equal(ours[key], value), key
    assert abs(_plain_eval_loss(ours, "llama") - v2["eval_loss"]) <= EVAL_TOL

    resumed = _launch(tmp_path / "resumed", 2, "transformer", True, model="llama", v2=True,
                      resume=tmp_path / "v2" / f"checkpoint-{SAVE_STEPS}")
    assert resumed["steps_run"] == STEPS - SAVE_STEPS
    for step, loss in resumed["losses"].items():
        assert abs(loss - v2["losses"][step]) <= LOSS_TOL, (step, resumed["losses"], v2["losses"])
    assert abs(resumed["eval_loss"] - v2["eval_loss"]) <= EVAL_TOL


def test_trainer_weight_decay_groups_through_shard_names_of_match_the_plain_trainer(runs, tmp_path):
    """On the Trainer's path: with weight decay, the Trainer's own grouping applied to
    the shards would decay GPT-2's LayerNorm weights (found by module type, which shards lack) and is
    refused at the first step (test_user_programs). Its decay names found on the unwrapped model and
    carried over with ``shard_names_of`` (``ShardedDecayTrainer`` in hf_trainer_xla_fsdp.py, the way
    docs/usage.md gives) log the losses and eval loss of the plain Trainer without FSDP: the 2-device run
    above (size-based wrap, grad checkpointing) against 1 device unwrapped."""
    plain = _launch(tmp_path / "plain", 1, "transformer", False, weight_decay=WEIGHT_DECAY, plain=True)
    _, sharded = runs["2dev_size_ckpt"]
    assert plain["fsdp_class"] == "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel", plain
    assert sharded["fsdp_class"] == "xla_fsdp.fully_sharded_data_parallel.XlaFullyShardedDataParallel", sharded
    assert sorted(sharded["losses"]) == list(range(1, STEPS + 1))
    for step, loss in plain["losses"].items():
        assert abs(sharded["losses"][step] - loss) <= LOSS_TOL, (step, sharded["losses"], plain["losses"])
    assert abs(sharded["eval_loss"] - plain["eval_loss"]) <= EVAL_TOL, (sharded, plain)


def test_trainer_with_a_peft_model_saves_the_adapter_that_trained(tmp_path):
    """LoRA through PEFT on the Trainer's XLA FSDP path (2 devices, transformer wrap, tiny Llama): it trains,
    and ``trainer.save_model`` writes an adapter with every LoRA tensor (A and B of q_proj and v_proj in 2
    layers) that ``PeftModel.from_pretrained`` loads into the initial model to the Trainer's own eval loss.
    Before: the adapter held no tensors (PEFT found its keys under the nested units' ``_fsdp_wrapped_module``
    names), and the reloaded model evaluated as untrained."""
    from peft import PeftModel
    out = tmp_path / "lora"
    sharded = _launch(out, 2, "transformer", False, model="llama", lora=True)
    saved = torch.load(out / "adapter" / "adapter_model.bin", weights_only=True)  # (save_safetensors=False)
    assert len(saved) == 8 and all("lora_A" in k or "lora_B" in k for k in saved), sorted(saved)
    assert any(v.abs().max() > 0 for k, v in saved.items() if "lora_B" in k)  # B starts at zero: it trained
    harness = _harness()
    reloaded = PeftModel.from_pretrained(harness.initial_model("llama"), str(out / "adapter")).merge_and_unload()
    eval_loss = _plain_eval_loss(reloaded.state_dict(), "llama")
    assert abs(eval_loss - sharded["eval_loss"]) <= EVAL_TOL, (eval_loss, sharded["eval_loss"])
    untrained = _plain_eval_loss(harness.INITIAL_STATES["llama"], "llama")
    assert abs(untrained - sharded["eval_loss"]) > 10 * EVAL_TOL, (untrained, sharded["eval_loss"])


#: The Trainer as pip installs it today, beside the test extra's pinned 4.57: transformers 5 with the
#: Accelerate and huggingface_hub it needs, installed for this test only, into a folder put first on
#: PYTHONPATH (no dependency resolution: torch, peft and the rest are the environment's).
TRANSFORMERS_5 = ["transformers==5.24.0", "accelerate==1.15.0", "huggingface_hub==2.4.0", "tokenizers==0.23.1",
                  "typer==0.29.2", "httpx2==2.16.2", "httpcore2==2.16.2", "truststore==0.10.5"]


def test_the_trainer_of_transformers_5_trains_a_peft_model_as_the_plain_trainer(tmp_path):
    """transformers 5's Trainer no longer makes the model its XLA FSDP path wrapped its ``self.model``, so
    it never built the optimizer it delays for FSDP: the first step failed with "'NoneType' object has no
    attribute 'param_groups'" (torch_xla's FSDP too). Under ``python -m xla_fsdp.compat`` it builds it
    on the wrapped model (integrations/hf_trainer_wrap.py): a PEFT model (tiny Llama, LoRA on q_proj and
    v_proj) on 2 devices logs the plain Trainer's losses and eval loss on 1 device without FSDP, and
    ``save_model`` writes an adapter whose 8 LoRA tensors equal the plain run's (1e-5)."""
    from safetensors.torch import load_file
    packages = tmp_path / "packages"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(packages),
                           *TRANSFORMERS_5], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {name: _launch(tmp_path / name, devices, "transformer", False, model="llama", lora=True, plain=plain,
                          packages=packages)
            for name, devices, plain in (("plain", 1, True), ("sharded", 2, False))}
    plain, sharded = runs["plain"], runs["sharded"]
    assert sharded["fsdp_class"] == "xla_fsdp.fully_sharded_data_parallel.XlaFullyShardedDataParallel", sharded
    assert sorted(sharded["losses"]) == sorted(plain["losses"]) == list(range(1, STEPS + 1))
    for step, loss in plain["losses"].items():
        assert abs(sharded["losses"][step] - loss) <= LOSS_TOL, (step, sharded["losses"], plain["losses"])
    assert abs(sharded["eval_loss"] - plain["eval_loss"]) <= EVAL_TOL, (sharded, plain)
    adapters = {name: load_file(tmp_path / name / "adapter" / "adapter_model.safetensors") for name in runs}
    assert len(adapters["sharded"]) == 8 and sorted(adapters["sharded"]) == sorted(adapters["plain"])
    for key, value in adapters["plain"].items():
        assert (adapters["sharded"][key] - value).abs().max() <= 1e-5, key
    assert any(v.abs().max() > 0 for k, v in adapters["sharded"].items() if "lora_B" in k)  # B starts at 0
