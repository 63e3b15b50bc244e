"""xla_fsdp.integrations.from_accelerate: HF Accelerate / Transformers FSDP configs to wrapper keywords."""

import pytest
import torch
import torch.nn as nn

from xla_fsdp import ShardingStrategy, XlaFullyShardedDataParallel as FSDP
from xla_fsdp.integrations import from_accelerate

# The Accelerate config of the HF FSDP guide (BERT fine-tuning), as `accelerate config` writes it.
GUIDE_YAML = """\
compute_environment: LOCAL_MACHINE
deepspeed_config: {}
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch_policy: BACKWARD_PRE
  fsdp_offload_params: false
  fsdp_sharding_strategy: 1
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: BertLayer
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
use_cpu: false
"""


class BertSelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.query, self.key, self.value))
        att = (q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5).softmax(-1)
        return (att @ v).transpose(1, 2).reshape(b, t, d)


class BertLayer(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.attention = BertSelfAttention(d, heads)
        self.attn_norm = nn.LayerNorm(d)
        self.intermediate = nn.Linear(d, 4 * d)
        self.output = nn.Linear(4 * d, d)
        self.out_norm = nn.LayerNorm(d)

    def forward(self, x):
        x = self.attn_norm(x + self.attention(x))
        return self.out_norm(x + self.output(torch.nn.functional.gelu(self.intermediate(x))))


class BertModel(nn.Module):
    """A small BERT: embeddings, an encoder of BertLayers, a pooler."""

    def __init__(self, vocab=50, d=16, layers=3):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, d)
        self.position_embeddings = nn.Embedding(12, d)
        self.encoder = nn.ModuleList([BertLayer(d) for _ in range(layers)])
        self.pooler = nn.Linear(d, d)
        self.classifier = nn.Linear(d, 2)

    def forward(self, ids):
        x = self.word_embeddings(ids) + self.position_embeddings(torch.arange(ids.shape[1]))
        for layer in self.encoder:
            x = layer(x)
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


def test_hf_guide_config_wraps_every_bert_layer(gloo, tmp_path):
    path = tmp_path / "accelerate_config.yaml"
    path.write_text(GUIDE_YAML)
    torch.manual_seed(0)
    model = BertModel()
    settings = from_accelerate(str(path), model)
    assert settings.state_dict_type == "SHARDED_STATE_DICT"
    assert settings.no_effect == {} and settings.kwargs["prefetch"] is True
    wrapped = settings.wrap(model)
    units = {name: m for name, m in wrapped.named_modules() if isinstance(m, FSDP)}
    inner = {n for n in units if n}
    assert len(inner) == 3 and all(isinstance(units[n].module, BertLayer) for n in inner)
    assert all(units[n].sharding_strategy is ShardingStrategy.FULL_SHARD and units[n].reshard_after_forward
               for n in inner)
    out = wrapped(torch.randint(0, 50, (2, 8)))             # and it trains
    out.sum().backward()
    assert all(p.grad is not None for p in wrapped.parameters())


def test_dict_config_trainer_style_keys_and_xla_settings(gloo):
    model = BertModel()
    settings = from_accelerate({"transformer_layer_cls_to_wrap": ["BertLayer", "BertSelfAttention"],
                                "sharding_strategy": "SHARD_GRAD_OP",
                                "xla_fsdp_settings": {"compute_dtype": "bfloat16", "flatten_parameters": True},
                                "xla_fsdp_grad_ckpt": True}, model)
    assert settings.kwargs["compute_dtype"] is torch.bfloat16 and settings.kwargs["flatten_parameters"]
    assert settings.kwargs["sharding_strategy"] is ShardingStrategy.SHARD_GRAD_OP
    wrapped = settings.wrap(model)
    wrapped_types = {type(m.module).__name__ for m in wrapped.modules() if isinstance(m, FSDP) and m is not wrapped}
    assert "BertLayer" in wrapped_types
    assert not wrapped.reshard_after_forward


