"""Sharded training equals unsharded training on randomly drawn programs (see differential.py),
and the regressions differential testing found stay fixed.

CI draws a fixed list (hypothesis, derandomized). ``XLA_FSDP_DIFF_PROFILE=nightly`` draws ten
times as many programs; ``XLA_FSDP_DIFF_SEED=N`` draws another list.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings

import cpu_kernels
from differential import NOT_APPLICABLE, Program, compare, fully_shard_programs, programs, refused
from ranks import GlooPool
from training_program import on_rank, reference, run_sharded

NIGHTLY = os.environ.get("XLA_FSDP_DIFF_PROFILE") == "nightly"
SCALE = 10 if NIGHTLY else 1
SEED = os.environ.get("XLA_FSDP_DIFF_SEED")
EXAMPLES = {1: 30 * SCALE, 2: 80 * SCALE, 4: 40 * SCALE}
XLA_EXAMPLES = 8 * SCALE
FULLY_SHARD_EXAMPLES = 6 * SCALE  # drawn FSDP2-style programs (xla_fsdp.fully_shard), XLA only
DEVIATIONS: dict = {}
REFUSED: list = []  # drawn recipes refused at their first step, as they must be


@pytest.fixture(scope="module")
def ranks():
    pools = {ws: GlooPool(on_rank, ws) for ws in (1, 2, 4)}
    yield pools
    for pool in pools.values():
        pool.close()


def _given(strategy, examples: int):
    """hypothesis' ``given`` with this suite's settings: a fixed list unless a seed is asked for."""
    def decorate(fn):
        # No shrinking in CI: a failing program prints whole, and a hang would be retried per step.
        phases = list(Phase) if NIGHTLY else [Phase.explicit, Phase.reuse, Phase.generate]
        fn = settings(max_examples=examples, deadline=None, database=None, derandomize=SEED is None,
                      suppress_health_check=list(HealthCheck), print_blob=True, phases=phases)(given(strategy)(fn))
        return seed(int(SEED))(fn) if SEED is not None else fn
    return decorate


def _check(program: Program, world_size: int, sharded, transport: str = "gloo") -> None:
    if refused(program, sharded):
        REFUSED.append(program)
        return
    worst = compare(program, sharded, reference(program, world_size, told=sharded[0]))
    key = (transport, world_size, program.dtype)
    DEVIATIONS[key] = max(DEVIATIONS.get(key, 0.0), worst)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_random_programs_match_unsharded_on_gloo(ranks, world_size, record_property):
    count, before = [], {reason: set(drawn) for reason, drawn in NOT_APPLICABLE.items()}

    @_given(programs(world_size), EXAMPLES[world_size])
    def check(program):
        count.append(program)
        _check(program, world_size, ranks[world_size].run(program))

    check()
    assert len(count) >= EXAMPLES[world_size] // 2, f"only {len(count)} programs ran"
    _report_not_applicable(record_property, before)


def _report_not_applicable(record_property, before) -> None:
    """The programs this test drew that need a kernel this CPU lacks (differential.runs_here), for the
    session's summary (conftest prints them): not run, not passed, replaced by other draws."""
    for reason, drawn in NOT_APPLICABLE.items():
        new = len(drawn - before.get(reason, set()))
        if new:
            record_property("not_applicable_here", {"reason": f"{reason} ({cpu_kernels.cpu_description()})",
                                                    "programs": new})


def _draw(strategy, n: int):
    drawn = []

    @_given(strategy, n)
    def collect(program):
        drawn.append(program)

    collect()
    return drawn[:n]


