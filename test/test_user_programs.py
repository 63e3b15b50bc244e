"""What programs do around the training loop: ranks that build different models, reading
and editing a wrapped model between steps, hooks and misuse that must fail clearly on every rank.
The training-loop patterns themselves (freezing, clipping, loss scaling, hooks, re-initialising,
outputs) are dimensions of the differential suite (test_differential.py)."""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.nn as nn

from harness import xla_steps
from ranks import on_gloo, run_multiprocess, xla_cpu_devices
from training_program import BUILD_LOCK
from xla_fsdp import XlaFullyShardedDataParallel as FSDP
from xla_fsdp.checkpoints import full_state_dict


def _with_rank_and_size(me: Any, fn: Callable[[int, int], Any]) -> Any:
    return fn(me.rank, me.world_size)


def run_ranks(fn: Callable[[int, int], Any], world_size: int) -> List[Any]:
    """``fn(rank, world_size)`` on gloo ranks (ranks.on_gloo); each rank's result, or its error as a string."""
    return on_gloo(_with_rank_and_size, world_size, fn, weights_only=False, errors_as_results=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model: nn.Module, batches: List[torch.Tensor]) -> List[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x in batches:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _built_per_rank(rank: int, world_size: int, **kw: Any) -> Dict[str, Any]:
    """Each rank seeds with its own rank before building (or changes a buffer): the program
    without a common seed."""
    torch.manual_seed(rank)
    net = Net()
    net.bn.running_mean.fill_(float(rank))
    if kw.get("sharding_strategy", "").startswith("HYBRID"):
        kw["hybrid_shard_size"] = 2
    model = FSDP(net, **kw)
    losses = _train(model, [_batch(s, rank) for s in range(3)])
    return {"losses": losses, "full": full_state_dict(model, rank0_only=False),
            "running_mean": model.module.bn.running_mean.clone()}


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_ranks_that_built_different_parameters_stop_with_the_fix(strategy):
    """Before: no error; each rank trained its own model (NO_SHARD: the replicas differed for good)."""
    results = run_ranks(functools.partial(_built_per_rank, sharding_strategy=strategy), 2)
    for result in results:
        assert isinstance(result, str), "a rank trained although the ranks built different models"
        assert "ranks built different values for parameter 'fc1.weight'" in result
        assert "sync_module_states=True" in result and "torch.manual_seed" in result


@pytest.mark.parametrize("world_size,strategy", [(2, "FULL_SHARD"), (2, "NO_SHARD"), (4, "HYBRID_SHARD")])
def test_sync_module_states_takes_rank_0s_parameters_and_buffers(world_size, strategy):
    results = run_ranks(functools.partial(_built_per_rank, sharding_strategy=strategy, sync_module_states=True),
                        world_size)
    reference = _rank_0_reference(world_size, 3)
    for rank, result in enumerate(results):
        assert not isinstance(result, str), result
        for name, value in reference.state_dict().items():
            if "running" in name or "num_batches" in name:
                continue
            assert torch.allclose(result["full"][name], value, atol=1e-6), (rank, name)
    # rank 0's running_mean (0) was every rank's starting value: after 3 steps with momentum 0.1 each
    # rank holds 0.271 of its own batches' means, nothing of the other ranks' starting values
    for result in results:
        assert result["running_mean"].abs().max() < 1.0, result["running_mean"]


def _rank_0_reference(world_size: int, steps: int) -> nn.Module:
    """Rank 0's model (seed 0) trained unsharded on the global batch."""
    torch.manual_seed(0)
    reference = Net()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for s in range(steps):
        # BatchNorm normalises each rank's batch in the sharded run: the reference does the same
        out = torch.cat([reference(_batch(s, r)) for r in range(world_size)])
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
    return reference


def _freed_parameter_and_hooks(rank: int, world_size: int) -> Dict[str, Any]:
    torch.manual_seed(0)
    net = Net()
    net.fc2 = FSDP(net.fc2)
    model = FSDP(net)
    _train(model, [_batch(0, rank)])
    seen = {}
    weight = model.module.fc1.weight
    seen["shape"] = tuple(weight.shape)
    for what, op in [("zeros_", lambda: nn.init.zeros_(weight)), ("copy_", lambda: weight.copy_(torch.ones(8, 6))),
                     ("print", lambda: str(weight + 1))]:
        try:
            with torch.no_grad():
                op()
            seen[what] = "no error"
        except RuntimeError as e:
            seen[what] = str(e)
    with FSDP.summon_full_params(model):
        seen["summoned"] = model.module.fc1.weight.clone()
        with torch.no_grad():
            model.module.fc1.weight[0].fill_(7.0)
    seen["after"] = full_state_dict(model, rank0_only=False)["fc1.weight"]
    # a hook on a shard (after wrapping) runs on the reduced block; a post-accumulate hook after it
    calls = []
    shard = next(model.fc2.parameters())
    shard.register_hook(lambda g: calls.append(("hook", g.shape)) or g * 0)
    shard.register_post_accumulate_grad_hook(lambda p: calls.append(("post", float(p.grad.abs().sum()))))
    _train(model, [_batch(1, rank)])
    seen["calls"] = list(calls)
    # freezing through the module's attribute between steps freezes the shard, and the next step follows it
    model.module.fc1.weight.requires_grad_(False)
    before = full_state_dict(model, rank0_only=False)["fc1.weight"]
    _train(model, [_batch(2, rank)])
    seen["frozen_moved"] = (full_state_dict(model, rank0_only=False)["fc1.weight"] - before).abs().max().item()
    # a post-accumulate hook on an original parameter cannot work once it is sharded: refused
    late = nn.Linear(2, 2)
    late.weight.register_post_accumulate_grad_hook(lambda p: None)
    try:
        FSDP(late)
        seen["post_before_wrap"] = "no error"
    except RuntimeError as e:
        seen["post_before_wrap"] = str(e)
    return seen


def test_a_parameter_between_steps_refuses_its_data_and_summon_full_params_gives_it():
    """Before: nn.init.zeros_ on model.module.fc1.weight between steps killed the rank (SIGSEGV)."""
    for seen in run_ranks(_freed_parameter_and_hooks, 2):
        assert not isinstance(seen, str), seen
        assert seen["shape"] == (8, 6)
        for what in ("zeros_", "copy_", "print"):
            assert "'fc1.weight' is sharded between forward passes" in seen[what], seen[what]
            assert "summon_full_params" in seen[what]
        assert seen["summoned"].shape == (8, 6)
        assert torch.equal(seen["after"][0], torch.full((6,), 7.0))
        assert torch.equal(seen["after"][1:], seen["summoned"][1:])
        assert [c[0] for c in seen["calls"]] == ["hook", "post"] and seen["calls"][1][1] == 0.0
        assert "'weight' has a post-accumulate-grad hook registered before wrapping" in seen["post_before_wrap"]
        assert seen["frozen_moved"] == 0.0




def _xla_built_per_rank(sync: Any, wrap_under_lock: bool = False) -> Any:
    import torch_xla
    import torch_xla.runtime as xr
    device, rank = torch_xla.device(), xr.global_ordinal()
    before = None
    try:
        with BUILD_LOCK:  # each thread's seed and draws together: rank 0's model is seed 0's
            torch.manual_seed(rank)
            net = Net()
            if wrap_under_lock:  # construction must not wait for a peer that waits for this lock
                model = FSDP(net.to(device), sync_module_states=sync)
        if wrap_under_lock:  # what a save before the first forward holds
            before = {k: v.cpu() for k, v in full_state_dict(model, rank0_only=False).items()}
        else:
            model = FSDP(net.to(device), sync_module_states=sync)
        losses = _train(model, [_batch(s, rank).to(device) for s in range(2)])
        return {"losses": losses, "before": before,
                "full": {k: v.cpu() for k, v in full_state_dict(model, rank0_only=False).items()}}
    except RuntimeError as e:
        return str(e)


@pytest.mark.xla
def test_xla_device_threads_that_built_different_models_stop_or_sync():
    """Before: 1 of 6 runs of an unchanged torch_xla program under python -m xla_fsdp.compat trained a
    different model per device thread, silently. Now the first forward stops both threads with the fix,
    and sync_module_states=True (the default under python -m xla_fsdp.compat, test_compat) trains rank
    0's model, also when the threads wrap under their build lock (before: that hung until the 600 s
    exchange timeout, CI's test_torch_xla_style_training_script_on_digits[4])."""
    with xla_cpu_devices(2):
        refused = run_multiprocess(_xla_built_per_rank, False)
        synced = run_multiprocess(_xla_built_per_rank, True)
        locked = run_multiprocess(_xla_built_per_rank, True, True)
    for text in refused.values():
        assert isinstance(text, str) and "ranks built different values for parameter 'fc1.weight'" in text, text
    torch.manual_seed(0)
    initial = Net().state_dict()
    reference = _rank_0_reference(2, 2)
    for result in list(synced.values()) + list(locked.values()):
        assert not isinstance(result, str), result
        for name, value in reference.state_dict().items():
            if "running" not in name and "num_batches" not in name:
                deviation = (result["full"][name] - value).abs().max().item()
                assert deviation <= 1e-5, (name, deviation)
    # wrapped under the build lock (the threads take rank 0's values at the first forward or save,
    # not at construction, where a peer may still wait for the lock): saved before training, rank 0's
    for result in locked.values():
        for name, value in initial.items():
            assert torch.equal(result["before"][name], value), name


def _optimizer_as_its_step_sees_it(rank: Any, api: str) -> Dict[str, Any]:
    """Two AdamW steps over a wrapped model (the wrapper at world size > 1 on gloo, where its shard gradients are
    ShardGrads; fully_shard on XLA, whose parameters are ShardParams), looking at the optimizer from inside its
    step, at its first in-place update (past its pre-hooks): what the program put in ``param_groups``, the type of each
    gradient it gave, and the keys of ``optimizer.state``."""
    from torch.overrides import TorchFunctionMode

    import xla_fsdp
    with BUILD_LOCK:
        torch.manual_seed(0)
        net = Net()
    if api == "wrapper":
        model = FSDP(net)
    else:
        model = net.to(rank.device)
        xla_fsdp.fully_shard(model.fc1)
        xla_fsdp.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    lists = [g["params"] for g in opt.param_groups]
    given = [list(params) for params in lists]
    seen: List[Dict[str, Any]] = []

    class Look(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            updates = name.startswith("_foreach_") or name.endswith("_") and not name.startswith("__")
            if updates and len(seen) < len(types_before):  # (the step's first in-place update: its own math)
                seen.append({
                    "same lists": [g["params"] is lst for g, lst in zip(opt.param_groups, lists)],
                    "same params": [len(g["params"]) == len(ps) and all(a is b for a, b in zip(g["params"], ps))
                                    for g, ps in zip(opt.param_groups, given)],
                    "grad types": sorted({type(p.grad).__name__ for ps in given for p in ps if p.grad is not None}),
                    "state keyed by the given": all(any(k is p for ps in given for p in ps) for k in opt.state)})
            return func(*args, **(kwargs or {}))

    x = (torch.randn(4, 6, generator=torch.Generator().manual_seed(rank.rank))).to(rank.device)
    types_before = []
    for _ in range(2):
        opt.zero_grad()
        model(x).sum().backward()
        types_before.append(sorted({type(p.grad).__name__ for ps in given for p in ps if p.grad is not None}))
        with Look():
            opt.step()
        rank.sync()
    return {"seen": seen, "types before": types_before}


def _check_the_optimizer_untouched(results: List[Dict[str, Any]], grad_type: str) -> None:
    for result in results:
        assert len(result["seen"]) == 2, result
        for before, inside in zip(result["types before"], result["seen"]):
            assert inside["same lists"] and all(inside["same lists"]) and all(inside["same params"]), inside
            assert inside["grad types"] == before == [grad_type], (before, inside)
            assert inside["state keyed by the given"], inside


def test_the_optimizer_steps_what_the_program_gave_it():
    """The package leaves the program's optimizer as the program built it, also inside its step: the
    ``param_groups`` lists and their parameters are the program's own objects, each gradient keeps its type
    (a ShardGrad, whose norms span the ranks), and ``optimizer.state`` is keyed by the parameters given.
    Before, an optimizer pre-hook swapped the gradients' class for the step, to save host time."""
    _check_the_optimizer_untouched(on_gloo(_optimizer_as_its_step_sees_it, 2, "wrapper", weights_only=False),
                                   "ShardGrad")


@pytest.mark.xla
def test_the_optimizer_steps_fully_shards_parameters_as_the_program_gave_them():
    """The same for fully_shard on 2 XLA:CPU devices, whose parameters are ShardParams (FSDP2's DTensors):
    before, the pre-hook also put each one's shard in the program's ``param_groups`` lists and re-keyed
    ``optimizer.state`` by the shards for the step."""
    from ranks import on_xla
    _check_the_optimizer_untouched(on_xla(_optimizer_as_its_step_sees_it, 2, "fully_shard"), "ShardGrad")


def test_an_optimizer_that_needs_whole_parameters_is_warned_at_its_first_step(gloo):
    """Adafactor factors a matrix's second moments by rows and columns: on 1-D shards it cannot."""
    torch.manual_seed(0)
    model = FSDP(Net())
    model(_batch(0, 0)).sum().backward()
    with pytest.warns(UserWarning, match="Adafactor updates a parameter from its shape.*element-wise optimizer"):
        torch.optim.Adafactor(model.parameters()).step()
    exact = torch.optim.AdamW(model.parameters())
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exact.step()


_RNG_LOCK = threading.Lock()


def _xla_dropout_programs() -> Dict[str, List[float]]:
    """One program with dropout, seeded with xm.set_rng_state, trained unwrapped, wrapped (nested
    units) and through fully_shard: every rank the same batches, so each equals the unwrapped run."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    import xla_fsdp
    device = torch_xla.device()

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.drop = nn.Linear(16, 16), nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(torch.relu(self.fc(x)))

    def build() -> nn.Module:
        with _RNG_LOCK:  # XLA:CPU device threads share the CPU generator
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 2)).to(device)

    def train(wrap: Callable[[nn.Module], nn.Module]) -> List[float]:
        model = build()
        xm.set_rng_state(1234, device)  # before wrapping: the wrap's own syncs must not move it
        model = wrap(model)
        batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(step)) for step in range(3)]
        return xla_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), batches)

    def nested(model: nn.Module) -> nn.Module:
        return FSDP(model, auto_wrap_policy=lambda module, recurse, **k: recurse or isinstance(module, Block))

    def fully_sharded(model: nn.Module) -> nn.Module:
        for block in (model[1], model[2]):
            xla_fsdp.fully_shard(block)
        xla_fsdp.fully_shard(model)
        return model
    return {"unwrapped": train(lambda m: m), "wrapper": train(nested), "fully_shard": train(fully_sharded)}


@pytest.mark.xla
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_xla_random_draws_are_the_unwrapped_programs(world_size):
    """Before: the syncs xla_fsdp makes for itself (at wrapping, the first forward's
    checks) each advanced torch_xla's seed (a graph cut does), so with the same xm.set_rng_state seed
    the first forward's dropout masks differed from the unwrapped program's (at 2 devices, loss
    1.4513 vs 1.5214 in the program that showed it). Each such sync now leaves the seed as it found it."""
    with xla_cpu_devices(world_size):
        by_rank = run_multiprocess(_xla_dropout_programs)
    for rank, results in by_rank.items():
        for name in ("wrapper", "fully_shard"):
            worst = max(abs(a - b) for a, b in zip(results[name], results["unwrapped"]))
            assert worst <= 1e-6, (rank, name, results)


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.body, self.head = nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10, bias=False)

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.emb(ids))))


def _tie_after_wrapping(rank: int, world_size: int, how: str = "wrapper", device: Any = None) -> str:
    """Tie head.weight to emb.weight after wrapping, as Hugging Face's tie_weights()/post_init do:
    the next forward must refuse (before, it trained the untied model: loss 2.5844 at step 0 where
    the tied model's is 7.8235)."""
    import xla_fsdp
    with _RNG_LOCK:  # XLA:CPU device threads share the CPU generator
        torch.manual_seed(0)
        net = _TiedLM() if device is None else _TiedLM().to(device)
    if how == "fully_shard":
        xla_fsdp.fully_shard(net)
        model, inner = net, net
    else:
        model = FSDP(net, flatten_parameters=how == "flat")
        inner = model.module
    inner.head.weight = inner.emb.weight
    ids = torch.tensor([[1, 2, 3]]) if device is None else torch.tensor([[1, 2, 3]]).to(device)
    try:
        model(ids).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "trained"


@pytest.mark.parametrize("how", ["wrapper", "flat"])
def test_tying_after_wrapping_is_refused_naming_both_parameters(how):
    """Tying two parameters after wrapping is refused, naming both, on 2 gloo ranks (per-parameter and
    flat shards)."""
    for outcome in run_ranks(functools.partial(_tie_after_wrapping, how=how), 2):
        assert "'head.weight' was given the parameter 'emb.weight' after wrapping" in outcome, outcome
        assert "tie them before wrapping" in outcome and "summon_full_params" in outcome, outcome


def _xla_tie_after_wrapping(how: str) -> str:
    import torch_xla
    return _tie_after_wrapping(0, 0, how, torch_xla.device())


@pytest.mark.xla
def test_tying_after_wrapping_is_refused_on_xla_devices():
    """Tying after wrapping refused on 2 XLA:CPU devices: the wrapper (per-parameter, flat) and fully_shard."""
    with xla_cpu_devices(2):
        for how in ("wrapper", "flat", "fully_shard"):
            for outcome in run_multiprocess(_xla_tie_after_wrapping, how).values():
                assert "'head.weight' was given the parameter 'emb.weight' after wrapping" in outcome, (how, outcome)


class _ClampsItsWeight(nn.Module):
    """Keeps its weight in [-0.2, 0.2] by clamping it in place in forward (a constraint some models
    enforce so): unsharded, the clamp changes the parameter for good."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)

    def forward(self, x):
        with torch.no_grad():
            self.fc.weight.clamp_(-0.2, 0.2)
        return self.fc(x)


def _clamp_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(_ClampsItsWeight(), nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():
        net[0].fc.weight.mul_(3.0)  # most of it outside the range: the first clamp changes it
    return net


def _clamp_batches(rank: int, world_size: int) -> List[torch.Tensor]:
    return [torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * s + rank)) for s in range(3)]


def _clamp_sharded(rank: int, world_size: int, how: str = "per_param") -> Dict[str, Any]:
    kw = {"flat": {"flatten_parameters": True}, "zero2": {"sharding_strategy": "SHARD_GRAD_OP"}}.get(how, {})
    model = FSDP(nn.Sequential(FSDP(_clamp_net()[0], **kw), *list(_clamp_net())[1:]), **kw)
    losses = _train(model, _clamp_batches(rank, world_size))
    return {"losses": losses, "full": full_state_dict(model, rank0_only=False)}


@pytest.mark.parametrize("how", ["per_param", "zero2"])
def test_a_module_that_edits_its_weight_in_forward_keeps_the_edit(how):
    """A clamp of the weight in forward, 2 gloo ranks. Before: the clamp landed on the gathered copy and was dropped at
    the next gather (the weights came out off by up to 0.29). Now the edit becomes the shards, as
    unsharded. (Flattened on gloo, PyTorch itself refuses the in-place edit of a split view.)"""
    world_size = 2
    results = run_ranks(functools.partial(_clamp_sharded, how=how), world_size)
    reference = _clamp_net()
    batches = [torch.cat([_clamp_batches(r, world_size)[s] for r in range(world_size)]) for s in range(3)]
    want_losses = _train(reference, batches)
    for result in results:
        assert not isinstance(result, str), result
        mean = [sum(r["losses"][s] for r in results) / world_size for s in range(3)]
        assert max(abs(a - b) for a, b in zip(mean, want_losses)) <= 1e-5, (mean, want_losses)
        want = reference.state_dict()
        worst = max((result["full"][k] - want[k]).abs().max().item() for k in want)
        assert worst <= 1e-5, worst


def _xla_clamp_programs(how: str) -> Dict[str, Any]:
    """The clamping model on an XLA device, every rank the same batches: the wrapped program must
    refuse at its first forward; the advised fix (clamp once before training and after each step,
    inside summon_full_params(writeback=True)) must train as the unwrapped clamping model."""
    import torch_xla
    import xla_fsdp

    device = torch_xla.device()

    def wrap(net: nn.Module) -> nn.Module:
        if how == "fully_shard":
            xla_fsdp.fully_shard(net[0])
            return xla_fsdp.fully_shard(net)
        kw = {"flatten_parameters": how == "flat"}
        return FSDP(nn.Sequential(FSDP(net[0], **kw), *list(net)[1:]), **kw)

    with _RNG_LOCK:
        net = _clamp_net().to(device)
    try:
        model = wrap(net)
        refused = "trained: " + str(xla_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), _clamp_batches(0, 1)))
    except RuntimeError as e:
        refused = str(e)
    if how != "per_param":
        return {"refused": refused}

    def clamped_after_each_step(model: nn.Module, inner: nn.Module) -> List[float]:
        def clamp() -> None:
            with FSDP.summon_full_params(model, writeback=True) if isinstance(model, FSDP) else \
                    contextlib.nullcontext(), torch.no_grad():
                inner.fc.weight.clamp_(-0.2, 0.2)
        clamp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for x in _clamp_batches(0, 1):
            losses += xla_steps(model, opt, [x])
            clamp()
        return losses

    with _RNG_LOCK:
        plain = _clamp_net()
    plain[0].forward = lambda x, m=plain[0]: m.fc(x)  # the constraint kept by the loop instead
    plain = plain.to(device)
    with _RNG_LOCK:
        edited = _clamp_net()
    edited[0].forward = lambda x, m=edited[0]: m.fc(x)
    edited = edited.to(device)
    wrapped = FSDP(nn.Sequential(FSDP(edited[0]), *list(edited)[1:]))
    with _RNG_LOCK:
        reference = _clamp_net().to(device)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    return {"refused": refused, "reference": xla_steps(reference, sgd, _clamp_batches(0, 1)),
            "unwrapped_fix": clamped_after_each_step(plain, plain[0]),
            "wrapped_fix": clamped_after_each_step(wrapped, wrapped.module[0].module)}


@pytest.mark.xla
def test_a_module_that_edits_its_weight_in_forward_is_refused_on_xla():
    """A clamp of the weight in forward, on 2 XLA:CPU devices. Before: the clamp wrote through XLA's gathered parameter
    (a broadcast view) to garbage, silently (loss 0.4239 at step 0 where unwrapped gives 0.1494). Now
    the first forward refuses on every rank, naming the parameter and the fix; the fix trains as the
    clamping model does unsharded (1e-6)."""
    with xla_cpu_devices(2):
        for how in ("per_param", "flat", "fully_shard"):
            by_rank = run_multiprocess(_xla_clamp_programs, how)
            for results in by_rank.values():
                assert "'fc.weight' was changed in place during forward" in results["refused"], (how, results)
                assert "summon_full_params(model, writeback=True)" in results["refused"], results["refused"]
                for fix in ("unwrapped_fix", "wrapped_fix") if how == "per_param" else ():
                    worst = max(abs(a - b) for a, b in zip(results[fix], results["reference"]))
                    assert worst <= 1e-6, (how, fix, results)


class _WithNorm(nn.Module):
    """A LayerNorm module called ``LayerNorm`` (BERT's naming), or ``ln`` (GPT-2's: no 'norm' in it)."""

    def __init__(self, norm_name: str = "LayerNorm"):
        super().__init__()
        self.norm_name = norm_name
        self.fc = nn.Linear(6, 8)
        setattr(self, norm_name, nn.LayerNorm(8))
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(getattr(self, self.norm_name)(self.fc(x)))


def _recipe_groups(model: nn.Module, recipe: str, drop_empty: bool = False) -> List[Dict[str, Any]]:
    if recipe == "by_name":  # transformers' rule
        skip = ["bias", "LayerNorm.weight"]
        no_decay = [p for n, p in model.named_parameters() if any(s in n for s in skip)]
    else:  # nanoGPT / timm
        no_decay = [p for p in model.parameters() if p.dim() < 2]
    decay = [p for p in model.parameters() if all(p is not q for q in no_decay)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]] if drop_empty else groups


@pytest.mark.parametrize("drop_empty", [False, True])
@pytest.mark.parametrize("recipe,flat", [("by_name", False), ("by_name", True), ("by_dim", False), ("by_dim", True)])
def test_no_decay_recipes_applied_to_shards_are_refused_at_the_first_step(gloo, recipe, flat, drop_empty):
    """No-decay recipes. Before: by name, LayerNorm weights (names the unit made) got weight decay, and
    flattened nothing was excluded; by dimension (every shard 1-D) no weight was decayed: weights off
    by 6e-4 .. 1.5e-3 after a few steps, silently. The supported way gives the unsharded groups.
    The recipe that drops its empty group (one group left: by name flattened, by
    dimension in both layouts) trained silently wrong; refused too, and a program that decays every
    parameter alike (the optimizer's own weight_decay, one group) is not."""
    torch.manual_seed(0)
    model = FSDP(_WithNorm(), flatten_parameters=flat)
    groups = _recipe_groups(model, recipe, drop_empty)
    opt = torch.optim.AdamW(groups, lr=1e-2)
    model(torch.randn(4, 6)).sum().backward()
    words = "split weight decay by .* applied to the shards" if len(groups) > 1 else \
        (r"set one weight decay \(0(\.1)?\) on every shard, which is what the no-decay recipe by .* gives every "
         r"shard but not every original parameter .* pass weight_decay=0(\.1)? to the optimizer")
    with pytest.raises(RuntimeError, match=words + ".*optimizer_param_groups"):
        opt.step()
    for every_alike in ({"weight_decay": 0.1}, {}):  # decaying every parameter alike is not refused
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **every_alike)
        torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)  # adds initial_lr to the groups
        opt.step()
        opt = torch.optim.AdamW([{"params": list(model.parameters()), "name": "all"}], lr=1e-2, **every_alike)
        opt.step()
    # the HF Trainer's two groups at its default weight_decay=0: one weight decay, set on the groups, decaying none
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": params[:1], "weight_decay": 0.0}, {"params": params[1:], "weight_decay": 0.0}],
                            lr=1e-2)
    opt.step()
    rule = (lambda n: "bias" in n or "LayerNorm.weight" in n) if recipe == "by_name" else \
        (lambda n: "bias" in n or "LayerNorm" in n)  # the 1-D parameters, by name
    torch.manual_seed(0)
    model = FSDP(_WithNorm(), flatten_parameters=flat, flatten_group_fn=(lambda name, p: rule(name)) if flat else None)
    groups = model.optimizer_param_groups(lambda name: {"weight_decay": 0.0} if rule(name) else {})
    opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()  # the supported way passes


@pytest.mark.parametrize("layout", ["param", "dim0"])
def test_groups_built_from_original_names_are_not_refused_where_a_recipe_on_shards_splits_alike(gloo, layout):
    """Groups from model.optimizer_param_groups are by original name, whatever rule made them. Before:
    GPT-2 per-parameter with the rule 'no decay on biases' (ln_*.weight decayed, as the program asked)
    was refused at the first step as the HF Trainer's recipe applied to the shards, which splits the
    shards the same way. The step equals the unsharded model's with the same groups."""
    rule = lambda name: name.endswith("bias")  # noqa: E731
    torch.manual_seed(0)
    plain = _WithNorm("ln")
    torch.manual_seed(0)
    model = FSDP(_WithNorm("ln"), shard_param_on_dim_0=layout == "dim0")
    groups = model.optimizer_param_groups(lambda name: {"weight_decay": 0.0} if rule(name) else {})
    opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.5)
    plain_opt = torch.optim.AdamW([{"params": [p for n, p in plain.named_parameters() if not rule(n)]},
                                   {"params": [p for n, p in plain.named_parameters() if rule(n)],
                                    "weight_decay": 0.0}], lr=1e-2, weight_decay=0.5)
    x = torch.randn(4, 6)
    for m, o in ((model, opt), (plain, plain_opt)):
        for _ in range(2):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    full = full_state_dict(model, rank0_only=False)
    for name, want in plain.state_dict().items():
        torch.testing.assert_close(full[name], want, atol=1e-6, rtol=0, msg=name)