def test_size_based_and_accelerate_mixed_precision(gloo):
    model = BertModel()
    settings = from_accelerate({"mixed_precision": "bf16", "fsdp_config": {
        "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 1000, "fsdp_sharding_strategy": 3}}, model)
    assert settings.kwargs["compute_dtype"] is torch.bfloat16
    assert settings.kwargs["sharding_strategy"] is ShardingStrategy.NO_SHARD
    assert sum(isinstance(m, FSDP) for m in settings.wrap(model).modules()) > 1


def test_no_prefetch_policy_turns_prefetching_off(gloo):
    settings = from_accelerate({"fsdp_backward_prefetch": "NO_PREFETCH", "fsdp_forward_prefetch": False},
                               BertModel())
    assert settings.kwargs["prefetch"] is False and settings.no_effect == {"forward_prefetch": False}
    assert not settings.wrap(BertModel()).prefetch


@pytest.mark.parametrize("value", [True, "true", "True"])
def test_offload_params_maps_to_cpu_offload(gloo, value):
    """fsdp_offload_params: true (a YAML bool, or Accelerate's environment string) wraps with
    cpu_offload=True, passed on to every auto-wrapped unit: shards, gradients and optimizer state on
    the host (the training itself is checked against unsharded training in test_offload)."""
    model = BertModel()
    settings = from_accelerate({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_offload_params": value,
                                "fsdp_transformer_layer_cls_to_wrap": "BertLayer"}, model)
    assert settings.kwargs["cpu_offload"] is True
    wrapped = settings.wrap(model)
    units = [m for m in wrapped.modules() if isinstance(m, FSDP)]
    assert len(units) == 4 and all(u.cpu_offload for u in units)
    wrapped(torch.randint(0, 50, (2, 8))).sum().backward()
    assert all(p.device.type == "cpu" and p.grad is not None for p in wrapped.parameters())
    assert from_accelerate({"fsdp_offload_params": "false"}, BertModel()).kwargs["cpu_offload"] is False
    both = {"fsdp_offload_params": True, "xla_fsdp_settings": {"cpu_offload": True}}
    assert from_accelerate(both, BertModel()).kwargs["cpu_offload"] is True  # saying it twice agrees


@pytest.mark.parametrize("cfg, message", [
    ({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": "BertLayr"},
     r"'BertLayr', which is no module class of this model. Did you mean \['BertLayer'\]"),
    ({"fsdp_sharding_stratgy": 1}, r"unknown FSDP config keys \['sharding_stratgy'\].*sharding_strategy"),
    ({"fsdp_sharding_strategy": 9}, "unknown sharding_strategy 9"),
    ({"fsdp_state_dict_type": "HALF_STATE_DICT"}, "fsdp_state_dict_type 'HALF_STATE_DICT' is not one of"),
    ({"fsdp_offload_params": "sometimes"}, "fsdp_offload_params is true or false, got 'sometimes'"),
    ({"fsdp_offload_params": True, "xla_fsdp_settings": {"cpu_offload": False}},
     "fsdp_offload_params=true contradicts xla_fsdp_settings cpu_offload=False"),
    ({"xla_fsdp_settings": {"flatten_params": True}}, r"unknown keyword 'flatten_params'.*flatten_parameters"),
    ({"xla_fsdp_grad_ckpt": True}, "set an fsdp_auto_wrap_policy too"),
    ({"fsdp_backward_prefetch": "BACKWARD_FIRST"}, "fsdp_backward_prefetch 'BACKWARD_FIRST' is not one of"),
])
@pytest.mark.fast
def test_bad_configs_name_the_problem(cfg, message):
    with pytest.raises(ValueError, match=message):
        from_accelerate(cfg, BertModel())


@pytest.mark.xla
def test_xla_fsdp_v2_selects_the_spmd_mode_which_needs_the_spmd_runtime():
    settings = from_accelerate({"xla_fsdp_v2": True, "fsdp_sharding_strategy": "SHARD_GRAD_OP"}, BertModel())
    assert settings.spmd and not from_accelerate({}, BertModel()).spmd
    # test_spmd trains a model wrapped this way in an SPMD process; this process runs the per-device mode
    with pytest.raises(RuntimeError, match=r"SPMD mode needs torch_xla's SPMD runtime: call xla_fsdp.spmd.enable"):
        settings.wrap(BertModel())


def test_missing_yaml_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config file"):
        from_accelerate(str(tmp_path / "nope.yaml"), BertModel())