# Programs each differential failure came from, fixed: every one fails on the code
# before its fix (on the transports named). Only the 0-d parameter programs have one (``scalar``).
REGRESSIONS = {
    # 1: a load after a forward that had no backward was ignored (the units it left gathered kept
    #    their old full copy): root-only, nested ZeRO-3, ZeRO-2, NO_SHARD with bf16.
    "load_after_forward_root": Program(
        scalar=False, wrap="root", reload=True, eval_before_reload=True, optimizer="adamw"
    ),
    "load_after_forward_nested": Program(scalar=False, reload=True, eval_before_reload=True),
    "load_after_forward_zero2": Program(scalar=False, strategy="SHARD_GRAD_OP", reload=True, eval_before_reload=True),
    "load_after_forward_no_shard_bf16": Program(
        scalar=False, strategy="NO_SHARD", dtype="bf16", reload=True, eval_before_reload=True
    ),
    # 3: a layer used on some ranks only in a step (per-parameter layout) aborted the collectives.
    "branch_on_some_ranks": Program(scalar=False, branch="ranks", optimizer="adamw", steps=4),
    "branch_on_some_ranks_root_zero2": Program(
        scalar=False, branch="ranks", wrap="root", strategy="SHARD_GRAD_OP", steps=4
    ),
    "branch_on_some_ranks_no_shard": Program(scalar=False, branch="ranks", strategy="NO_SHARD", steps=4),
    # 2: a flat shard of its own (the branch's unit) unused on every rank keeps no gradient.
    "flat_branch_unit_unused": Program(scalar=False, layout="flat", branch="steps", optimizer="adamw", steps=4),
    # 4: a 0-d parameter's optimizer state did not survive full_optim_state_dict -> load.
    "scalar_optim_round_trip": Program(scalar=True, reload=True, optimizer="adamw"),
    "scalar_optim_round_trip_flat": Program(scalar=True, reload=True, optimizer="adamw", layout="flat", wrap="root"),
    # 5: a unit run twice in one forward, with activation checkpointing (XLA), and without.
    "twice_remat": Program(scalar=False, twice=True, remat=True),
    "twice": Program(scalar=False, twice=True),
    "twice_flat": Program(scalar=False, twice=True, layout="flat"),
    # 7 (the HF Trainer's GPT-2 at 2 XLA:CPU devices): a parameter freed, then refilled for
    #    backward, kept the placeholder's 1-D strides under 2-D sizes; addmm's backward (GPT-2's Conv1D)
    #    failed on it (XLA only).
    "addmm_nested": Program(scalar=False, addmm=True),
    # 8 (found by drawing GPT-2's Conv1D): flat layout + activation checkpointing: the
    #    backward re-gather made grad-less views, and torch's checkpoint saw 7 tensors instead of 8
    #    (gloo only; XLA uses torch_xla's reentrant checkpoint).
    "remat_flat_addmm": Program(scalar=False, layout="flat", remat=True, addmm=True),
    # 9 (the Trainer's GPT-2 with size wrap + grad checkpointing): a tied weight its parent
    #    owns, used inside torch_xla's reentrant checkpoint, got gradient in two backward passes; the
    #    first freed it under the second (XLA). Both uses checkpointed (blocks); a later root-level
    #    use first, then the block's recompute read the freed weight (late); flat: a false warning.
    "tied_blocks_remat": Program(scalar=False, tied="blocks", wrap="auto", remat=True),
    "tied_late_remat": Program(scalar=False, tied="late", wrap="auto", remat=True),
    "tied_late_remat_flat": Program(scalar=False, tied="late", wrap="auto", remat=True, layout="flat"),
    # 10: the name of a tied weight in optimizer state is named_parameters()'s first, not the owner's.
    "tied_late_root": Program(scalar=False, tied="late", wrap="auto", optimizer="adamw"),
    # 6: frozen layer + flat + optimizer groups by name: the suggested fix kept failing.
    "frozen_flat_name_groups": Program(scalar=False, frozen=True, layout="flat", optimizer="adamw_groups", wrap="root"),
    # Programs users write (each failed before its fix, on gloo; test names in the note):
    # 1: requires_grad changed after wrapping was ignored (a frozen layer moved, an unfrozen one never trained)
    "freeze_mid_run": Program(scalar=False, toggle="freeze", optimizer="adamw"),
    "freeze_mid_run_flat_root": Program(scalar=False, toggle="freeze", layout="flat", wrap="root"),
    "unfreeze_mid_run": Program(scalar=False, frozen=True, toggle="unfreeze", optimizer="adamw"),
    "unfreeze_mid_run_flat_zero2": Program(scalar=False, frozen=True, toggle="unfreeze", layout="flat",
                                           strategy="SHARD_GRAD_OP"),
    # 2: torch.nn.utils.clip_grad_norm_(model.parameters()) clipped each rank by its own shard's norm
    "torch_clip": Program(scalar=False, clip=0.05, clip_by="torch"),
    "torch_clip_flat_dim0": Program(scalar=True, clip=0.05, clip_by="torch", layout="dim0", optimizer="adamw"),
    # 3: GradScaler: an inf in one rank's block made that rank alone skip the step and halve its scale
    "scaler_overflow_on_one_rank": Program(scalar=False, scaler=True),
    "scaler_overflow_flat_clip": Program(scalar=False, scaler=True, layout="flat", clip=0.05, clip_by="torch"),
    # 5: a gradient hook registered before wrapping was dropped (masked rows moved)
    "hook_before_wrap": Program(scalar=False, hook=True, embedding=True),
    "hook_before_wrap_flat": Program(scalar=False, hook=True, layout="flat", wrap="root"),
    # 6: a dataclass output: the root's last reduce-scatter was never waited for; a nested ZeRO-3 unit crashed
    "dataclass_output_root": Program(scalar=False, output="dataclass", wrap="root"),
    "dataclass_output_nested": Program(scalar=False, output="dataclass"),
    "dict_output_flat_bf16": Program(scalar=False, output="dict", layout="flat", dtype="bf16"),
    # 1 with offload: AdamW's step count moved for a frozen host shard
    "freeze_mid_run_offload": Program(scalar=False, toggle="freeze", optimizer="adamw", offload=True),
    # 9: model.apply(init_fn) after wrapping killed every rank (SIGSEGV writing into a freed parameter)
    "reinit_after_wrap": Program(scalar=False, reinit=True),
    "reinit_after_wrap_flat_root": Program(scalar=False, reinit=True, layout="flat", wrap="root"),
    "reinit_after_wrap_dim0_zero2_tied": Program(scalar=False, reinit=True, layout="dim0", strategy="SHARD_GRAD_OP",
                                                 tied="late", wrap="auto"),
    # 10: nn.LSTM in a flat shard crashed at the first forward ('NoneType' object has no attribute 'dtype')
    "lstm_flat_root": Program(scalar=False, rnn=True, layout="flat", wrap="root"),
    "lstm_auto_unit": Program(scalar=False, rnn=True, wrap="auto", optimizer="adamw"),
    # Once an open bug, now fixed: on XLA, bf16 with checkpoint_module around GPT-2's addmm layer failed XLA's HLO
    # verifier at the recompute (a bf16 LayerNorm weight re-gathered in backward was f32 in torch_xla's IR:
    # the collective order link added a 0-d f32 tensor to the bf16 shard); fp32, or no recompute, trained
    "bf16_recompute_addmm": Program(wrap="nested", layout="param", dtype="bf16", remat=True, addmm=True,
                                    scalar=False),
}


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_regression_on_gloo(ranks, name):
    _check(REGRESSIONS[name], 2, ranks[2].run(REGRESSIONS[name]))