class _InnerCheckpointed(nn.Module):
    """A block that checkpoints part of itself with a reentrant checkpoint of the user's own
    (``fc1`` alone, or its whole MLP), inside ``checkpoint_module``'s checkpoint of the block."""

    def __init__(self, part: str, checkpoint: Callable[..., Any]):
        super().__init__()
        self.part, self.checkpoint = part, checkpoint
        self.mlp = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))

    def forward(self, x):
        if self.part == "fc1":
            return self.mlp[2](torch.tanh(self.checkpoint(self.mlp[0], x))) + x
        return self.checkpoint(self.mlp, x) + x


def _inner_checkpoint_net(part: str, checkpoint: Callable[..., Any], device: Any = "cpu") -> nn.Module:
    """With a gradient hook on the head, outside every checkpoint (registered on the device: moving
    to XLA makes new parameters): flattened with the root, it must not run in the checkpoint's own
    backward pass, which gives the head no gradient."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 6), _InnerCheckpointed(part, checkpoint), nn.Linear(6, 3)).to(device)
    net[2].weight.register_hook(lambda grad: grad * 0.5)
    return net


def _wrap_inner_checkpointed(net: nn.Module, flat: bool) -> nn.Module:
    from xla_fsdp import checkpoint_module
    return FSDP(nn.Sequential(net[0], FSDP(checkpoint_module(net[1]), flatten_parameters=flat), net[2]),
                flatten_parameters=flat)


def _gloo_checkpoint(fn: Callable[..., Any], *args: Any) -> Any:
    import torch.utils.checkpoint
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)


def _inner_checkpoint_sharded(rank: int, world_size: int, part: str, flat: bool) -> List[float]:
    return _train(_wrap_inner_checkpointed(_inner_checkpoint_net(part, _gloo_checkpoint), flat),
                  _clamp_batches(rank, world_size))


@pytest.mark.parametrize("part", ["fc1", "mlp"])
@pytest.mark.parametrize("flat", [True, False])
def test_the_users_reentrant_checkpoint_inside_checkpoint_module(part, flat):
    """On 2 gloo ranks: the user's reentrant torch.utils.checkpoint inside
    FSDP(checkpoint_module(block)) trains as unsharded (the mean of the ranks' losses, 1e-5)."""
    world_size = 2
    results = run_ranks(functools.partial(_inner_checkpoint_sharded, part=part, flat=flat), world_size)
    batches = [torch.cat([_clamp_batches(r, world_size)[s] for r in range(world_size)]) for s in range(3)]
    want = _train(_inner_checkpoint_net(part, _gloo_checkpoint), batches)
    assert all(not isinstance(r, str) for r in results), results
    mean = [sum(r[s] for r in results) / world_size for s in range(3)]
    assert max(abs(a - b) for a, b in zip(mean, want)) <= 1e-5, (mean, want)


def _xla_inner_checkpoint_programs() -> Dict[str, List[float]]:
    import torch_xla
    import torch_xla.utils.checkpoint

    def checkpoint(fn: Callable[..., Any], *args: Any) -> Any:  # PyTorch's own cannot run on XLA (torch.xla)
        return torch_xla.utils.checkpoint.checkpoint(fn, *args)
    # Every model is built (seeded) before either rank thread trains: torch_xla's checkpoint sets the
    # process-wide CPU generator's state in backward (its preserve_rng_state), which a rank thread still
    # drawing a model's initial weights would draw from (a 0.074 loss deviation, once, under load).
    built = {}
    with _RNG_LOCK:
        for part in ("fc1", "mlp"):
            for how in ("unwrapped", "flat", "per_param", "root_flat"):
                built[part, how] = _inner_checkpoint_net(part, checkpoint, torch_xla.device())
    _BUILT.wait(timeout=120)
    results = {}
    for (part, how), net in built.items():
        if how == "root_flat":  # one flat shard: the head's hook and the checkpointed layers in one split
            model = FSDP(net, flatten_parameters=True)
        else:
            model = net if how == "unwrapped" else _wrap_inner_checkpointed(net, how == "flat")
        results[f"{part}_{how}"] = xla_steps(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                             _clamp_batches(0, 1))
    return results


_BUILT = threading.Barrier(2)  # the 2 rank threads of _xla_inner_checkpoint_programs' device process


@pytest.mark.xla
def test_the_users_reentrant_checkpoint_inside_checkpoint_module_on_xla():
    """The user's reentrant checkpoint inside checkpoint_module on 2 XLA:CPU devices (torch_xla's
    reentrant checkpoint, every rank the same batches). Before, flattened with fc1 alone checkpointed:
    the unit reduced and freed its parameters when the outer recompute's backward left fc1 without
    gradient, and the inner recompute then found them freed ('fc1.weight' ... holds no data here). The
    head's gradient hook was called with None in the checkpoint's backward pass (AttributeError on one
    rank, the other aborted in a rendezvous)."""
    with xla_cpu_devices(2):
        by_rank = run_multiprocess(_xla_inner_checkpoint_programs)
    for results in by_rank.values():
        for part in ("fc1", "mlp"):
            for how in ("flat", "per_param", "root_flat"):
                got, want = results[f"{part}_{how}"], results[f"{part}_unwrapped"]
                assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (part, how, got, want)


def _ema_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 3))


