"""Public API behaviour, misuse errors and the torch_xla defects fixed here (single rank)."""
import copy
import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import harness
import models
import ranks
from ranks import end_process_group
from xla_fsdp import XlaFullyShardedDataParallel as FSDP, checkpoint_module
from xla_fsdp.collectives import select_collectives
from xla_fsdp.unit.member_slots import FreedParameter
from xla_fsdp.checkpoints.shard_merge import consolidate_sharded_state_dicts
from xla_fsdp.wrap import enable_wrap, size_based_auto_wrap_policy, wrap


def test_no_backend_initialized_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    if dist.is_initialized():
        pytest.skip("needs no process group")  # ordering guard: runs before the gloo fixture
    with pytest.raises(RuntimeError, match="no collective backend is initialized"):
        select_collectives()


@pytest.mark.fast
def test_misuse_errors(gloo):
    with pytest.raises(RuntimeError, match="already wrapped"):
        FSDP(FSDP(nn.Linear(2, 2)))
    with pytest.raises(RuntimeError, match="ModuleList has no forward"):
        FSDP(nn.ModuleList([nn.Linear(2, 2)]))
    m = nn.Linear(2, 2)
    m.register_parameter("counts", nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False))
    with pytest.raises(TypeError, match="'counts' has dtype torch.int64.*buffers"):
        FSDP(m)
    with pytest.raises(TypeError, match=r"float64; parameters are sharded as float32, bfloat16 or float16.*\.float"):
        FSDP(nn.Linear(2, 2).double())
    with pytest.raises(ValueError, match="give all three or none"):
        FSDP(nn.Linear(2, 2), sharding_groups=[[0]])
    with pytest.raises(ValueError, match="runs real collectives"):
        FSDP(nn.Linear(2, 2), _debug_dummy_all_gather_op=True)
    with pytest.raises(ValueError, match="unknown transport"):
        FSDP(nn.Linear(2, 2), transport="mpi")


@pytest.mark.parametrize("nested", [False, True])
def test_an_optimizer_built_before_wrapping_is_an_error_not_a_silent_no_op(gloo, nested):
    """Before: no error, and every step() changed nothing (the originals had been emptied)."""
    torch.manual_seed(0)
    model = models.MLP()
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    if nested:
        model.fc1 = FSDP(model.fc1)
    wrapped = FSDP(model)
    wrapped(torch.randn(2, 12)).sum().backward()
    with pytest.raises(
        RuntimeError, match=r"SGD was built before the model was wrapped: \d+ of its \d+ .*after wrapping"
    ):
        early.step()
    late = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    before = [p.detach().clone() for p in wrapped.parameters()]
    late.step()
    assert all(not torch.equal(p, b) for p, b in zip(wrapped.parameters(), before))


def test_tied_across_units_is_rejected(gloo):
    model = models.TiedMLP()
    model.inp = FSDP(model.inp)
    with pytest.raises(RuntimeError, match="shared with another FSDP unit"):
        FSDP(model)


def test_tied_across_auto_wrapped_units_goes_to_their_closest_common_unit(gloo):
    """GPT-2's tie under a policy that wraps the embedding and the head apart: the root owns the
    shared weight (both names), the head unit keeps only its bias, the embedding unit nothing.
    (Training equals unsharded: harness config tied_across_units_*.)"""
    import harness
    model = harness.CONFIGS["tied_across_units_adamw"]["wrap"](models.make_model("lm_tied"))
    root_groups = [g for g in model.gather_groups if "emb.weight" in g.names]
    assert len(root_groups) == 1 and root_groups[0].refs[0].aliases == ["head.weight"]
    assert model.module.emb.gather_groups == [] and [g.names for g in model.module.head.gather_groups] == [["bias"]]
    names = [n for n, _ in model.get_original_names_and_sharded_parameters()]
    assert names.count("emb.weight") == 1 and "head.weight" not in names


def test_mark_step_on_finalization_is_a_deprecated_alias(gloo):
    with pytest.warns(DeprecationWarning, match="sync_on_finalization"):
        m = FSDP(nn.Linear(2, 2), mark_step_on_finalization=True)
    assert m.sync_on_finalization is True


