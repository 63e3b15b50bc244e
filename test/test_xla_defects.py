"""torch_xla defects fixed here, checked on XLA:CPU (one spawned device process per test)."""
import os

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
