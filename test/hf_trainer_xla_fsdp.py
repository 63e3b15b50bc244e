"""The Hugging Face Trainer's XLA FSDP path (``fsdp="full_shard"``, ``fsdp_config={"xla": True}``), unchanged,
on a tiny GPT-2 built from a config (no download) and synthetic token data. Run it as

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=N python -m xla_fsdp.compat test/hf_trainer_xla_fsdp.py OUT_DIR [flags]

``xla_fsdp.compat`` makes the Trainer's ``torch_xla.distributed.fsdp`` imports resolve to xla_fsdp. The
Trainer trains, logs every step, saves (its own rank files, consolidated by the Trainer through
xla_fsdp) and evaluates; rank 0 writes ``OUT_DIR/result.json`` with the logged losses and the wrapped
model's eval loss. The global batch is fixed (``--global_batch``), so every device count sees the same
batches in the same order. ``--resume DIR`` resumes from one of the Trainer's checkpoints. ``--v2``
takes the Trainer's FSDPv2 path (``xla_fsdp_v2``: SPMD, one process), served by ``xla_fsdp.spmd``.
``--init_from FOLDER`` starts from a ``save_pretrained`` folder the low-memory way (docs/checkpoints.md):
the model built with its parameters on the meta device, each unit given storage only when the Trainer
wraps it, and ``LoadPretrained`` filling the shards when training starts, each rank reading its own rows.
"""
import argparse
import inspect
import json
import os
import threading
from typing import Optional

import torch
import torch_xla

import xla_fsdp
# Imported here, before the device threads start: transformers' lazy imports are not thread-safe
# (two XLA:CPU threads importing at once saw "cannot import name 'GPT2Config'").
from transformers import (AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, PreTrainedModel, Trainer, TrainerCallback, TrainingArguments)

VOCAB, LENGTH = 64, 16


def build_model(kind: str = "gpt2") -> PreTrainedModel:
    """A tiny GPT-2, or a tiny Llama (its output type is the one the Trainer's FSDPv2 path knows how
    to mark: it raises on GPT-2's)."""
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                            tie_word_embeddings=True))
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=True,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


BLOCKS = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}
# XLA:CPU devices are threads of one process, sharing torch's CPU generator: one thread's Trainer
# re-seeds it (set_seed) while another builds its model. So the initial weights are drawn once, at
# import, before the device threads start, and every rank loads them (on TPU, processes need none of this).
INITIAL_STATES = {kind: build_model(kind).state_dict() for kind in BLOCKS}


# accelerate's init_empty_weights patches nn.Module.register_parameter for the whole process while it
# runs: XLA:CPU device threads build one at a time, and none wraps until all have built (on TPU the
# devices are processes and need neither).
_BUILDING = threading.Lock()
_BUILT = threading.Barrier(int(os.environ.get("CPU_NUM_DEVICES", "1")))


def initial_model(kind: str = "gpt2") -> PreTrainedModel:
    with _BUILDING:  # (its constructor's draws would land between another thread's seed and its LoRA draws)
        model = build_model(kind)
    model.load_state_dict(INITIAL_STATES[kind])
    return model


class Tokens(torch.utils.data.Dataset):
    """Sequences that count up from a random start (mod the vocabulary): learnable in a few steps."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (starts + torch.arange(LENGTH)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def eval_data() -> Tokens:
    return Tokens(32, 1)


def on_meta(folder: str) -> PreTrainedModel:
    """A ``save_pretrained`` folder's model with no values yet: parameters on the meta device, buffers
    (computed by the constructor) real, the config's ties made."""
    from accelerate import init_empty_weights
    with _BUILDING, init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    model.tie_weights()
    _BUILT.wait()
    return model


def with_lora(model: PreTrainedModel, kind: str) -> torch.nn.Module:
    """PEFT's LoRA on the attention projections, as its docs and the Trainer run it. Its A matrices are
    drawn from the generator the device threads share: seeded and drawn by one thread at a time, and no
    thread goes on (its Trainer re-seeds) until all have drawn, so every rank draws the 1-device run's."""
    from peft import LoraConfig, get_peft_model
    targets = ["q_proj", "v_proj"] if kind == "llama" else ["c_attn"]
    with _BUILDING:
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    _BUILT.wait()
    return model


class LoadPretrained(TrainerCallback):
    """Fills the Trainer's wrapped model when training starts, each rank reading only its own rows: from
    a ``save_pretrained`` folder, or from the checkpoint a run resumes from (the Trainer loads that into
    the model before wrapping it, where a model on the meta device takes nothing)."""

    def __init__(self, trainer: Trainer, folder: str, resume_from: Optional[str] = None):
        self.trainer, self.folder, self.resume_from = trainer, folder, resume_from

    def on_train_begin(self, args, state, control, **kwargs):
        path = self.folder
        if self.resume_from:  # its consolidated weights (pytorch_model.bin, or model.safetensors in the folder)
            weights = os.path.join(self.resume_from, "pytorch_model.bin")
            path = weights if os.path.exists(weights) else self.resume_from
        xla_fsdp.load_pretrained(self.trainer.model, path)  # the wrapped model