def test_auto_wrap_passes_every_keyword_to_children(gloo):
    model = models.MLP()
    root = FSDP(model, auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=100),
                flatten_parameters=True, reduce_scatter_bucket_size_mb=25, coalesce_all_gather_ops=True,
                fp32_reduce_scatter=True, reshard_after_forward=False)
    children = [m for m in root.modules() if isinstance(m, FSDP) and m is not root]
    assert len(children) >= 2
    for child in children:
        assert child._fsdp_kwargs == root._fsdp_kwargs


def test_enable_wrap_context(gloo):
    with enable_wrap(flatten_parameters=True):
        layer = wrap(nn.Linear(3, 3))
    assert isinstance(layer, FSDP) and layer.flatten_parameters
    assert not isinstance(wrap(nn.Linear(3, 3)), FSDP)


def test_original_names_for_nested_units(gloo):
    model = models.ConvBN()
    root = FSDP(model, auto_wrap_policy=functools.partial(
        harness.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, (nn.Conv2d, nn.Linear))))
    names = [n for n, _ in root.get_original_names_and_sharded_parameters()]
    assert sorted(names) == sorted(n for n, _ in models.ConvBN().named_parameters())


def test_bf16_compute_with_conv2d_and_buffers(gloo):
    """torch_xla defect: bf16 compute with an unflattened Conv2d failed on a dtype mismatch."""
    torch.manual_seed(0)
    model = models.ConvBN()
    wrapped = FSDP(model, compute_dtype=torch.bfloat16)  # buffers follow: bf16
    x, y = models.batch("convbn", 0, 0)
    out = wrapped(x)
    assert out.dtype == torch.bfloat16
    loss = models.loss_fn("convbn", out, y)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in wrapped.parameters())
    torch.manual_seed(0)
    ref = models.ConvBN()
    meta = wrapped.get_shard_metadata()["buffer_info"]
    assert meta["_fsdp_wrapped_module.bn1.running_mean"]["_orig_dtype"] == torch.float32
    assert abs(loss.item() - models.loss_fn("convbn", ref(x), y).item()) < 0.05  # bf16 vs fp32