@pytest.mark.parametrize("name", ["branch_on_some_ranks", "load_after_forward_nested", "twice_flat"])
def test_regression_on_gloo_world_size_4(ranks, name):
    _check(REGRESSIONS[name], 4, ranks[4].run(REGRESSIONS[name]))


# Every no-decay recipe form as programs write it on the wrapped model (one group or two, by name
# or by dimension, each layout) and the EMA teacher frozen before wrapping, on 2 gloo ranks. Each run checks
# its own outcome: refused at the first step exactly where the recipe splits the originals otherwise
# (differential.recipe_splits_otherwise), equal to unsharded training everywhere else.
RECIPES = {f"{layout}_{recipe}_{groups}": Program(scalar=True, layout=layout, optimizer="adamw_groups", recipe=recipe,
                                                  drop_empty=groups == "drop_empty", wrap="auto")
           for layout in ("param", "flat", "dim0") for recipe in ("name", "dim") for groups in ("two", "drop_empty")}
TEACHERS = {f"{layout}_{strategy}{'_frozen_layer' if frozen else ''}": Program(
    scalar=True, layout=layout, strategy=strategy, teacher=True, frozen=frozen, optimizer="adamw", wrap="auto")
    for layout in ("param", "flat", "dim0") for strategy in ("FULL_SHARD", "SHARD_GRAD_OP") for frozen in (False, True)}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_no_decay_recipe_on_shards_is_exact_or_refused_at_the_first_step(ranks, name):
    _check(RECIPES[name], 2, ranks[2].run(RECIPES[name]))


def test_the_recipe_forms_include_refused_and_exact_ones(ranks):
    """The oracle is not one-sided: of the recipe forms, flattened ones are refused, dim-0 by dimension is exact."""
    outcomes = {name: refused(RECIPES[name], ranks[2].run(RECIPES[name]))
                for name in ("flat_name_two", "dim0_dim_drop_empty")}
    assert outcomes == {"flat_name_two": True, "dim0_dim_drop_empty": False}


@pytest.mark.parametrize("name", sorted(TEACHERS))
def test_an_ema_teacher_frozen_before_wrapping_trains_as_unsharded(ranks, name):
    _check(TEACHERS[name], 2, ranks[2].run(TEACHERS[name]))


