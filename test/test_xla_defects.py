"""torch_xla defects fixed here, checked on XLA:CPU (one spawned device process per test)."""
import os
import threading

import pytest
import torch

import models
from ranks import run_multiprocess
from training_program import BUILD_LOCK

pytestmark = pytest.mark.xla  # every test here needs torch_xla


def _bf16_conv_and_embedding():
    import torch_xla
    import xla_fsdp
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    dev = torch_xla.device()
    torch.manual_seed(0)
    conv = FSDP(models.ConvBN(), compute_dtype=torch.bfloat16)  # unflattened Conv2d in bf16
    x, y = models.batch("convbn", 0, 0)
    loss = models.loss_fn("convbn", conv(x.to(dev)), y.to(dev))
    loss.backward()
    xla_fsdp.sync()
    conv_ok = bool(torch.isfinite(loss).item()) and all(p.grad.dtype == torch.float32 for p in conv.parameters())
    # Embedding with the default optimization barriers (torch_xla 2.9 aborts: barrier on int ids)
    torch.manual_seed(0)
    lm = FSDP(models.TinyLM())
    ids, tgt = models.batch("lm", 0, 0)
    loss2 = models.loss_fn("lm", lm(ids.to(dev)), tgt.to(dev))
    loss2.backward()
    xla_fsdp.sync()
    return conv_ok, loss2.item()


def test_bf16_conv2d_and_embedding_with_barriers_on_xla_cpu(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "1")
    result = run_multiprocess(_bf16_conv_and_embedding)[0]
    conv_ok, lm_loss = result
    assert conv_ok
    torch.manual_seed(0)
    ref = models.TinyLM()
    ids, tgt = models.batch("lm", 0, 0)
    assert abs(lm_loss - models.loss_fn("lm", ref(ids), tgt).item()) < 1e-5


def _mismatched_construction():
    import torch.nn as nn
    import torch_xla
    import torch_xla.runtime as xr
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    dev = torch_xla.device()
    if xr.global_ordinal() == 1:
        FSDP(nn.Linear(2, 2))  # an extra unit on one rank only: its channel ids run ahead
    torch.manual_seed(0)
    model = FSDP(models.MLP())
    try:
        model(torch.randn(2, 12).to(dev))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_ranks_that_built_different_units_fail_fast_with_a_clear_error(monkeypatch):
    """Instead of pairing unrelated collectives or waiting until XLA aborts the process."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    messages = run_multiprocess(_mismatched_construction)
    assert sorted(messages) == [0, 1]
    for msg in messages.values():
        assert "ranks built different FSDP units" in msg and "[" in msg, msg


_MET = threading.Barrier(2)


def _compiles() -> int:
    import torch_xla.debug.metrics as met
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def _graphs_of_the_first_steps(api):
    """XLA compilations while the root sets itself up (its first forward: the construction check and the
    same-parameters check) and over two steps, counted between barriers (the metric is the process's)."""
    import torch_xla
    import xla_fsdp
    dev = torch_xla.device()
    with BUILD_LOCK:
        torch.manual_seed(0)
        model = models.MLP()
        if api == "wrapper":
            model = xla_fsdp.XlaFullyShardedDataParallel(model)
        else:
            for layer in (model.fc1, model.fc2, model):
                xla_fsdp.fully_shard(layer)
            model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xla_fsdp.sync()
    counts = []
    for step in range(3):
        _MET.wait()
        counts.append(_compiles())
        _MET.wait()
        x = torch.randn(2, 12, generator=torch.Generator().manual_seed(step)).to(dev)
        loss = model(x).sum()
        if step == 0:
            _MET.wait()
            counts.append(_compiles())  # the root's set-up has run
            _MET.wait()
        loss.backward()
        opt.step()
        opt.zero_grad()
        xla_fsdp.sync()
    _MET.wait()
    counts.append(_compiles())
    return counts


@pytest.mark.parametrize("api", ["wrapper", "fully_shard"])
def test_the_first_forward_compiles_no_check_of_its_own(monkeypatch, api):
    """The construction check (channel counters) and the same-parameters check (fingerprints) run on the
    host between rank threads: the root's set-up compiles no graph (it compiled three: the counters'
    all-gather and, on each rank thread, a stack of the fingerprints), and the steps (SGD: no state) compile
    one graph, the first's, and nothing after."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    counts = run_multiprocess(_graphs_of_the_first_steps, api)
    before, set_up, step2, step3, end = counts[0]
    assert counts[0] == counts[1], counts
    assert set_up - before == 0, counts
    assert (step2 - set_up, step3 - step2, end - step3) == (1, 0, 0), counts


LATE_S = 17  # XLA:CPU aborts a device rendezvous whose peers are 15 s late (5 s warning + 10 s)


def _one_rank_late_to_its_first_forward():
    import time
    import torch_xla
    import torch_xla.runtime as xr
    import xla_fsdp
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    dev = torch_xla.device()
    with BUILD_LOCK:
        torch.manual_seed(0)
        model = FSDP(models.MLP())
    x = torch.randn(2, 12, generator=torch.Generator().manual_seed(0)).to(dev)
    if xr.global_ordinal() == 1:  # as a Trainer loading this rank's files: slow, with pending device work
        time.sleep(LATE_S)
        x = x * 1.0 + torch.zeros(2, 12).to(dev)
    loss = model(x).sum()
    loss.backward()
    xla_fsdp.sync()
    return loss.item()


def test_a_rank_late_to_the_first_forward_is_waited_for(monkeypatch):
    """Ranks reach the first forward's construction check far apart after work of their own (HF
    Trainer resume); before the host meeting one rank waited in XLA's rendezvous and the process aborted."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    losses = run_multiprocess(_one_rank_late_to_its_first_forward)
    torch.manual_seed(0)
    ref = models.MLP()
    x = torch.randn(2, 12, generator=torch.Generator().manual_seed(0))
    assert sorted(losses) == [0, 1]
    for loss in losses.values():
        assert abs(loss - ref(x).sum().item()) < 1e-5, (losses, ref(x).sum().item())