def test_submodule_used_only_in_forward(gloo):
    """torch_xla#4670: a unit whose output gets no gradient must not break the next step."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = FSDP(nn.Linear(4, 4))
            self.aux = FSDP(nn.Linear(4, 4))

        def forward(self, x):
            with torch.no_grad():
                self.aux(x)
            return self.used(x).sum() + self.aux(x).detach().sum()

    model = FSDP(Model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(2, 4)).backward()
        opt.step()
    aux = model.module.aux
    assert all(g.shard.grad is None for g in aux.gather_groups)
    assert all(u.training_state.value == "idle" for u in model.modules() if isinstance(u, FSDP))
    assert not any(g.comms.is_allocated(g.full) for u in model.modules() if isinstance(u, FSDP)
                   for g in u.gather_groups if u is not model)


def test_meta_device_init(gloo):
    def init_fn(module):
        module.to_empty(device="cpu", recurse=True)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for _, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
                p.copy_(torch.randn(p.shape, generator=g))

    with torch.device("meta"):
        meta_model = models.MLP()
    wrapped = FSDP(meta_model, param_init_fn=init_fn)
    full = consolidate_sharded_state_dicts([wrapped.state_dict()], wrapped.get_shard_metadata())
    ref = models.MLP()
    init_fn(ref)
    for k, v in ref.state_dict().items():
        assert torch.equal(full[k], v), k
    # Default path: to_empty + reset_parameters, nothing left on meta, forward works.
    with torch.device("meta"):
        meta_model = models.MLP()
    wrapped = FSDP(meta_model)
    assert not any(p.is_meta for p in wrapped.parameters())
    assert torch.isfinite(wrapped(torch.randn(2, 12))).all()


def test_checkpoint_module_runs_no_extra_gather(gloo, monkeypatch):
    """Rematerialization inside a unit: one forward gather per unit per step, none in recompute."""
    model = models.TinyLM()
    root = FSDP(model, auto_wrap_policy=harness.BLOCK_POLICY,
                auto_wrapper_callable=lambda m, *a, **kw: FSDP(checkpoint_module(m), *a, **kw))
    calls = []
    comms = root.comms
    original = comms.start_gather_into
    monkeypatch.setattr(comms, "start_gather_into", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    x, y = models.batch("lm", 0, 0)
    models.loss_fn("lm", root(x), y).backward()
    groups = sum(len(u.gather_groups) for u in root.modules() if isinstance(u, FSDP))
    # block units (ZeRO-3) gather again for backward, except one-rank aliases of the shard, which
    # are never freed
    regathers = sum(1 for u in root.modules() if isinstance(u, FSDP) and u is not root
                    for g in u.gather_groups if not g.comms.aliases_shard(g.full))
    # every group gathered in forward, the freed ones once more for backward; none in the recompute
    assert len(calls) == groups + regathers


def test_clear_error_for_non_float_params_names_the_fix(gloo):
    class WithInt(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2, dtype=torch.int32), requires_grad=False)

        def forward(self, x):
            return x
    with pytest.raises(TypeError, match="buffers instead"):
        FSDP(WithInt())


def test_sharded_state_dict_round_trip_resumes_training(gloo):
    """state_dict() of a wrapped model loads into a fresh wrapped model (same world size) and
    training continues bit-for-bit; so does set_gradient_divide_factors(1, ws)."""
    def make():
        torch.manual_seed(0)
        return harness.CONFIGS["zero3_nested_adamw"]["wrap"](models.make_model("mlp"))

    def step(model, opt, s):
        opt.zero_grad()
        x, y = models.batch("mlp", s, 0)
        loss = models.loss_fn("mlp", model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    a = make()
    opt_a = harness.make_optimizer("adamw", a)
    for s in range(2):
        step(a, opt_a, s)
    b = make()
    b.set_gradient_divide_factors(1.0, 1.0)  # world size 1: the same average
    b.load_state_dict(a.state_dict())
    opt_b = harness.make_optimizer("adamw", b)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # else the two share moment tensors
    for s in range(2, 4):
        assert step(a, opt_a, s) == step(b, opt_b, s)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_load_checks_the_checkpoint_matches_the_model(gloo, tmp_path):
    """A checkpoint of another model, a prefix with no files and a corrupted tensor are errors
    naming the file or parameter; a good checkpoint loads, also into the same model wrapped
    another way (read by original names)."""
    import xla_fsdp
    from xla_fsdp.checkpoints import CheckpointError, rank_path

    torch.manual_seed(0)
    saved = FSDP(models.MLP())
    opt = torch.optim.SGD(saved.parameters(), lr=0.1)
    prefix = str(tmp_path / "ck")
    path = xla_fsdp.save_sharded_checkpoint(saved, opt, prefix)
    assert path == rank_path(prefix, 0, 1)
    torch.manual_seed(1)
    rewrapped = FSDP(models.MLP(), flatten_parameters=True)  # the same model wrapped otherwise: read by name
    xla_fsdp.load_sharded_checkpoint(rewrapped, None, prefix)
    from xla_fsdp.checkpoints import full_state_dict
    want = full_state_dict(saved, rank0_only=False)
    assert all(torch.equal(v, want[k]) for k, v in full_state_dict(rewrapped, rank0_only=False).items())
    with pytest.raises(CheckpointError, match="'fc1.weight' has 288 elements in the checkpoint and 120 in the model"):
        xla_fsdp.load_sharded_checkpoint(FSDP(models.MLP(hidden=10)), None, prefix)
    with pytest.raises(CheckpointError, match="no rank files match .*nope_rank-"):
        xla_fsdp.load_sharded_checkpoint(FSDP(models.MLP()), None, str(tmp_path / "nope"))
    ckpt = torch.load(path, weights_only=False)
    key = next(iter(ckpt["model"]))
    ckpt["model"][key] = ckpt["model"][key] + 1
    torch.save(ckpt, str(tmp_path / "bad_rank-00000000-of-00000001.pth"))
    from xla_fsdp.unit.param_names import readable_key
    with pytest.raises(CheckpointError, match=f"bad_rank-00000000-of-00000001.pth.*'{readable_key(key)}' is corrupted"):
        xla_fsdp.load_sharded_checkpoint(FSDP(models.MLP()), None, str(tmp_path / "bad"))
    fresh = FSDP(models.MLP())
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    xla_fsdp.load_sharded_checkpoint(fresh, fresh_opt, prefix)
    for (k, v), (k2, v2) in zip(saved.state_dict().items(), fresh.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)


def _gather_events(monkeypatch, root):
    """(event, unit name) for every gather started and waited for, in order."""
    from xla_fsdp.unit.runtime import UnitRuntime
    names = {id(u._runtime): n or "root" for n, u in root.named_modules() if isinstance(u, FSDP)}
    events = []
    start, finish = UnitRuntime.start_unshard, UnitRuntime.finish_unshard

    def logged_start(unit, backward, refill_saved=False):
        was = unit.unshard_pending
        start(unit, backward, refill_saved)
        if not was and unit.unshard_pending:
            events.append(("start", names[id(unit)]))

    def logged_finish(unit):
        if unit.unshard_pending:
            events.append(("finish", names[id(unit)]))
        finish(unit)
    monkeypatch.setattr(UnitRuntime, "start_unshard", logged_start)
    monkeypatch.setattr(UnitRuntime, "finish_unshard", logged_finish)
    return events


def _overlapped(events):
    """Units whose gather was in flight while another unit's gather completed (it computed)."""
    out = set()
    for i, (kind, unit) in enumerate(events):
        if kind == "start":
            end = events.index(("finish", unit), i)
            if any(k == "finish" and u != unit for k, u in events[i + 1:end]):
                out.add(unit)
    return out


