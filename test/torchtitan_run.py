"""torchtitan's own training loop (its ``torchtitan.train.main``, Llama 3 debug model) on CPU ranks under
torchrun, for test_torchtitan. ``--xla_fsdp`` binds ``torch.distributed.fsdp.fully_shard`` to xla_fsdp's
before torchtitan is imported, as a one-line adapter does, and counts the modules it shards.

What is changed in torchtitan is what its CUDA defaults need on a CPU machine, the same in both runs:
the device (cpu), its memory monitor (CUDA-only questions), FlexAttention (no backward on CPU: the same
masked attention through SDPA), the barrier before its timeouts (a CUDA device id), and FSDP2's
PREMUL_SUM(1.0) reduction, which gloo lacks (a SUM, the same reduction).

``python torchtitan_run.py assets DIR`` writes a word-level tokenizer and a text dataset for it."""
import json
import os
import random
import sys

import torch


def write_assets(root: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    rng = random.Random(0)
    words = [f"w{i}" for i in range(500)]
    vocab = {t: i for i, t in enumerate(["<|begin_of_text|>", "<|end_of_text|>", "<unk>"] + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    os.makedirs(os.path.join(root, "tokenizer"))
    tokenizer.save(os.path.join(root, "tokenizer", "tokenizer.json"))
    with open(os.path.join(root, "tokenizer", "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True}, f)
    os.makedirs(os.path.join(root, "data"))
    with open(os.path.join(root, "data", "train.json"), "w") as f:
        for _ in range(200):
            text = " ".join(rng.choice(words[:50 + rng.randrange(400)]) for _ in range(300))
            f.write(json.dumps({"text": text}) + "\n")


def bind_xla_fsdp() -> list:
    import torch.distributed.fsdp

    import xla_fsdp
    import xla_fsdp.fsdp2
    torch.distributed.fsdp.fully_shard = xla_fsdp.fully_shard  # the adapter's one line
    calls: list = []
    upstream = xla_fsdp.fsdp2._upstream_fully_shard

    def counted(*args, **kwargs):
        calls.append(kwargs.get("dp_mesh_dims"))
        return upstream(*args, **kwargs)

    xla_fsdp.fsdp2._upstream_fully_shard = counted
    return calls


def run_on_cpu() -> None:
    import torchtitan.tools.utils as titan_utils
    titan_utils.device_type, titan_utils.device_module = "cpu", torch.cpu  # before the modules that import them

    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.fsdp as titan_fsdp
    import torchtitan.distributed.utils as titan_dist
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.attention import flex_attention as flex
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.train import main

    class HostMemory:
        device_name, device_capacity_gib = "cpu", 0.0

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self):
            pass

    def dense_flex_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
        assert score_mod is None and not return_aux.lse
        mask = flex.create_mask(block_mask.mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                               enable_gqa=enable_gqa)
        return out, flex.AuxOutput()

    def sum_without_division(model):
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    def set_pg_timeouts(timeout, parallel_dims):
        torch.distributed.barrier()
        for group in [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]:
            torch.distributed.set_timeout(timeout, group)

    metrics.build_device_memory_monitor = HostMemory
    FlexAttention._compiled_flex_attn = staticmethod(dense_flex_attention)
    titan_fsdp.disable_fsdp_gradient_division = sum_without_division
    titan_dist.set_pg_timeouts = set_pg_timeouts
    main()


if __name__ == "__main__":
    if sys.argv[1:2] == ["assets"]:
        write_assets(sys.argv[2])
        sys.exit(0)
    calls = None
    if "--xla_fsdp" in sys.argv:
        sys.argv.remove("--xla_fsdp")
        calls = bind_xla_fsdp()
    run_on_cpu()
    if calls is not None:
        print(f"xla_fsdp.fully_shard sharded {len(calls)} modules", flush=True)
