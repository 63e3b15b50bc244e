"""Fine-tune a pretrained causal LM with LoRA through PEFT, sharded, and save the adapter.

    python3 examples/train_lora_finetune.py                          # 2 XLA:CPU devices
    torchrun --nproc_per_node 2 examples/train_lora_finetune.py      # 2 gloo ranks
    python3 examples/train_lora_finetune.py --init_from FOLDER --precision bf16 --wrap fully_shard

``--init_from`` is a Hugging Face ``save_pretrained`` folder; without it a tiny Llama is written to
OUT_DIR/base first and the run starts from that (no download). Every rank loads the folder with
``from_pretrained`` (in bf16 with ``--precision bf16``: the parameters are sharded as they are), PEFT adds
LoRA (r=4) on q_proj and v_proj, and ``--wrap wrapper`` wraps it with XlaFullyShardedDataParallel,
auto-wrapped by PEFT's own policy, or ``--wrap fully_shard`` shards each decoder layer and then the root
(FSDP2's API; on XLA devices). The optimizer takes the trainable parameters only: the frozen base gets
no gradient and no optimizer state. Tokens are generated: each sequence counts up from a random start,
so the loss falls. At the end rank 0 saves the adapter with ``save_pretrained`` from the full state dict
to OUT_DIR/adapter, which ``PeftModel.from_pretrained(base, OUT_DIR/adapter)`` loads.
"""
from __future__ import annotations

import os

import torch
# Imported before the XLA:CPU device threads start: transformers' lazy imports are not thread-safe.
import transformers
from peft import LoraConfig, get_peft_model
from peft.utils.other import fsdp_auto_wrap_policy

from example_utils import ExampleParser, add_launch_flags, at_least, launch, positive_float, seeded

VOCAB, SEQ = 128, 16


def parse_args(argv=None):
    parser = ExampleParser(__doc__)
    parser.add_argument("--init_from", default=None, help="a save_pretrained folder (default: a tiny Llama "
                        "written to OUT_DIR/base)")
    parser.add_argument("--out_dir", default="/tmp/lora-finetune", help="where the base (if made) and the adapter go")
    parser.add_argument("--wrap", choices=["wrapper", "fully_shard"], default="wrapper",
                        help="wrapper: XlaFullyShardedDataParallel with PEFT's wrap policy; fully_shard: FSDP2's API "
                             "on each decoder layer, then the root (XLA devices)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="the dtype the model is loaded in (bf16: sharded and trained in bf16, LoRA in fp32)")
    parser.add_argument("--num_steps", type=at_least(1), default=20)
    parser.add_argument("--batch_size", type=at_least(1), default=4, help="sequences per rank and step")
    parser.add_argument("--lr", type=positive_float, default=5e-3)
    add_launch_flags(parser)
    return parser.parse_args(argv)


def write_tiny_base(folder: str) -> None:
    """A tiny random Llama as a save_pretrained folder, standing in for a downloaded one."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    with seeded(0):
        transformers.LlamaForCausalLM(config).save_pretrained(folder)


def tokens(step: int, rank: int, batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB, (batch, 1), generator=g)
    return (start + torch.arange(SEQ)) % VOCAB


def train(ctx, args) -> None:
    import torch.distributed as dist

    from xla_fsdp import XlaFullyShardedDataParallel as FSDP, fully_shard
    from xla_fsdp.checkpoints import full_state_dict
    base = args.init_from or os.path.join(args.out_dir, "base")
    if args.init_from is None:
        if ctx.is_master and not os.path.isdir(base):
            write_tiny_base(base)
        _barrier(ctx)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    with seeded(0):  # (LoRA's A is drawn: the same on every rank)
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
        peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))
    # from_pretrained patches nn.Module.register_parameter process-wide while it runs (accelerate's
    # init_empty_weights): XLA:CPU devices are threads of one process, so none wraps until all have built
    _barrier(ctx)
    if args.wrap == "fully_shard":
        if ctx.transport != "xla":
            raise SystemExit("error: --wrap fully_shard is xla_fsdp's on XLA devices; under torchrun use PyTorch's "
                             "own fully_shard, or --wrap wrapper")
        sharded = peft_model.to(ctx.device)
        for layer in peft_model.base_model.model.model.layers:
            fully_shard(layer)
        fully_shard(sharded)
    else:
        sharded = FSDP(peft_model, auto_wrap_policy=fsdp_auto_wrap_policy(peft_model))
    optimizer = torch.optim.AdamW([p for p in sharded.parameters() if p.requires_grad], lr=args.lr)
    first = last = None
    for step in range(args.num_steps):
        ids = tokens(step, ctx.rank, args.batch_size).to(ctx.device)
        loss = sharded(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ctx.sync()
        value = ctx.mean(loss.item())
        first = value if first is None else first
        last = value
        if step % 5 == 0 or step == args.num_steps - 1:
            ctx.log(f"step {step}: loss {value:.4f}")
    with torch.no_grad():
        ids = tokens(10_000, 0, args.batch_size).to(ctx.device)
        eval_loss = sharded(input_ids=ids, labels=ids).loss.float().item()
    full = full_state_dict(sharded)  # rank 0 gets every tensor under the unwrapped names
    adapter = os.path.join(args.out_dir, "adapter")
    if ctx.is_master:
        peft_model.save_pretrained(adapter, state_dict=full)
        saved = sum(1 for k in full if "lora_" in k)
        print(f"SUMMARY loss_first={first:.6f} loss_last={last:.6f} eval_loss={eval_loss:.6f} "
              f"adapter_tensors={saved} adapter={adapter} base={base}", flush=True)
    _barrier(ctx)
    if ctx.transport == "torch":
        dist.barrier()


def _barrier(ctx) -> None:
    if ctx.transport == "torch":
        import torch.distributed as dist
        dist.barrier()
    else:
        import torch_xla.core.xla_model as xm
        xm.rendezvous("lora-example")


def main(argv=None) -> None:
    launch(train, parse_args(argv))


if __name__ == "__main__":
    main()