@pytest.mark.parametrize("prefetch", [True, False])
def test_next_unit_is_gathered_while_this_one_computes(gloo, monkeypatch, prefetch):
    """From the second step on, each block's gather starts before the unit ahead of it computes,
    in forward (successor) and backward (predecessor); prefetch=False gathers just in time.
    bf16 compute: at one rank without a cast the module would use the shard itself, no gather."""
    torch.manual_seed(0)
    root = FSDP(models.TinyLM(layers=3), auto_wrap_policy=harness.BLOCK_POLICY, prefetch=prefetch,
                compute_dtype=torch.bfloat16)
    blocks = {f"blocks.{i}" for i in range(3)}
    x, y = models.batch("lm", 0, 0)
    models.loss_fn("lm", root(x), y).backward()  # step 1 records the order
    events = _gather_events(monkeypatch, root)
    models.loss_fn("lm", root(x), y).backward()
    forward_end = events.index(("finish", "blocks.2"))
    forward, backward = events[:forward_end + 1], events[forward_end + 1:]
    assert _overlapped(forward) == (blocks if prefetch else set())
    # backward: block 2 ended forward last and kept its parameters (no gather); block 1's gather is
    # started when block 2's backward begins and block 0's before block 1 computes
    b0, b1 = "blocks.0", "blocks.1"
    assert backward == ([("start", b1), ("start", b0), ("finish", b1), ("finish", b0)] if prefetch else
                        [("start", b1), ("finish", b1), ("start", b0), ("finish", b0)])
    assert all(not u.unshard_pending for u in root.modules() if isinstance(u, FSDP))


