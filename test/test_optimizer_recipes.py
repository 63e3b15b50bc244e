"""No-decay recipes as real projects write them, run on wrapped models: transformers' Trainer
(``get_decay_parameter_names`` and ``create_optimizer``'s two groups), timm's
``param_groups_weight_decay``, nanoGPT's ``configure_optimizers`` and torchtitan's
``OptimizersContainer`` with per-pattern groups. Each is applied to what the program sees
(``named_parameters()`` of the wrapped model), on the wrapper (per-parameter and flat shards) and on
``fully_shard``, at 1, 2 and 4 gloo ranks.

The oracle does not use the package's rule: it runs the same recipe on the unwrapped model, and reads
which original parameters each shard holds from ``shard_names_of``. Where the recipe gives some
original another weight decay through its shard than on the unwrapped model, the first step must be
refused on every rank, naming the fix, and the fix (groups from original names) must train as
unsharded; everywhere else the run must equal unsharded training (parameters within 1e-5 after three
AdamW steps whose weight decay moves each decayed parameter by about 1e-3)."""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ranks import on_gloo

V, D, T, PER_RANK, STEPS, LR, WD = 16, 8, 4, 2, 3, 1e-2, 0.1
TOLERANCE = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    """The names recipes look for: an nn.LayerNorm, a BERT-style ``LayerNorm`` attribute, a ``norm``
    that is no nn.LayerNorm, biases, a bias-free matrix, and a 1-D parameter that is none of these."""

    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.LayerNorm = nn.LayerNorm(D), nn.Linear(D, D), nn.LayerNorm(D)
        self.norm, self.mlp = RMSNorm(D), nn.Linear(D, D, bias=False)
        self.gate = nn.Parameter(torch.full((D,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.LayerNorm(x + self.attn(self.ln_1(x)))
        return x + self.gate * self.mlp(self.norm(x))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.final_norm, self.head = RMSNorm(D), nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


# ----------------------------------------------------------------------------- the recipes
def trainer_groups(model: nn.Module) -> List[Dict[str, Any]]:
    """transformers' Trainer.create_optimizer (4.57), with its own get_decay_parameter_names."""
    from transformers import Trainer
    decay_parameters = Trainer.get_decay_parameter_names(None, model)
    return [
        {"params": [p for n, p in model.named_parameters() if (n in decay_parameters and p.requires_grad)],
         "weight_decay": WD},
        {"params": [p for n, p in model.named_parameters() if (n not in decay_parameters and p.requires_grad)],
         "weight_decay": 0.0},
    ]


def timm_groups(model: nn.Module) -> List[Dict[str, Any]]:
    from timm.optim import param_groups_weight_decay
    return param_groups_weight_decay(model, weight_decay=WD)


def nanogpt_groups(model: nn.Module) -> List[Dict[str, Any]]:
    """nanoGPT's GPT.configure_optimizers (model.py), as written there."""
    param_dict = {pn: p for pn, p in model.named_parameters()}
    param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    return [{"params": decay_params, "weight_decay": WD}, {"params": nodecay_params, "weight_decay": 0.0}]


def torchtitan_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """torchtitan's OptimizersContainer with the per-pattern groups of its Qwen3 recipe: embeddings
    and output head without weight decay, the rest with."""
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig
    kwargs = {"lr": LR, "betas": (0.9, 0.999), "eps": 1e-8}
    config = OptimizersContainer.Config(implementation="for-loop", param_groups=[
        ParamGroupConfig(pattern=r"(?:embed|head)\.", optimizer_name="AdamW",
                         optimizer_kwargs=dict(kwargs, weight_decay=0.0)),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs=dict(kwargs, weight_decay=WD))])
    return OptimizersContainer(config, model_parts=[model])


def adamw(groups_of: Callable[[nn.Module], List[Dict[str, Any]]]) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda model: torch.optim.AdamW(groups_of(model), lr=LR)


RECIPES = {"trainer": adamw(trainer_groups), "timm": adamw(timm_groups), "nanogpt": adamw(nanogpt_groups),
           "torchtitan": torchtitan_optimizer}
APIS = ("wrapper", "wrapper_flat", "fully_shard")


# ----------------------------------------------------------------------------- one rank's runs
def param_groups(optimizer: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    parts = getattr(optimizer, "optimizers", [optimizer])  # torchtitan's container holds one per optimizer kind
    return [g for part in parts for g in part.param_groups]


def weight_decays(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, float]:
    """Parameter name (as ``named_parameters()`` gives it) -> the weight decay its group sets."""
    of = {id(p): float(g["weight_decay"]) for g in param_groups(optimizer) for p in g["params"]}
    return {n: of[id(p)] for n, p in model.named_parameters()}


def wrap(api: str, model: nn.Module) -> nn.Module:
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    from xla_fsdp import fully_shard
    from xla_fsdp.wrap import transformer_auto_wrap_policy
    if api == "fully_shard":
        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    return FSDP(model, auto_wrap_policy=policy, flatten_parameters=api == "wrapper_flat")


def held_by(api: str, model: nn.Module) -> Dict[str, str]:
    """Original name -> the name of the shard holding it, from the shard metadata (read only: the
    package's own mapping calls, shard_names_of and optimizer_param_groups, mark the shards as grouped
    by original name, which would change what the check sees)."""
    if api == "fully_shard":
        return {n: n for n, _ in model.named_parameters()}  # registered under the original's name, as FSDP2's
    layout = model.get_shard_metadata()["layout"]
    return {original: key for key, _ in model.named_parameters() for original in layout[key]["names"]}


def full_params(api: str, model: nn.Module) -> Dict[str, torch.Tensor]:
    if api == "fully_shard":
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    from xla_fsdp.checkpoints import full_state_dict
    return {n: t for n, t in full_state_dict(model, rank0_only=False).items() if n in dict(LM().named_parameters())}


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, V, (PER_RANK, T + 1), generator=torch.Generator().manual_seed(100 * step + rank))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: List[torch.Tensor]) -> None:
    for ids in batches:
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()


def build() -> nn.Module:
    torch.manual_seed(0)
    return LM()


def _rank_runs(me: Any) -> Dict[str, Any]:
    """Every (api, recipe) on this rank: what happened and what the oracle says should have."""
    rank, world = me.rank, me.world_size
    reference: Dict[str, Dict[str, torch.Tensor]] = {}
    out: Dict[str, Any] = {}
    for recipe, make in RECIPES.items():
        plain = build()
        plain_opt = make(plain)
        unwrapped_decay = weight_decays(plain, plain_opt)
        train(plain, plain_opt, [torch.cat([batch(s, r) for r in range(world)]) for s in range(STEPS)])
        reference[recipe] = {n: p.detach().clone() for n, p in plain.named_parameters()}
        for api in APIS:
            model = wrap(api, build())
            try:
                optimizer = make(model)
            except ValueError as e:  # the recipe itself refuses what it sees (torchtitan: a pattern matches nothing)
                out[f"{api}/{recipe}"] = {"build_error": str(e), "split": sorted(set(unwrapped_decay.values()))}
                continue
            seen = weight_decays(model, optimizer)
            shard = held_by(api, model)
            misled = sorted(o for o, wd in unwrapped_decay.items() if seen[shard[o]] != wd)
            result: Dict[str, Any] = {"misled": misled, "split": sorted(set(unwrapped_decay.values()))}
            try:
                train(model, optimizer, [batch(s, rank) for s in range(STEPS)])
                result["refused"] = None
                result["diff"] = _max_diff(full_params(api, model), reference[recipe])
            except RuntimeError as e:
                result["refused"] = str(e)
            if result["refused"] and api != "wrapper_flat":  # the fix the message gives: groups by original name
                fixed = wrap(api, build())
                no_decay = {o for o, wd in unwrapped_decay.items() if wd == 0.0}
                groups = fixed.optimizer_param_groups(
                    lambda n, no_decay=no_decay: {"weight_decay": 0.0} if n in no_decay else {})
                fixed_opt = torch.optim.AdamW(groups, lr=LR, weight_decay=WD)
                train(fixed, fixed_opt, [batch(s, rank) for s in range(STEPS)])
                result["fixed_diff"] = _max_diff(full_params(api, fixed), reference[recipe])
            out[f"{api}/{recipe}"] = result
    return out


def _max_diff(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want), (sorted(got), sorted(want))
    return max((got[n].float() - want[n].float()).abs().max().item() for n in want)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_real_no_decay_recipes_train_as_unsharded_or_are_refused_with_the_fix(world_size):
    runs = on_gloo(_rank_runs, world_size, hard_exit=True, weights_only=False)
    for case, result in runs[0].items():
        assert result["split"] == [0.0, WD], (case, result)  # every recipe splits this model
        if "build_error" in result:  # the wrapper's shard names (torch_xla's, dots replaced, or flat_param_N):
            # torchtitan's patterns (written for FSDP2's names) find no embedding or head, and it says so itself
            assert case.startswith("wrapper") and case.endswith("/torchtitan"), (case, result)
            assert "matched no parameters" in result["build_error"], (case, result)
            continue
        for other in runs[1:]:  # every rank came to the same outcome
            assert bool(other[case]["refused"]) == bool(result["refused"]), (case, other[case], result)
        if result["misled"]:
            assert result["refused"] and "optimizer_param_groups" in result["refused"], (case, result)
            if "fixed_diff" in result:
                assert result["fixed_diff"] < TOLERANCE, (case, result)
        else:
            assert result["refused"] is None, (case, result)
            assert result["diff"] < TOLERANCE, (case, result)
    outcomes = {case: bool(r.get("refused")) for case, r in runs[0].items()}
    # what the recipes meet, independently of the check: nanoGPT's and timm's dimension rule on 1-D
    # shards, every recipe exact on fully_shard (names and dims of the originals)
    assert outcomes["wrapper/nanogpt"] and outcomes["wrapper/timm"], outcomes
    assert not any(refused for case, refused in outcomes.items() if case.startswith("fully_shard/")), outcomes
