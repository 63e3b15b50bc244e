"""torch_xla defects fixed here, checked on XLA:CPU (one spawned device process per test)."""
import os
import threading

import pytest
import torch

import models

pytest.importorskip("torch_xla")


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
    from torch_xla._internal import pjrt
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "1")
    result = pjrt.run_multiprocess(_bf16_conv_and_embedding)[0]
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
    from torch_xla._internal import pjrt
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    messages = pjrt.run_multiprocess(_mismatched_construction)
    assert sorted(messages) == [0, 1]
    for msg in messages.values():
        assert "ranks built different FSDP units" in msg and "[" in msg, msg


LATE_S = 17  # XLA:CPU aborts a device rendezvous whose peers are 15 s late (5 s warning + 10 s)
_BUILD_LOCK = threading.Lock()  # the rank threads share torch's CPU generator


def _one_rank_late_to_its_first_forward():
    import time
    import torch_xla
    import torch_xla.runtime as xr
    import xla_fsdp
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    dev = torch_xla.device()
    with _BUILD_LOCK:
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
    from torch_xla._internal import pjrt
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    losses = pjrt.run_multiprocess(_one_rank_late_to_its_first_forward)
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
    with _BUILD_LOCK:
        torch.manual_seed(0)
        model = FSDP(models.MLP())
    if xr.global_ordinal() == 1:
        raise FileNotFoundError("rank file missing: ckpt_rank-00000001-of-00000002.pth")
    model(torch.zeros(2, 12).to(torch_xla.device())).sum()  # the first forward meets the peers


def test_a_failing_rank_stops_its_peers_with_its_error(tmp_path):
    """torch_xla.launch reports a rank's error only after every rank returned: rank 0 waited for the
    failed rank 1 at the first forward for 10 minutes (the host meeting's timeout)."""
    import subprocess
    import sys
    import time
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2", PYTHONPATH=here)
    program = ("import xla_fsdp, torch_xla, test_xla_defects as t\n"
               "if __name__ == '__main__':\n    torch_xla.launch(t._rank_one_fails_before_its_first_forward)\n")
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
        with _BUILD_LOCK:
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
    from torch_xla._internal import pjrt
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    results = pjrt.run_multiprocess(_train_with_and_without_profiler_annotations)
    assert sorted(results) == [0, 1]
    for runs in results.values():
        (plain_losses, plain_params), (losses, params) = runs[False], runs[True]
        assert losses == plain_losses
        assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