def _train_with_ema_teacher(student: nn.Module, teacher: nn.Module, batches: List[torch.Tensor]) -> List[float]:
    """A student regressed on its EMA teacher's outputs (the teacher's forward under no_grad, its
    weights the moving average of the student's, updated after each step)."""
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    losses = []
    for x in batches:
        with torch.no_grad():
            target = teacher(x)
        loss = (student(x) - target + 0.5).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for t, s in zip(teacher.parameters(), student.parameters()):
                t.mul_(0.9).add_(s, alpha=0.1)
        losses.append(loss.item())
    return losses


def _ema_sharded(rank: int, world_size: int, flat: bool, zero2: bool, frozen: bool) -> Dict[str, Any]:
    kw = {"flatten_parameters": flat, "sharding_strategy": "SHARD_GRAD_OP" if zero2 else "FULL_SHARD"}

    def wrap(net: nn.Module) -> nn.Module:
        net[2] = FSDP(net[2], **kw)
        return FSDP(net, **kw)
    # DINO / BYOL freeze the teacher before wrapping it as the student is wrapped
    student, teacher = wrap(_ema_net()), wrap(_ema_net().requires_grad_(not frozen))
    try:
        import copy
        copy.deepcopy(student)
        refused = "copied"
    except TypeError as e:
        refused = str(e)
    return {"losses": _train_with_ema_teacher(student, teacher, _clamp_batches(rank, world_size)),
            "teacher": full_state_dict(teacher, rank0_only=False), "refused": refused}


