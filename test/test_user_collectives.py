"""torch_xla's user-level collectives across several XLA:CPU devices (threads of one process),
where torch_xla 2.9 aborts: xm.all_reduce (every form), all_gather, reduce_scatter, mesh_reduce,
rendezvous, xm.save and the ``xla`` torch.distributed backend."""
import os
import threading
import time

import pytest
import torch

# ranks.run_multiprocess enables several XLA:CPU devices, as xla_fsdp.launch does
from ranks import run_multiprocess
from training_program import BUILD_LOCK
import xla_fsdp

pytestmark = pytest.mark.xla  # every test here needs torch_xla


def _user_program(folder):
    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    dev, r, ws = torch_xla.device(), xr.global_ordinal(), xr.world_size()
    out = {}
    t = torch.tensor([float(r + 1), 2.0 * (r + 1)]).to(dev)
    for kind in ("sum", "max", "min", "mul"):
        out[kind] = xm.all_reduce(kind, t).cpu().tolist()
    out["scaled"] = xm.all_reduce(xm.REDUCE_SUM, t, scale=0.5).cpu().tolist()
    in_place = [torch.tensor([r]).to(dev), torch.tensor([1.0]).to(dev)]
    xm.all_reduce(xm.REDUCE_SUM, in_place)
    out["list"] = [x.cpu().tolist() for x in in_place]
    out["and"] = xm.all_reduce(xm.REDUCE_AND, torch.tensor([r % 2 == 0]).to(dev)).cpu().tolist()
    out["or"] = xm.all_reduce(xm.REDUCE_OR, torch.tensor([r == 0]).to(dev)).cpu().tolist()
    halves = [list(range(ws // 2)), list(range(ws // 2, ws))]
    out["groups"] = xm.all_reduce(xm.REDUCE_SUM, torch.tensor([float(r)]).to(dev), groups=halves).cpu().tolist()
    out["gather"] = xm.all_gather(torch.tensor([r, 10 + r]).to(dev)).cpu().tolist()
    out["reduce_scatter"] = xm.reduce_scatter(xm.REDUCE_SUM, torch.arange(2 * ws, dtype=torch.float32).to(dev),
                                              1.0, 0, ws).cpu().tolist()
    out["mesh_reduce"] = xm.mesh_reduce("accuracy", float(r), lambda xs: sum(xs) / len(xs))
    xm.rendezvous("before_save")
    xm.save({"w": torch.full((2,), float(r + 7)).to(dev)}, os.path.join(folder, "master.pt"))  # master only
    time.sleep(0.3 * r)  # threads arrive one after another (CI saw "initialize ... twice" that way)
    dist.init_process_group("xla", init_method="xla://")  # every device thread, as every TPU process
    out["dist_rank"] = (dist.get_rank(), dist.get_world_size())
    x = torch.tensor([float(r)]).to(dev)
    dist.all_reduce(x)
    out["dist_all_reduce"] = x.cpu().tolist()
    got = [torch.zeros(1).to(dev) for _ in range(ws)]
    dist.all_gather(got, torch.tensor([float(r)]).to(dev))
    out["dist_all_gather"] = [g.cpu().tolist() for g in got]
    b = torch.tensor([float(r + 5)]).to(dev)
    dist.broadcast(b, 0)
    out["dist_broadcast"] = b.cpu().tolist()
    dist.barrier()
    dist.destroy_process_group()  # every thread; the last one frees the shared group
    xm.rendezvous("destroyed")
    out["after_destroy"] = dist.is_initialized()
    try:
        xm.rendezvous(f"rank-{r}")  # every rank names a different rendezvous: a clear error on all
        out["mismatch"] = "no error"
    except RuntimeError as e:
        out["mismatch"] = str(e)
    try:
        xm.all_gather(torch.zeros(r + 1).to(dev))  # a different shape on every rank: a clear error, no abort
        out["shape_mismatch"] = "no error"
    except RuntimeError as e:
        out["shape_mismatch"] = str(e)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_torch_xla_user_collectives_on_several_xla_cpu_devices(world_size, monkeypatch, tmp_path):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", str(world_size))
    results = run_multiprocess(_user_program, str(tmp_path))
    assert sorted(results) == list(range(world_size))
    ws = world_size
    a = [float(r + 1) for r in range(ws)]
    prod = 1.0
    for v in a:
        prod *= v
    half = ws // 2
    want = {
        "sum": [sum(a), 2 * sum(a)], "max": [ws, 2.0 * ws], "min": [1.0, 2.0], "mul": [prod, prod * 2 ** ws],
        "scaled": [sum(a) / 2, sum(a)], "list": [[sum(range(ws))], [float(ws)]], "and": [False], "or": [True],
        "gather": [v for r in range(ws) for v in (r, 10 + r)],
        "mesh_reduce": sum(range(ws)) / ws, "dist_all_reduce": [float(sum(range(ws)))],
        "dist_all_gather": [[float(r)] for r in range(ws)], "dist_broadcast": [5.0],
    }
    sums = torch.arange(2 * ws, dtype=torch.float32) * ws
    for r in range(ws):
        got = results[r]
        for key, value in want.items():
            assert got[key] == value, (r, key, got[key], value)
        assert got["dist_rank"] == (r, ws)
        assert got["after_destroy"] is False
        assert got["groups"] == [float(sum(range(half)) if r < half else sum(range(half, ws)))]
        assert got["reduce_scatter"] == sums[2 * r:2 * r + 2].tolist()
        assert "met at different rendezvous" in got["mismatch"]
        assert "issued different collectives" in got["shape_mismatch"]
    assert torch.load(tmp_path / "master.pt", weights_only=True)["w"].tolist() == [7.0, 7.0]  # rank 0's


LATE_S = 30.0  # past XLA:CPU's rendezvous limit (a 5 s warning, then 10 s more), with room for a busier
# machine while rank 0 times its matmuls (20 s gave 14.8 s of waiting once)


def _late_rank_program():
    """Rank 0 queues about LATE_S of device work that its collective's value depends on; rank 1 has
    none. As device collectives (xla_fsdp before this test) rank 1 waited in XLA's rendezvous and
    XLA aborted the process after 10 s; rank threads must wait for each other however long it takes."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    dev, r = torch_xla.device(), xr.global_ordinal()
    w = torch.eye(1024).to(dev)
    y = torch.ones(1024, 1024).to(dev)
    if r == 0:
        for _ in range(2):  # the second run times execution alone (the first compiles)
            start = time.perf_counter()
            for _ in range(4):
                y = torch.tanh(y @ w)
            torch_xla.sync()
            y.cpu()
        per_matmul = (time.perf_counter() - start) / 4
        for _ in range(int(LATE_S / per_matmul) + 1):  # pending: runs when the collective needs it
            y = torch.tanh(y @ w)
    start = time.perf_counter()
    gathered = xm.all_gather(y[:1, :1].reshape(1)).cpu().tolist()
    summed = xm.all_reduce(xm.REDUCE_SUM, torch.tensor([float(r)]).to(dev)).cpu().tolist()
    return gathered, summed, time.perf_counter() - start


def test_a_rank_far_behind_at_a_user_collective_is_waited_for(monkeypatch):
    """A rank with more device work queued before a user collective (a rank-0-only metric, a
    checkpoint write) reaches it LATE_S after its peer; the peer waits on the host, nothing aborts."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    results = run_multiprocess(_late_rank_program)
    expected_first = torch.tanh(torch.tensor(1.0)).item()  # rank 0 iterates tanh from 1: it shrinks, stays > 0
    for r in range(2):
        gathered, summed, waited = results[r]
        assert gathered[1] == 1.0 and 0.0 < gathered[0] < expected_first, (r, gathered)
        assert summed == [1.0]
    assert results[1][2] > 15.0, results[1][2]  # rank 1 really waited longer than XLA's limit


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 4])
def test_torch_xla_style_training_script_on_digits(devices, tmp_path):
    """MpDeviceLoader, accuracy by xm.mesh_reduce, xm.rendezvous, per-rank xm.save, consolidation:
    >= 97 % test accuracy at 1 and 4 XLA:CPU devices, and the consolidated model scores the same."""
    import json
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    proc = subprocess.run([sys.executable, os.path.join(here, "torch_xla_style_digits.py"), "--ckpt_dir", str(tmp_path),
                           "--batch_size", str(32 // devices)], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    result = json.loads(lines[0][len("RESULT "):])
    assert result["world_size"] == devices
    assert result["accuracies"][-1] >= 97.0, result
    assert abs(result["consolidated_accuracy"] - result["accuracies"][-1]) < 1e-3, result
    assert len(list(tmp_path.glob("final_ckpt_rank-*.pth"))) == devices




def _optimizer_step_program(use_xm_step):
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    from xla_fsdp.checkpoints import full_state_dict
    dev, r = torch_xla.device(), xr.global_ordinal()
    with BUILD_LOCK:  # the device threads share torch's CPU generator
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = FSDP(net.to(dev))
    plain = torch.nn.Linear(2, 2).to(dev)  # not sharded: xm.optimizer_step must still all-reduce it
    with torch.no_grad():
        plain.weight.fill_(float(r))
        plain.bias.zero_()
    opt = torch.optim.SGD(list(model.parameters()) + list(plain.parameters()), lr=0.1)
    g = torch.Generator().manual_seed(r)
    for _ in range(3):
        x = torch.randn(4, 6, generator=g).to(dev)
        loss = model(x).square().mean() + plain(torch.ones(1, 2).to(dev)).sum() * 0
        plain.weight.grad = torch.full((2, 2), float(r)).to(dev)  # differs by rank: all-reduce averages it
        loss.backward()
        plain.weight.grad = torch.full((2, 2), float(r)).to(dev)
        if use_xm_step:
            xm.optimizer_step(opt)
        else:
            opt.step()
        opt.zero_grad()
        xla_fsdp.sync()
    state = {k: v.cpu() for k, v in full_state_dict(model, rank0_only=False).items()}
    return state, plain.weight.detach().cpu()


@pytest.mark.parametrize("use_xm_step", [False, True])
def test_xm_optimizer_step_leaves_fsdp_gradients_alone(use_xm_step, monkeypatch):
    """``xm.optimizer_step`` all-reduces every gradient the optimizer holds; FSDP's are already
    reduced, so the result must equal ``optimizer.step()`` (it was 0.41 off after 3 steps), while a
    parameter FSDP does not own is still averaged over ranks."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    results = run_multiprocess(_optimizer_step_program, use_xm_step)
    reference = run_multiprocess(_optimizer_step_program, False) if use_xm_step else results
    for r in range(2):
        state, plain = results[r]
        for key, value in reference[0][0].items():
            assert torch.allclose(state[key], value, atol=1e-6), key
        # plain.weight: starts at r; grad r on rank r; xm.optimizer_step averages it to 0.5 per step
        step_grad = 0.5 if use_xm_step else float(r)
        assert torch.allclose(plain, torch.full((2, 2), r - 3 * 0.1 * step_grad)), (r, plain)


def test_safe_globals_blocks_of_rank_threads_leave_each_other_alone(tmp_path):
    """The HF Trainer loads its RNG files inside torch.serialization.safe_globals: with rank threads,
    one rank leaving the block removed the globals while another was loading (its resume at 2
    XLA:CPU devices failed 1 run in 6 with "Weights only load failed")."""
    from torch._weights_only_unpickler import _safe_globals
    from xla_fsdp.collectives.thread_safety import install_shared_safe_globals
    torch_enter = _safe_globals.__enter__
    with xla_fsdp.patches.scope():  # as xla_fsdp.enable_xla_cpu_devices installs it, for this test only
        install_shared_safe_globals()
        assert _safe_globals.__enter__ is not torch_enter
        _two_threads_in_safe_globals_blocks(tmp_path)
    assert _safe_globals.__enter__ is torch_enter  # undone on leaving the scope


def _two_threads_in_safe_globals_blocks(tmp_path):
    import numpy as np
    path = tmp_path / "rng_state_0.pth"
    torch.save({"numpy": np.random.get_state()}, path)
    allow = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    inside, left = threading.Event(), threading.Event()

    def other_rank():
        inside.wait()
        with torch.serialization.safe_globals(allow):
            pass
        left.set()

    before = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()  # others imported here may have allowed numpy for good
    try:
        thread = threading.Thread(target=other_rank)
        thread.start()
        with torch.serialization.safe_globals(allow):
            inside.set()
            left.wait()
            loaded = torch.load(path, weights_only=True)  # after the other rank left its block
        thread.join()
        assert loaded["numpy"][0] == "MT19937"
        assert not set(allow) & set(torch.serialization.get_safe_globals())  # gone once the last block is left
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


@pytest.mark.fast
def test_a_rank_waiting_for_a_silent_peer_says_so_and_stops(monkeypatch, capfd):
    """A peer that never arrives at a host exchange (hung, or gone without an error) cost 600 s in
    silence. Now the waiting rank names the missing ranks every NOTICE_S seconds and stops after
    XLA_FSDP_HOST_TIMEOUT_S with an error naming them; a bad value is refused."""
    from xla_fsdp.collectives import host_exchange
    monkeypatch.setattr(host_exchange, "NOTICE_S", 0.2)
    monkeypatch.setenv("XLA_FSDP_HOST_TIMEOUT_S", "0.5")
    exchange = host_exchange.ThreadExchange("test meeting", 3)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[1, 2\] did not reach the test meeting within 0.5 s"):
        exchange.gather(0, "mine")
    assert time.monotonic() - start < 5
    assert "waited 0 s for ranks [1, 2] at the test meeting; it stops after 0.5 s" in capfd.readouterr().err
    monkeypatch.setenv("XLA_FSDP_HOST_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="XLA_FSDP_HOST_TIMEOUT_S='soon' is not a positive number"):
        host_exchange.ThreadExchange("test meeting", 2).gather(0, "mine")
