"""Sharded training on real ranks == the same model trained unsharded in one process.

For each transport (gloo processes; XLA:CPU devices as threads of one process) and world size
1, 2 and 4, every configuration in harness.CONFIGS trains 5 optimizer steps; losses, final
parameters (consolidated from the shards), gradient norms and per-rank bytes are compared with an
unsharded reference fed the same global batch. Tolerance: 1e-5 absolute (fp32).
"""
import pytest
import torch

import harness

TOL = 1e-5
TRANSPORTS = ["torch", "xla"]
WORLD_SIZES = [1, 2, 4]
_CACHE = {}
DEVIATIONS = {}  # transport -> largest |loss diff|, |param diff| seen (printed at the end of the run)
BYTES = []  # (transport, world size, config, max per-rank bytes, ideal bytes, padding bytes)


def _record(transport, kind, value):
    worst = DEVIATIONS.setdefault(transport, {"loss": 0.0, "param": 0.0})
    worst[kind] = max(worst[kind], value)


EQUIVALENCE = harness.EQUIVALENCE


def results(transport, world_size):
    """Every config's run at this (transport, world size): one launch per session, all configs inside."""
    return harness.session_run(transport, world_size)[0]


def _reference(name, world_size):
    key = ("ref", name, world_size)
    if key not in _CACHE:
        _CACHE[key] = harness.train_reference(name, world_size)
    return _CACHE[key]


@pytest.mark.parametrize("name", EQUIVALENCE)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_matches_unsharded(transport, world_size, name):
    _check_against_unsharded(transport, world_size, name, results(transport, world_size)[name])


#: the fast loop's equivalence check (make test-fast): the default layout and the flat one
FAST_CONFIGS = ["zero3_nested_adamw", "flatten_nested_adamw"]


@pytest.mark.fast
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_configs_launched_alone_match_unsharded(transport):
    """Two configs in a launch of their own at world size 2 (the session run trains every config in
    one process, which could hide what a config needs from the ones before it)."""
    run = harness.run_gloo if transport == "torch" else harness.run_xla
    launched = run(FAST_CONFIGS, 2)
    for name in FAST_CONFIGS:
        _check_against_unsharded(transport, 2, name, launched[name])


def _check_against_unsharded(transport, world_size, name, ranks):
    ref = _reference(name, world_size)
    tol = harness.CONFIGS[name].get("tol", TOL)
    losses = [sum(r["losses"][s] for r in ranks) / world_size for s in range(harness.STEPS)]
    assert len(losses) >= 5
    loss_dev = max(abs(a - b) for a, b in zip(losses, ref["losses"]))
    _record(transport, "loss", loss_dev)
    assert loss_dev <= tol, (losses, ref["losses"])
    full = harness.consolidate(ranks)
    assert set(full) == set(ref["state_dict"])
    for key, want in ref["state_dict"].items():
        got = full[key]
        assert got.shape == want.shape and got.dtype == want.dtype, key
        if "running_" in key or "num_batches" in key:
            continue  # BatchNorm statistics are per rank by design (like DDP)
        param_dev = (got - want).abs().max().item()
        _record(transport, "param", param_dev)
        assert param_dev <= tol, key
    if harness.CONFIGS[name].get("clip"):
        for r in ranks:
            assert max(abs(a - b) for a, b in zip(r["norms"], ref["norms"])) <= TOL
    if harness.CONFIGS[name].get("check_freed") or harness.CONFIGS[name].get("check_kept"):
        # ZeRO-3: after every forward, nested units hold no full parameters; ZeRO-2/NO_SHARD: they
        # keep them for backward.
        for r in ranks:
            assert all(r["freed_after_forward"]) and len(r["freed_after_forward"]) == harness.STEPS


@pytest.mark.parametrize("world_size", [2, 4])
def test_units_mix_solo_and_shared_collectives(world_size):
    """The config that checks the mixed path really takes it: on gloo every unit gathers and reduces
    its matrices alone and its small vectors together (its equivalence is checked above)."""
    for r in results("torch", world_size)["coalesce_mixed_lm_adamw"]:
        assert r["collective_split"] and all(solo >= 1 and shared >= 2 for solo, shared in r["collective_split"])


OPT_STATE_COPIES = {"sgd": 1, "adamw": 2, "adamw_groups": 2}  # momentum; exp_avg + exp_avg_sq
# Ranks a parameter is split over, per strategy, at world size N (hybrid: pairs of ranks).
SHARD_SIZE = {"strategy_no_shard_adamw": lambda n: 1, "strategy_hybrid_adamw": lambda n: min(2, n),
              "strategy_hybrid_zero2_flat_sgd": lambda n: min(2, n)}


@pytest.mark.parametrize("name", ["zero3_nested_adamw", "flatten_nested_adamw", "autowrap_type_lm_adamw",
                                  "dim0_nested_sgd", "zero2_root_sgd", "strategy_full_shard_adamw",
                                  "strategy_shard_grad_op_adamw", "strategy_no_shard_adamw",
                                  "strategy_hybrid_adamw", "strategy_hybrid_zero2_flat_sgd"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_per_rank_bytes_are_one_nth(transport, world_size, name):
    """params + grads + optimizer state per rank <= 1.02 x ideal/S + padding (+ AdamW step scalars),
    S the strategy's shard group size: N (FULL_SHARD, SHARD_GRAD_OP), 1 (NO_SHARD), 2 (hybrid 2xN/2)."""
    ranks = results(transport, world_size)[name]
    cfg = harness.CONFIGS[name]
    shard_size = SHARD_SIZE.get(name, lambda n: n)(world_size)
    assert {r["metadata"]["world_size"] for r in ranks} == {shard_size}
    copies = 2 + OPT_STATE_COPIES[cfg["opt"]]
    ideal = _reference(name, world_size)["param_bytes"] * copies / shard_size
    layout = ranks[0]["metadata"]["layout"]
    padding = sum(info["padded_numel"] - sum(torch.Size(s).numel() for s in info["shapes"])
                  for info in layout.values())
    padding_bytes = 4 * copies * padding / shard_size
    step_scalars = 4 * len(layout) if cfg["opt"] == "adamw" else 0
    BYTES.append((transport, world_size, name, max(r["state_bytes"] for r in ranks), ideal, padding_bytes))
    for r in ranks:
        assert r["state_bytes"] <= 1.02 * ideal + padding_bytes + step_scalars, (r["state_bytes"], ideal)
        assert r["state_bytes"] >= ideal  # sanity: the measurement counts real state
