"""Pretrained weights straight into the shards: ``xla_fsdp.load_pretrained`` from a Hugging Face
folder, one safetensors file, a consolidated .pth, rank files of another world size and a DCP folder, into
the wrapper (each layout), xla_fsdp's and PyTorch's ``fully_shard``, on gloo ranks and XLA:CPU devices.

Each load is compared by name with the unsharded model's own load (``from_pretrained`` /
``load_state_dict``): equal to the bit. A Hugging Face Llama built on the meta device, wrapped and
loaded then trains as ``from_pretrained`` unsharded (losses and final weights within 1e-5) and its greedy
tokens are the same. Each rank reads only the rows of its own shards: the elements it reads are counted."""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List

import pytest
import torch

import xla_fsdp
from ranks import on_gloo, on_xla
from xla_fsdp import XlaFullyShardedDataParallel as FSDP
from xla_fsdp.checkpoints import full_state_dict
from xla_fsdp.checkpoints.files import CheckpointError, ModelMismatchError

transformers = pytest.importorskip("transformers", reason="test extra: pip install -e .[test]")

STEPS, PER_RANK, SEQ = 3, 2, 8


def _config(tied: bool = True):
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                                    max_position_embeddings=64)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny Llama saved as save_pretrained does, in shards with an index (tied embeddings: no
    lm_head.weight in the files), and as one file, untied."""
    root = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    with torch.no_grad():  # norms away from their init, so a load that skipped them shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(_config(tied=False)).save_pretrained(root / "untied")
    return root


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 64, (PER_RANK, SEQ), generator=g)


def _meta_model(tied: bool = True):
    """The documented way: parameters on the meta device (buffers, e.g. the rotary inv_freq, computed), and
    the config's ties made (the constructor does not make them under init_empty_weights)."""
    from accelerate import init_empty_weights
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(_config(tied))
    model.tie_weights()
    return model


def _shard(model, how: str, world_size: int):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from xla_fsdp.wrap import transformer_auto_wrap_policy
    if how == "fsdp2":  # PyTorch's FSDP2 (gloo): to_empty on the CPU, then the load fills every parameter
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
        model.model.rotary_emb.inv_freq = _inv_freq()
        return model
    if how == "fully_shard":  # xla_fsdp's fully_shard (XLA), in FSDP2's order: to_empty, then the values
        import torch_xla
        for layer in model.model.layers:
            xla_fsdp.fully_shard(layer)
        model = xla_fsdp.fully_shard(model)
        model.to_empty(device=torch_xla.device())
        model.model.rotary_emb.inv_freq = _inv_freq().to(torch_xla.device())
        return model
    import functools
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    # flattened: each unit's default init (reset_parameters), then the load; per parameter and dim-0: storage
    # only, no copy of the full data and no draws (the documented way)
    init = {} if how == "flat" else {"param_init_fn": xla_fsdp.storage_only}
    return FSDP(model, auto_wrap_policy=policy, flatten_parameters=how == "flat", shard_param_on_dim_0=how == "dim0",
                **init)


def _inv_freq() -> torch.Tensor:
    return transformers.LlamaForCausalLM(_config()).model.rotary_emb.inv_freq


def _train(model, rank: int, ranks: List[int], sync=lambda: None) -> Dict[str, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)  # XLA:CPU vs eager: 4e-5 at 1e-2
    device = next(model.parameters()).device
    losses = []
    for step in range(STEPS):
        per_rank = [model(input_ids=_batch(step, r).to(device), labels=_batch(step, r).to(device)).loss
                    for r in ranks]
        loss = torch.stack(per_rank).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync()
        losses.append(loss.item())
    tokens = _batch(99, 0)[:1, :4].to(device)
    with torch.no_grad():
        for _ in range(4):  # greedy, as generate(do_sample=False) picks
            tokens = torch.cat([tokens, model(input_ids=tokens).logits[:, -1].argmax(-1, keepdim=True)], 1)
            sync()
    return {"losses": losses, "tokens": tokens.cpu()}


def _full(model, how: str) -> Dict[str, torch.Tensor]:
    if how == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # on every rank
        return {k: v.detach().cpu().clone() for k, v in full.items()}
    return {k: v.cpu() for k, v in full_state_dict(model, rank0_only=False).items()}