def _nested_linear(flat: bool, **kw) -> FSDP:
    torch.manual_seed(0)
    inner = FSDP(nn.Linear(4, 8), flatten_parameters=flat, **kw)
    return FSDP(nn.Sequential(inner, nn.ReLU(), nn.Linear(8, 2)), flatten_parameters=flat, **kw)


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per-param"])
def test_world_size_1_computes_on_the_shard_itself(gloo, flat):
    """One rank, no cast: the module reads the shard's own storage (nothing gathered, copied or
    freed), and gradients land in the shard's, summed over steps exactly as the plain model's."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = _nested_linear(flat)  # same seed, same construction order: the same weights
    inner = model.module[0]
    x = torch.randn(3, 4)
    for _ in range(2):
        out = model(x)
        # ZeRO-3 frees the inner unit here at more ranks; at one rank the alias stays installed.
        assert inner.module.weight is not None
        assert inner.module.weight.data_ptr() == inner.gather_groups[0].shard.data_ptr()
        out.sum().backward()
        ref(x).sum().backward()
    got = torch.cat([g.shard.grad.reshape(-1) for g in inner.gather_groups])
    want = torch.cat([ref[0].weight.grad.reshape(-1), ref[0].bias.grad])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_freed_units_drop_the_module_views(gloo):
    """A unit freed after forward (ZeRO-3; here bf16 compute, so the full copy is its own) leaves no
    view of the freed data on the module: on XLA a live view is a full-size output of every step.
    The unit that ends forward last keeps its parameters for backward, and drops them after it."""
    torch.manual_seed(0)
    kw = dict(flatten_parameters=True, compute_dtype=torch.bfloat16)
    inner, last = FSDP(nn.Linear(4, 8), **kw), FSDP(nn.Linear(8, 2), **kw)
    model = FSDP(nn.Sequential(inner, nn.ReLU(), last), **kw)
    out = model(torch.randn(3, 4))
    freed = lambda m: isinstance(m.weight, FreedParameter) and isinstance(m.bias, FreedParameter)  # noqa: E731 - no storage
    assert freed(inner.module)
    assert not isinstance(last.module.weight, FreedParameter) and model._runtime.root.kept_for_backward is last._runtime
    out.float().sum().backward()
    assert freed(inner.module) and freed(last.module)
    assert all(g.shard.grad is not None for g in inner.gather_groups)


def test_unit_kept_for_a_backward_that_never_ran_is_freed_by_the_next_forward(gloo):
    """A forward with gradients on but no backward (an evaluation without no_grad) leaves the last
    unit gathered; the next forward frees it before anything else runs, and training goes on."""
    torch.manual_seed(0)
    kw = dict(compute_dtype=torch.bfloat16)
    inner, last = FSDP(nn.Linear(4, 8), **kw), FSDP(nn.Linear(8, 2), **kw)
    model = FSDP(nn.Sequential(inner, nn.ReLU(), last), **kw)
    x = torch.randn(3, 4)
    model(x)
    assert model._runtime.root.kept_for_backward is last._runtime and last.gather_groups[0].is_unsharded()
    freed_at_start = []
    inner.register_forward_pre_hook(lambda *_: freed_at_start.append(not last.gather_groups[0].is_unsharded()))
    model(x).float().sum().backward()
    assert freed_at_start == [True]
    assert all(g.shard.grad is not None for u in (inner, last) for g in u.gather_groups)
    assert not any(g.is_unsharded() for u in (inner, last) for g in u.gather_groups)


def _reinit_rank(rank: int, attempts: range, store_dir: str, out_dir: str) -> None:
    """Train one step in each attempt's process group (a fresh ``init_process_group`` each time)."""
    for attempt in attempts:
        dist.init_process_group("gloo", init_method=f"file://{store_dir}/store{attempt}", rank=rank, world_size=2)
        try:
            torch.manual_seed(0)
            model = FSDP(nn.Linear(4, 2), sharding_groups=[[0, 1]], sharding_rank=rank, sharding_world_size=2)
            model(torch.full((3, 4), float(rank + 1))).sum().backward()
            torch.save([p.grad for p in model.parameters()], f"{out_dir}/rank{rank}-attempt{attempt}.pt")
        finally:
            model = None  # its units hold the sharding group: gone first (see ranks.end_process_group)
            end_process_group()


def test_a_new_process_group_gets_new_collectives(tmp_path):
    """Rank 0 trains in a process group, destroys it and joins a new one in the same process, where
    rank 1 is a new process (an in-process restart after a peer was replaced). Its units must use
    the new group: collectives cached from the old one hold its destroyed subgroup, whose
    connections lead to the process that is gone."""
    procs = [ranks.start_process(_reinit_rank, 0, range(2), str(tmp_path), str(tmp_path)),
             ranks.start_process(_reinit_rank, 1, range(1), str(tmp_path), str(tmp_path))]
    procs[1].join(timeout=120)
    replacement = ranks.start_process(_reinit_rank, 1, range(1, 2), str(tmp_path), str(tmp_path))
    for p in (procs[0], replacement):
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs + [replacement]] == [0, 0, 0]
    for rank in range(2):
        first, second = (torch.load(tmp_path / f"rank{rank}-attempt{a}.pt", weights_only=True) for a in range(2))
        for a, b in zip(first, second):
            torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("config,accelerator,expected", [
    ("cpu:gloo,cuda:gloo", None, "cpu"),                    # gloo on a machine without a GPU
    ("cpu:gloo,cuda:gloo", "cuda:1", "cpu"),                # gloo asked for host collectives, GPU or not
    ("cuda:nccl", "cuda:1", "cuda:1"),                      # NCCL: the GPU torch.cuda.set_device chose
    ("cpu:gloo,cuda:nccl", "cuda:0", "cuda:0"),             # one group, both backends
    ("cpu:gloo,xpu:xccl", "xpu:3", "xpu:3"),                # Intel XPU
    # a PrivateUse1 device with its own backend (TorchTPU renames PrivateUse1 'tpu'; renaming is for good, so
    # not done in the test process)
    ("cpu:gloo,privateuseone:tpu_dist", "privateuseone:2", "privateuseone:2"),
    ("cpu:gloo,privateuseone:tpu_dist", "cuda:0", "cpu"),   # a backend for a device this process lacks
])
def test_the_torch_transport_moves_tensors_on_the_device_its_group_serves(config, accelerator, expected):
    from xla_fsdp.collectives.torch_dist import transport_device
    assert transport_device(config, torch.device(accelerator) if accelerator else None) == torch.device(expected)