@pytest.mark.parametrize("flat,zero2,frozen", [(True, True, False), (False, False, False), (True, True, True),
                                               (False, False, True)])
def test_an_ema_teacher_as_a_second_root(flat, zero2, frozen):
    """On 2 gloo ranks: an EMA teacher wrapped as a second root the same way as its
    student (flat ZeRO-2, per-parameter ZeRO-3) trains as unsharded (losses and the teacher's
    weights, 1e-5). Deep-copying the wrapped student (DINO's ``teacher = deepcopy(student)``) is
    refused with the way to do it (before: ``_FlattenFlag.__new__() missing 1 required positional
    argument``). And the teacher frozen before wrapping (flat ZeRO-2: "The size of
    tensor a (23) must match ..." before, its frozen shard held matrices and vectors together)."""
    world_size = 2
    results = run_ranks(functools.partial(_ema_sharded, flat=flat, zero2=zero2, frozen=frozen), world_size)
    batches = [torch.cat([_clamp_batches(r, world_size)[s] for r in range(world_size)]) for s in range(3)]
    teacher = _ema_net()
    want = _train_with_ema_teacher(_ema_net(), teacher, batches)
    assert all(not isinstance(r, str) for r in results), results
    mean = [sum(r["losses"][s] for r in results) / world_size for s in range(3)]
    assert max(abs(a - b) for a, b in zip(mean, want)) <= 1e-5, (mean, want)
    for result in results:
        worst = max((result["teacher"][k] - v).abs().max().item() for k, v in teacher.state_dict().items())
        assert worst <= 1e-5, worst
        assert "cannot be deep-copied" in result["refused"] and "copy.deepcopy(net)" in result["refused"], result