def _rank_one_fails_before_its_first_forward(index):
    import torch_xla
    import torch_xla.runtime as xr
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    with BUILD_LOCK:
        torch.manual_seed(0)
        model = FSDP(models.MLP())
    if xr.global_ordinal() == 1:
        raise FileNotFoundError("rank file missing: ckpt_rank-00000001-of-00000002.pth")
    model(torch.zeros(2, 12).to(torch_xla.device())).sum()  # the first forward meets the peers


def test_a_failing_rank_stops_its_peers_with_its_error(tmp_path):
    """torch_xla.launch reports a rank's error only after every rank returned: rank 0 waited for the
    failed rank 1 at the first forward for 10 minutes (the host meeting's timeout). xla_fsdp.launch
    stops the peers at once."""
    import subprocess
    import sys
    import time
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2", PYTHONPATH=here)
    program = ("import xla_fsdp, test_xla_defects as t\n"
               "if __name__ == '__main__':\n    xla_fsdp.launch(t._rank_one_fails_before_its_first_forward)\n")
    script = tmp_path / "fails.py"  # a file: the spawned device process imports it (xla_fsdp first) as a user's script
    script.write_text(program)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "xla_fsdp: rank 1 failed; stopping the other ranks" in proc.stderr, proc.stderr[-3000:]
    assert "rank 1 failed before the construction check (FileNotFoundError: rank file missing" in proc.stderr, \
        proc.stderr[-3000:]
    assert elapsed < 120, elapsed  # not the 600 s host timeout