def _fine_tune(me, folder: str, hows: List[str]) -> Dict[str, Any]:
    """Each layout in turn, in one launch (the ranks import transformers once)."""
    out = {}
    for how in hows:
        model = _shard(_meta_model(), how, me.world_size)
        result = xla_fsdp.load_pretrained(model, folder)
        loaded = _full(model, how)
        trained = _train(model, me.rank, [me.rank], me.sync)
        out[how] = dict(trained, loaded=loaded, trained=_full(model, how), result=tuple(map(list, result)))
        del model
    return out


def _reference(folder: str, world_size: int) -> Dict[str, Any]:
    model = transformers.LlamaForCausalLM.from_pretrained(folder)
    loaded = {k: v.clone() for k, v in model.state_dict().items()}
    out = _train(model, 0, list(range(world_size)))
    return dict(out, loaded=loaded, trained=model.state_dict())


def _same_losses(results: List[Dict[str, Any]], want: Dict[str, Any]) -> None:
    """Each rank's loss is its own batch's; the reference's is their mean."""
    mean = torch.tensor([r["losses"] for r in results]).mean(0)
    worst = (mean - torch.tensor(want["losses"])).abs().max().item()
    assert worst <= 1e-5, (mean.tolist(), want["losses"])


def _same(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], tol: float, what: str) -> None:
    names = [n for n in want if "inv_freq" not in n]
    assert sorted(n for n in got if "inv_freq" not in n) == sorted(names), what
    worst = max((got[n].float() - want[n].float()).abs().max().item() for n in names)
    assert worst <= tol, f"{what}: {worst:.3g} > {tol}"


@pytest.mark.parametrize("world_size,hows", [(2, ["flat", "dim0", "fsdp2"]), (4, ["param"])])
def test_a_hugging_face_model_built_on_meta_loads_and_fine_tunes_as_from_pretrained(pretrained, world_size, hows):
    """Flattened, dim-0 and PyTorch's FSDP2 at 2 gloo ranks, per parameter at 4."""
    folder = str(pretrained / "sharded")
    per_rank = on_gloo(_fine_tune, world_size, folder, hows, hard_exit="fsdp2" in hows)
    want = _reference(folder, world_size)
    for how in hows:
        results = [r[how] for r in per_rank]
        _same_losses(results, want)
        for rank, got in enumerate(results):
            assert got["result"] == ([], [])
            _same(got["loaded"], want["loaded"], 0.0, f"{how} rank {rank} loaded")
            _same(got["trained"], want["trained"], 1e-5, f"{how} rank {rank} trained")
            assert torch.equal(got["tokens"], want["tokens"]), (how, got["tokens"], want["tokens"])


@pytest.mark.xla
def test_the_same_on_xla_cpu_devices(pretrained):
    """The wrapper flattened, and xla_fsdp's fully_shard in FSDP2's order (to_empty, then the load), on 2
    XLA:CPU devices. (fully_shard's full_state_dict gave a tied alias, HF's lm_head.weight, as this rank's
    32-row shard of the 64-row embedding: its state_dict() names the alias, taken for a buffer.)"""
    folder = str(pretrained / "sharded")
    per_rank = on_xla(_fine_tune_on_xla, 2, folder, ["flat", "fully_shard"])
    want = _reference(folder, 2)
    for how in ("flat", "fully_shard"):
        results = [r[how] for r in per_rank]
        _same_losses(results, want)
        for rank, got in enumerate(results):
            _same(got["loaded"], want["loaded"], 0.0, f"{how} rank {rank} loaded")
            _same(got["trained"], want["trained"], 1e-5, f"{how} rank {rank} trained")
            assert torch.equal(got["tokens"], want["tokens"]), (how, got["tokens"], want["tokens"])


def _fine_tune_on_xla(me, folder: str, hows: List[str]) -> Dict[str, Any]:
    from training_program import BUILD_LOCK
    out = {}
    for how in hows:
        with BUILD_LOCK:
            model = _meta_model()
            model.model.rotary_emb.to(me.device)
            model = _shard(model, how, me.world_size)
        try:
            xla_fsdp.load_pretrained(model, folder)
        except Exception as e:
            raise RuntimeError(f"{how}: {e}") from e
        loaded = _full(model, how)
        me.barrier()
        trained = _train(model, me.rank, [me.rank], me.sync)
        out[how] = dict(trained, loaded=loaded, trained=_full(model, how))
        me.barrier()
    return out