def test_a_group_that_serves_no_device_of_this_process_is_a_clear_error():
    from xla_fsdp.collectives.torch_dist import transport_device
    with pytest.raises(RuntimeError, match=r"serves 'cuda:nccl', with no CPU backend.*none available"):
        transport_device("cuda:nccl", None)


def test_tensors_handed_to_a_collective_outlive_the_backends_hold_on_them():
    """The torch transport gives collectives aliases of its own and keeps each until the backend has
    let go of it, so a gloo/NCCL thread never frees a Python object (at exit that aborts the process:
    pytorch/pytorch#190489). A backend's hold on the alias (a C++ reference to it) is played by a view,
    whose TensorImpl holds its base's."""
    from xla_fsdp.collectives import torch_dist
    source = torch.arange(4.0)
    (alias,) = torch_dist._aliases(source)
    assert alias.data_ptr() == source.data_ptr() and alias._use_count() == 1 and alias._base is None
    held_before = len(torch_dist._HELD)
    backend = alias.view(-1)
    torch_dist._let_go((alias,))
    assert any(a[0] is alias for a in torch_dist._HELD)  # kept while the backend holds it
    del backend
    torch_dist._let_go(torch_dist._aliases(torch.zeros(1)))  # the next collective purges what was let go
    assert not any(a[0] is alias for a in torch_dist._HELD) and len(torch_dist._HELD) <= held_before
    # a collective dropped without its wait parks its aliases, as the exit handler drains them
    (alias,) = torch_dist._aliases(source)
    backend = alias.view(-1)
    torch_dist._Waiter(object(), source, (alias,)).__del__()
    assert any(a[0] is alias for a in torch_dist._HELD)
    del backend
    torch_dist._drain(timeout_s=1.0)
    assert not any(a[0] is alias for a in torch_dist._HELD)


def test_the_unit_is_a_shell_over_one_runtime_with_frozen_settings(gloo):
    """The wrapper holds its state by composition, not spread over mixins: its own attributes are its
    collectives, its keywords, what it built from the module, its channels and one runtime (before: 44
    instance attributes written by three mixins). Its settings are frozen, so what it shows is what its
    next step does; the root rule is computed once, at the root's first forward; the units under one
    root share one context object."""
    from xla_fsdp.unit.settings import UnitSettings
    torch.manual_seed(0)
    inner = FSDP(nn.Linear(4, 4))
    model = FSDP(nn.Sequential(inner, nn.Linear(4, 2)))
    assert set(vars(model)) - set(vars(nn.Module())) == {"comms", "_options", "_adopted", "_channels",
                                                         "_module_view", "_runtime"}
    assert [c.__name__ for c in type(model).__mro__] == ["XlaFullyShardedDataParallel", "ShardedUnit", "Module",
                                                          "object"]
    before = model.settings
    assert isinstance(before, UnitSettings)
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.fp32_reduce_scatter = True
    model.fp32_reduce_scatter = True  # torch_xla's attribute: replaces the settings
    assert model.settings is not before and model.settings.fp32_reduce_scatter and not before.fp32_reduce_scatter
    assert model.settings.freeing.after_forward and model.settings.freeing.keep_on_root
    model(torch.randn(2, 4)).sum().backward()
    assert not model.reshard_after_forward and not model.settings.freeing.keep_on_root  # the root rule, applied
    assert inner.reshard_after_forward and not inner.settings.freeing.keep_on_root
    assert inner._runtime.root is model._runtime.root
    assert model._runtime.root.units == [model._runtime, inner._runtime]
    assert model._fsdp_kwargs["reshard_after_forward"] is None  # the keywords as given (what children get)