def _xla_exact(p: Program) -> bool:
    """XLA:CPU fuses fp32 arithmetic differently from eager, and BatchNorm over 3 samples amplifies
    that rounding beyond the 2e-5 tolerance: two programs drawn once the user-program dimensions were
    added (dim-0, BatchNorm, a unit run twice, tied, no_sync) were off by 1.6e-4 in a loss (AdamW;
    6.4e-6 with SGD) and by 9.2e-5 in an SGD momentum buffer, on main before those dimensions as well, and
    pass on gloo. So XLA draws no BatchNorm here; test_equivalence's convbn configs cover it on XLA.
    Nor a weight clamped in forward: on XLA that is refused (test_user_programs covers the error)."""
    return not p.batchnorm and not p.clamp and not _known_xla_deviation(p)


def _known_xla_deviation(p: Program) -> bool:
    """Open bug (found by this suite's draws): on XLA under autocast, a weight tied to a later
    layer and used inside the program's own torch_xla reentrant checkpoint ends with a momentum buffer
    0.23-0.33 from unsharded (bf16 bound 0.1), in every layout and strategy; without autocast, the tie or
    the inner checkpoint it is exact, and on gloo it is within 6e-3. Kept out of the draws and pinned
    by test_known_xla_deviation_autocast_tied_inner_checkpoint (strict xfail) until fixed."""
    return p.autocast and p.tied != "none" and p.inner_ckpt


KNOWN_XLA = {"autocast_tied_inner_ckpt": Program(scalar=False, tied="late", wrap="auto", inner_ckpt=True,
                                                 autocast=True, layout="dim0", strategy="SHARD_GRAD_OP")}


@pytest.fixture(scope="module")
def xla_results():
    """The regressions and drawn lists of programs (the wrapper's, FSDP2-style), in one launch of 2
    XLA:CPU devices."""
    drawn = _draw(programs(2, "xla").filter(_xla_exact), XLA_EXAMPLES)
    fsdp2 = _draw(fully_shard_programs(2).filter(_xla_exact), FULLY_SHARD_EXAMPLES)
    listed = list(REGRESSIONS.values()) + drawn + fsdp2 + list(KNOWN_XLA.values())
    names = (list(REGRESSIONS) + [f"drawn{i}" for i in range(len(drawn))]
             + [f"fully_shard{i}" for i in range(len(fsdp2))] + list(KNOWN_XLA))
    return dict(zip(names, zip(listed, run_sharded(listed, 2, "xla", keep_errors=True))))


@pytest.mark.xla
@pytest.mark.parametrize("name", sorted(REGRESSIONS) + [f"drawn{i}" for i in range(XLA_EXAMPLES)]
                         + [f"fully_shard{i}" for i in range(FULLY_SHARD_EXAMPLES)])
def test_on_xla_cpu(xla_results, name):
    program, sharded = xla_results[name]
    errors = [r for r in sharded if isinstance(r, str)]
    assert not errors, f"{name}: {errors[0]} ({program})"
    _check(program, 2, sharded, "xla")


@pytest.mark.xla
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="open bug: see _known_xla_deviation")
def test_known_xla_deviation_autocast_tied_inner_checkpoint(xla_results):
    program, sharded = xla_results["autocast_tied_inner_ckpt"]
    errors = [r for r in sharded if isinstance(r, str)]
    if errors:  # not the deviation this pins
        raise RuntimeError(errors[0])
    _check(program, 2, sharded, "xla")


def test_a_partly_used_flat_shard_warns_once_naming_the_parameter(ranks):
    # The branch shares the root's flat shards with layers that are used: the optimizer steps
    # the whole flat tensor, so this cannot match unsharded training; it must say so.
    program = Program(layout="flat", wrap="root", branch="none", optimizer="adamw")
    sharded = ranks[2].run(program)
    for rank_result in sharded:
        text = " ".join(rank_result["warnings"])
        assert "'branch.weight'" in text and "'branch.bias'" in text and "on any rank" in text
        assert "flatten_parameters=False" in text and "flatten_group_fn" in text
        assert len(rank_result["warnings"]) == 2  # once per parameter, not once per step
    with pytest.raises(AssertionError, match="branch"):
        compare(program, [dict(r, warnings=[]) for r in sharded], reference(program, 2))


@pytest.mark.fast
def test_self_test_a_summed_reduction_fails(ranks):
    """The differential check must catch a wrong reduction (sum over ranks instead of mean)."""
    program = Program(wrong_reduction=True)
    with pytest.raises(AssertionError, match="deviation"):
        compare(program, ranks[2].run(program), reference(program, 2))
    compare(Program(), ranks[2].run(Program()), reference(Program(), 2))  # the same, right, passes