class _Gpt2Like(nn.Module):
    """GPT-2's naming: LayerNorms called ln_1 / ln_f, which the Trainer finds by module type."""

    def __init__(self):
        super().__init__()
        self.fc, self.ln_1, self.mid, self.ln_f, self.out = (nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 8),
                                                             nn.LayerNorm(8), nn.Linear(8, 3))
        with torch.no_grad():
            for ln in (self.ln_1, self.ln_f):
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return self.out(self.ln_f(self.mid(self.ln_1(self.fc(x)))))


def _gpt2_like() -> nn.Module:
    torch.manual_seed(0)
    return _Gpt2Like()


def _trainer_groups(model: nn.Module, decay: List[str]) -> List[Dict[str, Any]]:
    """The two groups transformers' Trainer.create_optimizer builds from its decay names."""
    return [{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.5},
            {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]


def _trainer_recipe_sharded(rank: int, world_size: int) -> Dict[str, Any]:
    from transformers import Trainer
    model = FSDP(_gpt2_like())
    opt = torch.optim.AdamW(_trainer_groups(model, Trainer.get_decay_parameter_names(None, model)), lr=1e-2)
    model(torch.randn(4, 6)).sum().backward()
    try:
        opt.step()
        refused = "stepped"
    except RuntimeError as e:
        refused = str(e)
    net = _gpt2_like()
    decay = Trainer.get_decay_parameter_names(None, net)  # on the unwrapped model, before wrapping
    model = FSDP(net)
    opt = torch.optim.AdamW(_trainer_groups(model, model.shard_names_of(decay)), lr=1e-2)
    losses = []
    for x in _clamp_batches(rank, world_size):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    flat_model = FSDP(_gpt2_like(), flatten_parameters=True)  # flattening keeps matrices and 1-D apart
    flat = {"decayed": flat_model.shard_names_of(decay)}
    try:
        flat_model.shard_names_of(["fc.bias"])  # a rule that cuts through a flattened shard
    except ValueError as e:
        flat["mixed"] = str(e)
    return {"refused": refused, "losses": losses, "full": full_state_dict(model, rank0_only=False), "flat": flat}


def test_the_hf_trainers_decay_groups_on_shards_are_refused_and_shard_names_of_gives_its_groups():
    """No-decay groups on the Hugging Face Trainer's path (its own get_decay_parameter_names, 2 gloo
    ranks). Applied to the wrapped model, its rule decays the LayerNorm weights (found by module
    type, which shards do not have): refused at the first step. The names it gives on the unwrapped
    model, carried over with model.shard_names_of, train as the Trainer's groups unsharded (1e-5)."""
    transformers = pytest.importorskip("transformers", reason="test extra: pip install -e .[test]")
    world_size = 2
    results = run_ranks(_trainer_recipe_sharded, world_size)
    net = _gpt2_like()
    opt = torch.optim.AdamW(_trainer_groups(net, transformers.Trainer.get_decay_parameter_names(None, net)), lr=1e-2)
    want = []
    for s in range(3):
        loss = net(torch.cat([_clamp_batches(r, world_size)[s] for r in range(world_size)])).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    for result in results:
        assert not isinstance(result, str), result
        assert "split weight decay" in result["refused"] and "shard_names_of" in result["refused"], result["refused"]
        assert len(result["flat"]["decayed"]) == 1 and "flat_param_0" in result["flat"]["decayed"][0], result["flat"]
        assert "one flattened shard holds parameters named (['fc.bias'])" in result["flat"]["mixed"], result["flat"]
        worst = max((result["full"][k] - v).abs().max().item() for k, v in net.state_dict().items())
        assert worst <= 1e-5, worst
    mean = [sum(r["losses"][s] for r in results) / world_size for s in range(3)]
    assert max(abs(a - b) for a, b in zip(mean, want)) <= 1e-5, (mean, want)


def _state_dict_options(rank: int, world_size: int) -> Dict[str, Any]:
    from xla_fsdp.checkpoints.files import CheckpointError
    from xla_fsdp.checkpoints.state_dict_api import StateDictOptions, get_model_state_dict, set_model_state_dict
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    net[0].requires_grad_(False)
    model = FSDP(nn.Sequential(FSDP(net[0]), net[1], net[2]))
    full = StateDictOptions(full_state_dict=True)
    state = get_model_state_dict(model, options=full)
    out: Dict[str, Any] = {"keys": sorted(state)}
    out["without_frozen"] = sorted(get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True)))
    for case, given, options in (
            ("unexpected", dict(state, extra=torch.ones(1)), full),
            ("missing", {k: v for k, v in state.items() if k != "2.weight"}, full),
            ("submodules", None, None), ("flatten", state, None)):
        try:
            if case == "submodules":
                get_model_state_dict(model, submodules={net[2]}, options=full)
            elif case == "flatten":
                set_model_state_dict(model, state, options=StateDictOptions(
                    full_state_dict=True, flatten_optimizer_state_dict=True))
            else:
                set_model_state_dict(model, given, options=options)
            out[case] = "no error"
        except CheckpointError as e:
            out[case] = str(e)
    # strict=False: what is there loads, the rest comes back
    changed = {k: v + 1 for k, v in state.items() if k != "2.bias"}
    changed["extra"] = torch.ones(1)
    keys = set_model_state_dict(model, changed, options=StateDictOptions(full_state_dict=True, strict=False))
    out["lenient"] = (keys.missing_keys, keys.unexpected_keys)
    after = get_model_state_dict(model, options=full)
    out["lenient_loaded"] = all(torch.equal(after[k], changed[k]) for k in changed if k != "extra")
    out["lenient_kept"] = torch.equal(after["2.bias"], state["2.bias"])
    # ignore_frozen_params: the frozen layer may be missing, strict or not
    trained = {k: v for k, v in state.items() if not k.startswith("0.")}
    keys = set_model_state_dict(model, trained,
                                options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True))
    out["frozen_missing"] = (keys.missing_keys, keys.unexpected_keys)
    model(torch.ones(2, 6)).sum().backward()
    try:
        model.clip_grad_norm_(1.0, groups=[[0, 1]])  # torch_xla's argument: the norm's replica groups
        out["clip_groups"] = "no error"
    except ValueError as e:
        out["clip_groups"] = str(e)
    return out