def _train_with_and_without_profiler_annotations():
    import torch_xla
    import torch_xla.debug.profiler as xp
    import torch_xla.runtime as xr
    import xla_fsdp
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    dev, rank = torch_xla.device(), xr.global_ordinal()
    runs = {}
    for annotate in (False, True):
        with BUILD_LOCK:
            torch.manual_seed(0)
            # sync_on_finalization: a graph cut of the package's in backward too, inside the user's StepTrace
            model = FSDP(models.MLP(), sync_on_finalization=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            x, y = (t.to(dev) for t in models.batch("mlp", step, rank))
            if annotate:  # as torch_xla's train_imagenet.py
                with xp.StepTrace("train_imagenet", step_num=step):
                    with xp.Trace("build_graph"):
                        opt.zero_grad()
                        loss = models.loss_fn("mlp", model(x), y)
                    loss.backward()
                    opt.step()
            else:
                opt.zero_grad()
                loss = models.loss_fn("mlp", model(x), y)
                loss.backward()
                opt.step()
                xla_fsdp.sync()
            losses.append(loss.item())
        runs[annotate] = (losses, [p.detach().cpu() for p in model.parameters()])
    return runs


def test_profiler_scopes_around_a_step_on_several_xla_cpu_devices(monkeypatch):
    """A forward inside xp.StepTrace/xp.Trace at 2 devices failed at once ("Expecting scope to be empty
    but it is train_imagenet.1/build_graph.1"): the first forward's construction check cut the graph
    with torch_xla's scope reset inside the user's open scopes. It trains as without the annotations."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    results = run_multiprocess(_train_with_and_without_profiler_annotations)
    assert sorted(results) == [0, 1]
    for runs in results.values():
        (plain_losses, plain_params), (losses, params) = runs[False], runs[True]
        assert losses == plain_losses
        assert all(torch.equal(a, b) for a, b in zip(params, plain_params))


class _BranchOnRankZero(torch.nn.Module):
    """``b`` is used on rank 0 only (a data-dependent branch), in the root unit itself."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 12)
        self.b = torch.nn.Linear(12, 12)
        self.head = torch.nn.Linear(12, 5)

    def forward(self, x, use_b):
        x = torch.tanh(self.a(x))
        if use_b:
            x = x + torch.tanh(self.b(x))
        return self.head(x)


BRANCH_STEPS = 3


def _train_with_a_branch_on_rank_zero():
    import torch_xla
    import torch_xla.runtime as xr
    import xla_fsdp
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    dev, rank = torch_xla.device(), xr.global_ordinal()
    with BUILD_LOCK:
        torch.manual_seed(0)
        model = FSDP(_BranchOnRankZero(), flatten_parameters=False, reshard_after_forward=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(BRANCH_STEPS):
        x, y = (t.to(dev) for t in models.batch("mlp", step, rank))
        opt.zero_grad()
        loss = models.loss_fn("mlp", model(x, rank == 0), y)
        loss.backward()
        opt.step()
        xla_fsdp.sync()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}, model.get_shard_metadata()


def test_a_branch_used_on_one_rank_only_in_a_root_unit(monkeypatch):
    """Rank 0 raised KeyError in the gradient plan's host exchange and XLA aborted rank 1: backward runs
    in autograd's thread for the device, whose exchange rounds were counted apart from the rank's own
    thread. Training equals the unsharded model on the global batch (the branch's gradient is rank 0's
    alone, averaged over the 2 ranks)."""
    from xla_fsdp.checkpoints.shard_merge import consolidate_sharded_state_dicts
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    results = run_multiprocess(_train_with_a_branch_on_rank_zero)
    assert sorted(results) == [0, 1]
    torch.manual_seed(0)
    ref = _BranchOnRankZero()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(BRANCH_STEPS):
        opt.zero_grad()
        per_rank = [models.loss_fn("mlp", ref(x, r == 0), y)
                    for r, (x, y) in enumerate(models.batch("mlp", step, r) for r in range(2))]
        torch.stack(per_rank).mean().backward()
        opt.step()
        for r in range(2):
            assert abs(results[r][0][step] - per_rank[r].item()) < 1e-5, (step, r)
    trained = consolidate_sharded_state_dicts([results[r][1] for r in range(2)], results[0][2])
    for name, value in ref.state_dict().items():
        assert torch.allclose(trained[name], value, atol=1e-6), name


def test_host_exchange_rounds_follow_the_rank_not_the_thread():
    """A rank's exchanges come from its own thread (forward) and from autograd's thread for its device
    (backward): the n-th call of a rank belongs to round n whichever thread makes it."""
    from xla_fsdp.collectives.host_exchange import ThreadExchange
    exchange = ThreadExchange("test rounds", 2)
    waits = {}

    def call(rank, value):  # every call from a thread of its own
        waits[value] = exchange.start_gather(rank, value)

    for rank, value in [(0, "fwd0"), (0, "bwd0"), (1, "fwd1"), (1, "bwd1")]:
        thread = threading.Thread(target=call, args=(rank, value))
        thread.start()
        thread.join()
    assert waits["fwd0"]() == waits["fwd1"]() == ["fwd0", "fwd1"]
    assert waits["bwd0"]() == waits["bwd1"]() == ["bwd0", "bwd1"]


class _ScaleThenMLP(torch.nn.Module):
    """``scale``'s gradient is the input ``z`` (an inf where ``z`` has one); the MLP's do not depend on it."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(3))
        self.mlp = models.MLP()

    def forward(self, x, z):
        return self.mlp(x), (self.scale * z).sum()


def _gradients_with_and_without_an_inf():
    import torch_xla
    import torch_xla.runtime as xr
    import xla_fsdp
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    dev, rank = torch_xla.device(), xr.global_ordinal()
    grads = {}
    for strategy in ("FULL_SHARD", "NO_SHARD"):  # both with the default per-parameter layout
        for first in (float("inf"), 3.0):
            with BUILD_LOCK:
                torch.manual_seed(0)
                model = FSDP(_ScaleThenMLP(), sharding_strategy=strategy)
            x, y = (t.to(dev) for t in models.batch("mlp", 0, rank))
            # rank 0's gradient of scale[0] overflows: the first element of rank 0's reduced shard
            z = torch.tensor([first if rank == 0 else 1.0, 2.0, 3.0]).to(dev)
            out, extra = model(x, z)
            (models.loss_fn("mlp", out, y) + extra).backward()
            xla_fsdp.sync()
            grads[strategy, first] = {n: p.grad.cpu() for n, p in model.named_parameters()}
    return grads


def test_an_inf_gradient_stays_in_its_own_parameter(monkeypatch):
    """An inf in one parameter's gradient turned the other parameters' reduced gradients into NaN
    (per-parameter layout and NO_SHARD): torch_xla chains the collectives of a graph with a numeric
    token, ``token * result[0]``, added to the next collective's input, and 0 * inf = NaN. The other
    gradients equal those of the same program without the inf; the inf arrives where it belongs."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    results = run_multiprocess(_gradients_with_and_without_an_inf)
    assert sorted(results) == [0, 1]
    for rank, grads in results.items():
        for strategy in ("FULL_SHARD", "NO_SHARD"):
            with_inf, finite = grads[strategy, float("inf")], grads[strategy, 3.0]
            for name, grad in with_inf.items():
                if not name.endswith("scale"):
                    assert torch.equal(grad, finite[name]), (rank, strategy, name, grad)
                    continue
                # scale's full gradient is [inf, 1.5, 2.5] + padding: only the first element is inf
                holds_first = rank == 0 or strategy == "NO_SHARD"
                expected = torch.zeros_like(grad, dtype=torch.bool)
                expected[0] = holds_first
                assert torch.equal(torch.isinf(grad), expected), (rank, strategy, grad)
                assert torch.equal(grad[~expected], finite[name][~expected]), (rank, strategy, grad)


def _host_memory_mib() -> float:
    import ctypes
    import gc
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed host pages go back, so RSS shows what is live
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _memory_wrapping_holds():
    import torch_xla
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    dev = torch_xla.device()
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(16)]).to(dev)
    torch_xla.sync()
    param_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    before = _host_memory_mib()
    wrapped = FSDP(torch.nn.Sequential(*[FSDP(m) for m in model]))
    torch_xla.sync()
    return param_mib, _host_memory_mib() - before, len(list(wrapped.parameters()))