class CountSteps(TrainerCallback):
    """The optimizer steps this process ran (a resumed run runs only the ones left)."""

    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


class ShardedDecayTrainer(Trainer):
    """The documented way to keep the Trainer's weight-decay groups on xla_fsdp's shards: its decay
    names, found on the unwrapped model (LayerNorms by module type, which shards lack), carried over
    with ``shard_names_of`` once it has wrapped the model (docs/usage.md)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.unwrapped_decay = super().get_decay_parameter_names(self.model)

    def get_decay_parameter_names(self, model):
        if hasattr(model, "shard_names_of"):
            return model.shard_names_of(self.unwrapped_decay)
        return super().get_decay_parameter_names(model)


# The Trainer's checkpoints as pickles, which test_hf_trainer reads the 4.x way (5.x has only safetensors).
_PICKLED_CHECKPOINTS = ({"save_safetensors": False}
                        if "save_safetensors" in inspect.signature(TrainingArguments.__init__).parameters else {})


def _mp_fn(index, flags):
    import torch_xla.runtime as xr
    world_size = xr.world_size()
    fsdp_config = {"xla": True, "xla_fsdp_grad_ckpt": flags.grad_ckpt, "xla_fsdp_v2": flags.v2}
    if flags.init_from:  # each unit gets storage only (no random draws): LoadPretrained gives the values
        fsdp_config["xla_fsdp_settings"] = {"param_init_fn": xla_fsdp.storage_only}
    if flags.wrap == "transformer":
        fsdp_config["transformer_layer_cls_to_wrap"] = [BLOCKS[flags.model]]
    else:
        fsdp_config["min_num_params"] = 1000
    args = TrainingArguments(
        output_dir=flags.out, max_steps=flags.steps, per_device_train_batch_size=flags.global_batch // world_size,
        per_device_eval_batch_size=4, learning_rate=3e-3, logging_steps=1, save_steps=flags.save_steps,
        fsdp="" if flags.plain else "full_shard", fsdp_config=None if flags.plain else fsdp_config, report_to=[],
        seed=0, dataloader_drop_last=True, optim="adamw_torch", weight_decay=flags.weight_decay,
        **_PICKLED_CHECKPOINTS)
    counter = CountSteps()
    trainer_class = ShardedDecayTrainer if flags.weight_decay else Trainer
    model = on_meta(flags.init_from) if flags.init_from else initial_model(flags.model)
    if flags.lora:
        model = with_lora(model, flags.model)
    trainer = trainer_class(model=model, args=args, train_dataset=Tokens(256, 0), eval_dataset=eval_data(),
                            callbacks=[counter])
    if flags.init_from:
        trainer.add_callback(LoadPretrained(trainer, flags.init_from, flags.resume))
    trainer.train(resume_from_checkpoint=flags.resume)
    metrics = trainer.evaluate()
    if flags.lora:  # every rank: the Trainer's XLA FSDP save is collective
        trainer.save_model(os.path.join(flags.out, "adapter"))
    if xr.global_ordinal() == 0:
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        result = {
            "world_size": world_size,
            "losses": losses,
            "steps_run": counter.steps,
            "eval_loss": metrics["eval_loss"],
            "fsdp_class": f"{type(trainer.model).__module__}.{type(trainer.model).__name__}",
        }
        with open(os.path.join(flags.out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save_steps", type=int, default=3)
    parser.add_argument("--global_batch", type=int, default=8)
    parser.add_argument("--wrap", default="transformer", choices=["transformer", "size"])
    parser.add_argument("--grad_ckpt", action="store_true")
    parser.add_argument("--model", default="gpt2", choices=sorted(BLOCKS))
    parser.add_argument("--resume", default=None, help="a checkpoint directory the Trainer wrote")
    parser.add_argument("--weight_decay", type=float, default=0.0,
                        help="the Trainer's weight decay, its groups kept through ShardedDecayTrainer")
    parser.add_argument("--init_from", default=None, help="a save_pretrained folder, loaded the low-memory way")
    parser.add_argument("--plain", action="store_true", help="no FSDP: the Trainer on one device, unwrapped")
    parser.add_argument("--lora", action="store_true", help="LoRA through PEFT; the adapter saved by save_model")
    parser.add_argument("--v2", action="store_true", help="the Trainer's FSDPv2 path: SPMD, one process for "
                        "all devices (the global batch is the one process's batch)")
    flags = parser.parse_args()
    if flags.v2:
        import torch_xla.runtime as xr
        xr.use_spmd()
        _mp_fn(0, flags)
    else:
        torch_xla.launch(_mp_fn, args=(flags,))