@pytest.mark.fast
def test_the_keywords_agree_in_signature_options_and_docstring():
    """Each keyword is declared once, in ``UnitOptions`` (its default and its documentation), and the
    wrapper's docstring is made from those declarations; the signature (what users, positional callers and
    their tools read) lists the same names with the same defaults, less what is not kept (the module, the
    auto-wrap policy, PyTorch's group keywords, read as ``sharding_groups``, the deprecated and debug-only
    keywords), and the docstring documents every keyword once. Each setting torch_xla shows as an attribute
    is declared once, in ``UnitSettings`` (fixed or step-time), and the attribute is made from that."""
    import inspect
    import re
    from xla_fsdp.fsdp2 import fully_shard  # noqa: F401 - its unit class is made
    from xla_fsdp.unit.options import UnitOptions
    from xla_fsdp.unit.settings import UnitSettings
    from xla_fsdp.unit.shell import Setting
    params = inspect.signature(FSDP.__init__).parameters
    not_passed_on = {"self", "module", "auto_wrap_policy", "auto_wrapper_callable", "mark_step_on_finalization",
                     "process_group", "device_mesh",
                     "_debug_dummy_forward_pass", "_debug_dummy_all_gather_op", "_debug_dummy_all_reduce_op",
                     "_debug_dummy_reduce_scatter_op", "_debug_dummy_optimization_barrier_op"}
    signature = [(n, p.default) for n, p in params.items() if n not in not_passed_on]
    fields = [(f.name, f.default) for f in dataclasses.fields(UnitOptions)]
    assert sorted(signature, key=str) == sorted(fields, key=str)
    args = FSDP.__doc__.split("Args:")[1]
    entries = re.findall(r"^        (\S[^:]*):", args, re.M)
    refused = {n for n in params if n.startswith("_debug_dummy")}  # the dummy-op keywords are refused
    assert sorted(entries) == sorted(set(params) - {"self"} - refused), set(entries) ^ (set(params) - refused)
    for f in dataclasses.fields(UnitOptions):
        assert " ".join(f.metadata["doc"].split())[:40] in " ".join(args.split()), f.name
    declared = {f.name: f.metadata["attribute"] for f in dataclasses.fields(UnitSettings) if "attribute" in f.metadata}
    assert len(declared) == 19
    made = {n: ("fixed" if d.fixed else "step") for n, d in vars(FSDP).items() if isinstance(d, Setting)}
    assert made == declared


def test_construction_time_settings_are_read_only_and_step_time_ones_take_effect(gloo):
    """Before: ``m.compute_dtype = torch.bfloat16`` made ``m.settings`` say bf16 while
    the gather groups stayed fp32, and the next forward failed ("mat1 and mat2 must have the same
    dtype"); ``m.shard_param_on_dim_0 = True`` reported True while every group stayed flat."""
    torch.manual_seed(0)
    model = FSDP(nn.Linear(4, 2))
    fixed = [("compute_dtype", torch.bfloat16), ("shard_param_on_dim_0", True), ("buffer_dtype", torch.float16),
             ("param_storage_dtype", torch.bfloat16), ("cpu_offload", True), ("sharding_strategy", "NO_SHARD"),
             ("sharding_groups", [[0]]), ("prefetch", False), ("reduce_scatter_bucket_size_mb", 1),
             ("coalesce_all_gather_ops", True)]
    for name, value in fixed:
        before = getattr(model, name)
        with pytest.raises(AttributeError, match=rf"{name} is fixed when the unit is built .* pass {name}="):
            setattr(model, name, value)
        assert getattr(model, name) == before, name
    assert model(torch.ones(3, 4)).dtype == torch.float32  # still trains as built
    # a step-time setting takes full effect at the next step: the output is cast as it now says
    model.output_dtype = torch.bfloat16
    assert model.settings.output_dtype == torch.bfloat16 and model(torch.ones(3, 4)).dtype == torch.bfloat16
    # torch_xla's attributes its users set at step time keep working
    model.fp32_reduce_scatter = True
    model.gradient_predivide_factor = 1.0
    assert model.settings.fp32_reduce_scatter and model.settings.gradient_predivide_factor == 1.0


