"""Fine-tuning programs as users run them: a small Llama (transformers), in fp32 or loaded in bf16, fully
trained or with LoRA through PEFT (r=4 on q_proj and v_proj, PEFT's fp32 adapter weights beside a bf16
base), sharded by the wrapper (per parameter, flat or dim 0; auto-wrapped by decoder layer or by PEFT's
own policy) or by ``fully_shard`` (XLA), and the same program unsharded in one process (test_fine_tuning).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List

import torch
import torch.nn as nn

from training_program import Run

VOCAB, PER_RANK, SEQ = 64, 2, 8


def llama_config():
    import transformers
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                                    attn_implementation="eager", tie_word_embeddings=False)


def lora_config(modules_to_save: bool = False):
    from peft import LoraConfig
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                      modules_to_save=["lm_head"] if modules_to_save else None)


def build_model(dtype: str, lora: bool, modules_to_save: bool = False) -> nn.Module:
    """The model every run starts from (seeded): bf16 as ``from_pretrained(torch_dtype=torch.bfloat16)``
    gives it; LoRA's B starts at zero, so it is set to small values that make every adapter weight move.
    ``modules_to_save``: PEFT also trains a copy of ``lm_head`` (and saves it in the adapter)."""
    import transformers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config())
    if dtype in ("bf16", "fp16"):
        model = model.to(torch.bfloat16 if dtype == "bf16" else torch.float16)
    if lora:
        from peft import get_peft_model
        model = get_peft_model(model, lora_config(modules_to_save))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (PER_RANK, SEQ), generator=g)


def decoder_layer_policy():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from xla_fsdp.wrap import transformer_auto_wrap_policy
    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})


@dataclasses.dataclass(frozen=True)
class FineTune:
    """One program. ``wrap``: param | flat | dim0 (the wrapper, auto-wrapped by decoder layer) |
    peft_policy (the wrapper with ``peft.utils.other.fsdp_auto_wrap_policy``) | fully_shard (each decoder
    layer, then the root: XLA only)."""
    wrap: str = "param"
    dtype: str = "fp32"        # fp32 | bf16 | fp16: the dtype the model is loaded in
    lora: bool = True
    modules_to_save: bool = False  # LoRA, and PEFT's trained copy of lm_head
    #: the adapter's weights are zeroed before wrapping and loaded after it, inside summon_full_params, with
    #: PEFT's set_peft_model_state_dict (as ``load_adapter`` does); unsharded, the same load
    load_after_wrapping: bool = False
    optimizer: str = "sgd"     # sgd (momentum: every gradient's size shows) | adamw (PEFT's recipe)
    steps: int = 3
    #: the unsharded run of a program on one XLA device stands for this many ranks (their batches'
    #: mean loss), so bf16 is compared with the same compiler's rounding; 0: as many as the run has
    global_ranks: int = 0
    #: a folder: the sharded run saves its adapter there with PEFT's save_pretrained, from the full state
    #: dict (``full_state_dict/``) and inside summon_full_params (``summon/``), as users write both
    save_to: str = ""

    def build(self, run: Run) -> nn.Module:
        model = build_model(self.dtype, self.lora, self.modules_to_save)
        run.notes["peft_model"] = model  # the object PEFT's save_pretrained is called on, wrapped or not
        return model

    def shard(self, model: nn.Module, run: Run) -> nn.Module:
        if not self.load_after_wrapping:
            return self._shard(model, run)
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        from xla_fsdp import XlaFullyShardedDataParallel as FSDP
        adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.zero_()
        model = self._shard(model, run)
        with FSDP.summon_full_params(model):  # (unsharded: no units, nothing to gather)
            result = set_peft_model_state_dict(run.notes["peft_model"], adapter)
        run.notes["load"] = {"missing": sorted(result.missing_keys), "unexpected": sorted(result.unexpected_keys),
                             "adapter": len(adapter)}
        return model

    def _shard(self, model: nn.Module, run: Run) -> nn.Module:
        from xla_fsdp import XlaFullyShardedDataParallel as FSDP
        if self.wrap == "none":
            return model.to(run.device)
        if self.wrap == "fully_shard":
            from xla_fsdp import fully_shard
            model = model.to(run.device)
            for layer in decoder_layers(model):
                fully_shard(layer)
            fully_shard(model)
            return model
        if self.wrap == "peft_policy":
            from peft.utils.other import fsdp_auto_wrap_policy
            return FSDP(model, auto_wrap_policy=fsdp_auto_wrap_policy(model))
        return FSDP(model, auto_wrap_policy=decoder_layer_policy(), flatten_parameters=self.wrap == "flat",
                    shard_param_on_dim_0=self.wrap == "dim0")

    def start(self, run: Run) -> None:
        # PEFT's recipe: the optimizer over the trainable parameters only
        trainable = [p for p in run.model.parameters() if p.requires_grad]
        run.optimizer = (torch.optim.AdamW(trainable, lr=1e-2) if self.optimizer == "adamw"
                         else torch.optim.SGD(trainable, lr=0.5, momentum=0.9))

    def around_steps(self, run: Run) -> Any:
        import contextlib
        return contextlib.nullcontext()

    def step(self, run: Run, step: int) -> None:
        model, opt = run.model, run.optimizer
        if self.global_ranks:
            ranks = range(self.global_ranks)
            loss = torch.stack([_loss(model, batch(step, r).to(run.device)) for r in ranks]).mean()
        else:
            loss = run.mean_over_ranks(lambda r: _loss(model, batch(step, r).to(run.device)))
        loss.backward()
        run.sync()
        if step == 0:
            run.notes["grads"] = _grad_facts(model)
        opt.step()
        opt.zero_grad()
        run.sync()
        run.losses.append(loss.item())

    def result(self, run: Run) -> Dict[str, Any]:
        model = run.model
        if run.sharded and self.wrap != "none":
            from xla_fsdp.checkpoints import full_state_dict
            full = full_state_dict(model, rank0_only=False)
        else:
            full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        full = {k: v.cpu() for k, v in full.items()}
        peft_model = run.notes.pop("peft_model")
        with torch.no_grad():
            run.notes["eval_loss"] = _loss(model, batch(99, 0).to(run.device)).item()
        run.sync()
        if self.save_to and run.sharded and self.wrap != "none":
            _save_adapters(peft_model, model, full, self.save_to, run)
        out = dict(losses=run.losses, full=full, **run.notes)
        out["optimizer_bytes"] = sum(t.numel() * t.element_size() for s in run.optimizer.state.values()
                                     for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        out["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
        return out


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss.float()


def decoder_layers(model: nn.Module) -> List[nn.Module]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    return [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]


def _grad_facts(model: nn.Module) -> Dict[str, Any]:
    """After the first backward: the bytes of gradients this rank holds, and whether a frozen
    parameter has one."""
    params = list(model.parameters())
    return {"bytes": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
            "frozen_with_grad": sum(1 for p in params if not p.requires_grad and p.grad is not None)}


def _save_adapters(peft_model: nn.Module, model: nn.Module, full: Dict[str, torch.Tensor], folder: str,
                   run: Run) -> None:
    """PEFT's save_pretrained as a hand-written loop calls it on rank 0: given the full state dict, and
    inside summon_full_params (a collective: every rank enters it)."""
    import os

    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    if run.rank == 0:
        try:
            peft_model.save_pretrained(os.path.join(folder, "full_state_dict"), state_dict=full)
        except RuntimeError as e:  # (the wrapper's modules_to_save copies: refused, naming summon_full_params)
            run.notes["full_state_dict_save"] = str(e)
    with FSDP.summon_full_params(model, writeback=False):
        if run.device.type == "xla":  # PEFT writes host tensors only (as unsharded on XLA): every rank runs
            state = peft_model.state_dict()  # the gathers' graph (a sync), then rank 0 reads its copy
            run.sync()
            if run.rank == 0:
                peft_model.save_pretrained(os.path.join(folder, "summon"),
                                           state_dict={k: v.cpu() for k, v in state.items()})
        elif run.rank == 0:
            peft_model.save_pretrained(os.path.join(folder, "summon"))
    run.sync()
    run.barrier()