def test_state_dict_api_options_are_pytorchs_or_refused_and_clip_groups_too():
    """The state_dict_api's options as PyTorch gives them, on 2 gloo ranks: strict (the default)
    refuses unexpected and missing keys naming them (before: unexpected keys were dropped silently),
    strict=False loads what is there and returns the rest, ignore_frozen_params leaves frozen
    parameters out of get and lets them be missing in set (before: ignored); submodules= and
    flatten_optimizer_state_dict=True are refused (before: ignored); so is clip_grad_norm_(groups=...)
    (before: ignored: the norm spans the model's own groups)."""
    for r in run_ranks(_state_dict_options, 2):
        assert not isinstance(r, str), r
        assert r["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert r["without_frozen"] == ["2.bias", "2.weight"]
        assert "has keys the model does not: ['extra']" in r["unexpected"] and "strict=False" in r["unexpected"]
        assert "lacks ['2.weight']" in r["missing"]
        assert "leave out submodules=" in r["submodules"]
        assert "flatten_optimizer_state_dict" in r["flatten"]
        assert r["lenient"] == (["2.bias"], ["extra"]) and r["lenient_loaded"] and r["lenient_kept"]
        assert r["frozen_missing"] == ([], [])
        assert "leave out groups" in r["clip_groups"]


def _grad_types_around_steps(rank: int, world_size: int) -> Dict[str, Any]:
    """Per optimizer: the type of the shard gradients after ``step()``, and the norm
    ``torch.nn.utils.clip_grad_norm_`` takes after it and inside a pre-hook of the optimizer's own (the first
    step, beside the unsharded model's norm for the same batch: every rank draws the same)."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3)))
    x = torch.randn(4, 6)
    reference(x).sum().backward()
    out: Dict[str, Any] = {"unsharded_norm": float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9))}
    for name, make in (("pre_hook", torch.optim.AdamW), ("AdamW", torch.optim.AdamW),
                       ("subclass", type("MyAdamW", (torch.optim.AdamW,), {}))):
        opt = make(model.parameters(), lr=1e-3)
        in_hook: List[float] = []
        if name == "pre_hook":  # a clip in a hook of its own: it must see gradients whose norms span the ranks
            opt.register_step_pre_hook(functools.partial(_clip_into, model, in_hook))
        model(x).sum().backward()
        opt.step()
        out[name] = {"types": sorted({type(p.grad).__name__ for p in model.parameters()}),
                     "norm_after": float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)),
                     "norm_in_hook": in_hook}
        opt.zero_grad()
    return out


def _clip_into(model: nn.Module, norms: List[float], *_: Any) -> None:
    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))


def test_norms_of_shard_gradients_span_the_ranks_in_and_after_an_optimizer_step():
    """Shard gradients stay ShardGrads through an optimizer's step (AdamW, a subclass of it, one with a
    pre-hook of its own: a clip there), so a norm taken in the hook is the unsharded model's (1e-5), and
    the one after the step is the same on both ranks."""
    results = run_ranks(_grad_types_around_steps, 2)
    for r in results:
        assert not isinstance(r, str), r
        assert all(r[name]["types"] == ["ShardGrad"] for name in ("pre_hook", "AdamW", "subclass"))
        assert r["pre_hook"]["norm_in_hook"] == pytest.approx([r["unsharded_norm"]], rel=1e-5)
    for name in ("pre_hook", "AdamW", "subclass"):
        assert results[0][name]["norm_after"] == results[1][name]["norm_after"]


class _TinyLm(nn.Module):
    def __init__(self, tie: bool):
        super().__init__()
        self.wte, self.mid, self.head = nn.Embedding(11, 6), nn.Linear(6, 6), nn.Linear(6, 11, bias=False)
        if tie:
            self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.wte(ids))))


def _tiny_lm(tie: bool, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return _TinyLm(tie)


def _untied_checkpoint_into_tied_model(rank: int, world_size: int, folder: str, flat: bool) -> Dict[str, Any]:
    import xla_fsdp
    saved = FSDP(_tiny_lm(False, 0), flatten_parameters=flat)  # head and wte separate: two values
    xla_fsdp.save_sharded_checkpoint(saved, None, os.path.join(folder, "untied"))
    tied = FSDP(_tiny_lm(True, 1), flatten_parameters=flat)
    xla_fsdp.load_sharded_checkpoint(tied, None, os.path.join(folder, "untied"))
    ids = torch.arange(8).reshape(2, 4)
    return {"state": full_state_dict(tied, rank0_only=False), "out": tied(ids).detach()}


@pytest.mark.parametrize("flat", [False, True])
def test_a_checkpoint_saved_untied_loads_into_a_tied_model_as_pytorch_loads_it(tmp_path, flat):
    """Rank files holding head.weight and wte.weight apart, loaded into the model
    that ties them: load_state_dict on the plain model keeps head.weight (the later name in module
    order wins); the shards kept wte's value instead (eval loss 9.3643 against 3.5981)."""
    folder = str(tmp_path)
    results = run_ranks(functools.partial(_untied_checkpoint_into_tied_model, folder=folder, flat=flat), 2)
    assert all(not isinstance(r, str) for r in results), results
    plain = _tiny_lm(True, 1)
    plain.load_state_dict(_tiny_lm(False, 0).state_dict())
    want_out = plain(torch.arange(8).reshape(2, 4)).detach()
    assert torch.equal(plain.head.weight, _tiny_lm(False, 0).head.weight)
    for r in results:
        for name, value in plain.state_dict().items():
            assert torch.equal(r["state"][name], value), name
        torch.testing.assert_close(r["out"], want_out, rtol=0, atol=1e-6)