def _unit_names(root: nn.Module):
    return sorted(n for n, m in root.named_modules() if isinstance(m, FSDP) and m is not root)


def test_wrap_policies_written_for_pytorchs_fsdp_are_taken_as_they_are(gloo):
    """PyTorch's FSDP calls a policy ``policy(module, recurse, nonwrapped_numel)`` and also takes policy
    objects; PEFT's ``fsdp_auto_wrap_policy`` is ``_or_policy`` over two such functions. Each form gives
    the units the same rule gives in torch_xla's form, and a ``CustomPolicy``'s dict sets that unit's
    keywords. Before: ``_or_policy() got an unexpected keyword argument 'unwrapped_params'``."""
    import torch.distributed.fsdp.wrap as torch_wrap
    from xla_fsdp.wrap import lambda_auto_wrap_policy, transformer_auto_wrap_policy

    def model():
        torch.manual_seed(0)
        return models.make_model("lm")

    block = models.Block
    ours = _unit_names(FSDP(model(), auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                                       transformer_layer_cls={block})))
    assert ours == ["blocks.0", "blocks.1"], ours
    forms = {
        "transformer": functools.partial(torch_wrap.transformer_auto_wrap_policy, transformer_layer_cls={block}),
        "lambda": functools.partial(torch_wrap.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, block)),
        "or": functools.partial(torch_wrap._or_policy, policies=[
            functools.partial(torch_wrap.lambda_auto_wrap_policy, lambda_fn=lambda m: False),
            functools.partial(torch_wrap.transformer_auto_wrap_policy, transformer_layer_cls={block})]),
        "module_wrap_policy": torch_wrap.ModuleWrapPolicy({block}),
        "custom": torch_wrap.CustomPolicy(lambda m: isinstance(m, block)),
    }
    for name, policy in forms.items():
        assert _unit_names(FSDP(model(), auto_wrap_policy=policy)) == ours, name
    ours_lambda = _unit_names(FSDP(model(), auto_wrap_policy=functools.partial(
        lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear))))
    theirs_lambda = _unit_names(FSDP(model(), auto_wrap_policy=functools.partial(
        torch_wrap.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear))))
    assert ours_lambda == theirs_lambda and len(ours_lambda) > len(ours)
    sized = _unit_names(FSDP(model(), auto_wrap_policy=functools.partial(
        torch_wrap.size_based_auto_wrap_policy, min_num_params=200)))
    assert sized == _unit_names(FSDP(model(), auto_wrap_policy=functools.partial(
        size_based_auto_wrap_policy, min_num_params=200))) and sized
    plain = model()
    root = FSDP(plain, auto_wrap_policy=torch_wrap.CustomPolicy(
        lambda m: {"flatten_parameters": True} if m is plain.blocks[1] else isinstance(m, block)))
    flat = {n: bool(m.flatten_parameters) for n, m in root.named_modules() if isinstance(m, FSDP) and m is not root}
    assert flat == {ours[0]: False, ours[1]: True}, flat
    with pytest.raises(TypeError, match="auto_wrap_policy must be a callable"):
        FSDP(model(), auto_wrap_policy="TRANSFORMER_BASED_WRAP")


def test_a_check_that_only_warns_never_stops_a_wrap(gloo):
    """A model whose config ties its embeddings but whose get_input_embeddings raises (not the
    AttributeError the check expects): the untied-embeddings check fails; the wrap goes on, with one
    warning naming the check and the error. Before: the wrap raised from inside the check."""
    from xla_fsdp.advice import AdviceCheckFailed

    class Odd(nn.Linear):
        config = type("Config", (), {"tie_word_embeddings": True})()

        def get_input_embeddings(self):
            raise RuntimeError("no embeddings here")

    with pytest.warns(AdviceCheckFailed, match=r"warn_untied_embeddings .*RuntimeError: no embeddings here"):
        wrapped = FSDP(Odd(3, 3))
    wrapped(torch.ones(2, 3)).sum().backward()