# ----------------------------------------------------------------------------- every format, by name
def _formats(pretrained, tmp_path) -> Dict[str, str]:
    """The untied model in every format the load reads."""
    from safetensors.torch import save_file
    state = transformers.LlamaForCausalLM.from_pretrained(pretrained / "untied").state_dict()
    state = {k: v for k, v in state.items() if "inv_freq" not in k}
    paths = {"hf_folder": str(pretrained / "untied")}
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "one.safetensors"))
    paths["safetensors_file"] = str(tmp_path / "one.safetensors")
    torch.save({"model": state}, tmp_path / "consolidated.pth")
    paths["consolidated_pth"] = str(tmp_path / "consolidated.pth")
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, str(tmp_path / "bf16.safetensors"))
    paths["bf16_file"] = str(tmp_path / "bf16.safetensors")
    # xla_fsdp's own rank files of world size 1 (per parameter), and the same as a DCP folder
    from xla_fsdp.checkpoints.dcp_format import export_dcp
    model = FSDP(transformers.LlamaForCausalLM.from_pretrained(pretrained / "untied"))
    xla_fsdp.save_sharded_checkpoint(model, None, str(tmp_path / "ranks" / "ckpt"))
    paths["rank_files_of_another_world_size"] = str(tmp_path / "ranks" / "ckpt")
    export_dcp(str(tmp_path / "ranks" / "ckpt"), str(tmp_path / "dcp"), optim_key=None)
    paths["dcp_folder"] = str(tmp_path / "dcp")
    # the offline conversion: rank files for 4 ranks, written one tensor at a time, loaded at 2
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "xla_fsdp.convert", "--from", "hf", "--ckpt_dir",
                           str(pretrained / "untied"), "--world_size", "4", "--out_prefix",
                           str(tmp_path / "converted" / "init")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "wrote 4 rank files" in done.stdout, done.stdout + done.stderr
    paths["convert_from_hf"] = str(tmp_path / "converted" / "init")
    return paths


def _load_each(me, paths: Dict[str, str]) -> Dict[str, Any]:
    """Each format into a layout (in turn: flattened, per parameter, dim-0), counting what this rank reads."""
    from xla_fsdp.checkpoints import pretrained as module
    out = {}
    counted = _count_reads(module)
    for i, (name, path) in enumerate(paths.items()):
        how = ("flat", "param", "dim0")[i % 3]
        model = _shard(_meta_model(tied=False), how, me.world_size)
        counted[0] = 0
        xla_fsdp.load_pretrained(model, path)
        out[name] = {"full": _full(model, how), "read": counted[0],
                     "own": sum(p.numel() for p in model.parameters())}
    return out


def _count_reads(module) -> List[int]:
    """The number of elements this rank's reads give, counted at every source's ``read_into`` (what the
    load calls: a safetensors file's straight read, the other sources' ``read``)."""
    counted = [0]
    for cls in (module.TensorSource, module.SafetensorsSource):
        original = cls.read_into

        def read_into(self, name, start, end, out, original=original):
            counted[0] += out.numel()
            return original(self, name, start, end, out)
        cls.read_into = read_into
    return counted


def test_every_format_loads_as_load_state_dict_reading_only_its_own_rows(gloo, pretrained, tmp_path):
    paths = _formats(pretrained, tmp_path)
    want = transformers.LlamaForCausalLM.from_pretrained(pretrained / "untied").state_dict()
    total = sum(v.numel() for k, v in want.items() if "inv_freq" not in k)
    results = on_gloo(_load_each, 2, paths)
    for rank, per_format in enumerate(results):
        for name, got in per_format.items():
            if name == "bf16_file":  # cast as load_state_dict casts: fp32 parameters from bf16 values
                _same(got["full"], {k: v.to(torch.bfloat16).float() for k, v in want.items()}, 0.0, f"{rank} {name}")
            else:
                _same(got["full"], want, 0.0, f"{rank} {name}")
            # its own shards (padding aside), never the model: a shard's partial rows are read whole, and a
            # DCP folder is read a whole tensor at a time; rank files go through load_sharded_checkpoint (2
            # ranks: about half each)
            if name not in ("dcp_folder", "rank_files_of_another_world_size", "convert_from_hf"):
                assert 0.4 * total <= got["read"] <= 0.6 * total, (rank, name, got["read"], got["own"], total)