def _moved_then_wrapped(me) -> Dict[str, Any]:
    """A tied LM wrapped after ``.to(xla_device)`` and wrapped on the CPU: the warnings, and whether
    the head is still the embedding after a step."""
    import warnings
    out: Dict[str, Any] = {}
    for where in ("moved", "cpu"):
        model = _tiny_lm(True, 0)
        if where == "moved":
            model = model.to(me.device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapped = FSDP(model)
        out[where] = [str(w.message) for w in caught if "xla_fsdp" in str(w.message)]
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.5)
        wrapped(torch.arange(8).reshape(2, 4).to(me.device)).sum().backward()
        opt.step()
        me.sync()
        state = full_state_dict(wrapped, rank0_only=False)
        out[f"{where}_tied"] = torch.equal(state["head.weight"], state["wte.weight"])
    return out


@pytest.mark.xla
def test_a_tied_model_moved_to_xla_before_wrapping_is_said_to_be_untied():
    """Before: ``FSDP(model.to(xla_device))`` of a GPT whose head is its embedding
    trained two matrices without a word (torch_xla's ``.to`` gives each module a new tensor; only a
    Hugging Face config's tie was checked). Now the wrapper names both and gives the fix; wrapped on
    the CPU the tie is kept through a step."""
    from ranks import on_xla
    (out,) = on_xla(_moved_then_wrapped, 1)
    assert len(out["moved"]) == 1, out
    assert "'head.weight' and 'wte.weight' hold the same values but are two parameters" in out["moved"][0], out
    assert "Wrap the model on the CPU" in out["moved"][0] and "model.head.weight = model.wte.weight" in out["moved"][0]
    assert out["moved_tied"] is False  # what the warning is about
    assert out["cpu"] == [] and out["cpu_tied"] is True, out