def test_a_freed_full_parameter_holds_no_memory(monkeypatch):
    """Each gathered parameter is an ``nn.Parameter`` on the device, emptied by swapping in a
    1-element placeholder; torch_xla's functional storage keeps a parameter's birth data for the
    parameter's life past every swap, so a full parameter born with its real shape held one whole
    model per rank from wrapping on (+309 MiB for this 256 MiB model, where a 1-element birth holds
    +53 MiB of shards, placeholders and compiled code). On XLA:CPU the device buffers are host
    memory, so the process's resident memory shows them."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "1")
    param_mib, grew_mib, shards = run_multiprocess(_memory_wrapping_holds)[0]
    assert shards == 32 and param_mib == pytest.approx(256, rel=0.01)
    # ws 1: the shards replace the originals one for one, so wrapping adds no parameter-sized memory
    assert grew_mib < 0.4 * param_mib, f"wrapping a {param_mib:.0f} MiB model grew memory by {grew_mib:.0f} MiB"


_FIRST_ITEM_BARRIER = threading.Barrier(8)


def _first_item_at_once():
    """Whether torch_xla's host-fallback counters existed when the program began, then the process's
    first ``.item()`` / ``torch.equal`` / ``nonzero`` of every rank at the same moment."""
    import torch_xla
    import torch_xla.debug.metrics as met
    counted = [met.counter_value(f"aten::{op}") is not None for op in ("_local_scalar_dense", "equal", "nonzero")]
    x = torch.ones(1).to(torch_xla.device())
    _FIRST_ITEM_BARRIER.wait(60)
    x.item()
    torch.equal(x, x)
    torch.nonzero(x)
    return counted


def test_rank_threads_making_their_first_item_at_once_do_not_crash():
    """torch_xla 2.9 creates the counter of each host-fallback operation at its first call, in a
    ``std::unordered_map`` without a lock: two rank threads making the process's first ``.item()`` at
    once segfaulted in ``_Hashtable::_M_find_before_node`` under ``_local_scalar_dense`` (the rare
    crash of test_patches' 2-device launch; 8 threads released by a barrier, plain torch_xla.launch:
    a crash in STRESS_FIGURE). Every rank thread the launcher starts now finds the counters made."""
    from ranks import xla_cpu_devices
    with xla_cpu_devices(8):
        results = run_multiprocess(_first_item_at_once)
    assert [results[r] for r in range(8)] == [[True, True, True]] * 8, results