# ----------------------------------------------------------------------------- what bad input gets
def test_names_shapes_and_damaged_files_are_one_line(gloo, pretrained, tmp_path):
    from safetensors.torch import save_file
    state = transformers.LlamaForCausalLM.from_pretrained(pretrained / "untied").state_dict()
    state = {k: v.contiguous() for k, v in state.items() if "inv_freq" not in k}
    model = FSDP(transformers.LlamaForCausalLM(_config(tied=False)), flatten_parameters=True)
    extra = dict(state, **{"model.layers.9.mlp.up_proj.weight": torch.zeros(2)})
    save_file(extra, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ModelMismatchError, match=r"it holds 'model.layers.9.mlp.up_proj.weight' that the model has "
                                                 r"not \(1 unexpected\).*strict=False"):
        xla_fsdp.load_pretrained(model, str(tmp_path / "extra.safetensors"))
    result = xla_fsdp.load_pretrained(model, str(tmp_path / "extra.safetensors"), strict=False)
    assert result == ([], ["model.layers.9.mlp.up_proj.weight"])
    fewer = {k: v for k, v in state.items() if k != "lm_head.weight"}
    save_file(fewer, str(tmp_path / "fewer.safetensors"))
    with pytest.raises(ModelMismatchError, match=r"the model's 'lm_head.weight' are not in it \(1 missing\)"):
        xla_fsdp.load_pretrained(model, str(tmp_path / "fewer.safetensors"))
    assert xla_fsdp.load_pretrained(model, str(tmp_path / "fewer.safetensors"), strict=False) == (
        ["lm_head.weight"], [])
    wrong = dict(state, **{"lm_head.weight": torch.zeros(64, 16)})
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(ModelMismatchError, match=r"'lm_head.weight' has shape \[64, 16\] in .* and \[64, 32\] in the "
                                                 r"model: .*build it from the checkpoint's config"):
        xla_fsdp.load_pretrained(model, str(tmp_path / "wrong.safetensors"))
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes((tmp_path / "wrong.safetensors").read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"damaged.safetensors' is damaged .*copy it again"):
        xla_fsdp.load_pretrained(model, str(damaged))
    with pytest.raises(CheckpointError, match=r"does not exist: pass a Hugging Face folder"):
        xla_fsdp.load_pretrained(model, str(tmp_path / "nope"))
    # storage only and no load before the first forward: one line, not a run from zeros
    empty = _shard(_meta_model(), "param", 1)
    with pytest.raises(RuntimeError, match=r"'model.embed_tokens.weight' \(\d+ parameters in all\) was given storage "
                                           r"only \(param_init_fn=xla_fsdp.storage_only\) and no values before the "
                                           r"first forward. Load them first"):
        empty(input_ids=torch.zeros(1, 4, dtype=torch.long))
    assert math.isfinite(sum(float(v.sum()) for v in model.state_dict().values()))  # nothing was half-loaded
    assert os.path.getsize(tmp_path / "wrong.safetensors") > 0  # inputs untouched


# ----------------------------------------------------------------------------- a tie across units
@pytest.mark.parametrize("init", ["reset_parameters", "storage_only"])
def test_a_weight_tied_across_auto_wrapped_units_on_meta_stays_tied(gloo, tmp_path, init):
    """GPT-2's embedding and head, tied, built on the meta device and wrapped by size (the embedding
    would be a unit of its own): the enclosing unit owns the tied weight, as for a model built on the
    host. (Materializing the embedding's unit first made a new tensor the tie check no longer knew:
    "parameter 'weight' is shared with another FSDP unit".) Loaded, it computes from_pretrained's loss."""
    import functools

    from accelerate import init_empty_weights

    from xla_fsdp.wrap import size_based_auto_wrap_policy
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    want = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    with init_empty_weights():
        model = transformers.GPT2LMHeadModel(config)
    model.tie_weights()
    kw = {"param_init_fn": xla_fsdp.storage_only} if init == "storage_only" else {}
    model = FSDP(model, auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=1000), **kw)
    assert xla_fsdp.load_pretrained(model, str(tmp_path / "gpt2")) == ([], [])
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    got, expected = model(input_ids=ids, labels=ids).loss.item(), want(input_ids=ids, labels=ids).loss.item()
    assert abs(got - expected) <= 1e-6, (got, expected)
