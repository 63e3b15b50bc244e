import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_terminal_summary(terminalreporter):
    module = sys.modules.get("test_equivalence")
    if module is not None and module.DEVIATIONS:
        terminalreporter.write_line("largest deviation from unsharded training, per transport:")
        for transport, worst in sorted(module.DEVIATIONS.items()):
            terminalreporter.write_line(f"  {transport}: loss {worst['loss']:.2e}, parameters {worst['param']:.2e}")
    if module is not None and module.BYTES:
        terminalreporter.write_line("per-rank params+grads+optimizer bytes (max over ranks) vs ideal total/N:")
        terminalreporter.write_line("  transport ws config                       bytes     ideal  ratio  padding")
        for transport, ws, name, got, ideal, pad in sorted(module.BYTES):
            terminalreporter.write_line(f"  {transport:9s} {ws:2d} {name:25s} {got:9d} {ideal:9.0f}  {got / ideal:5.3f}  {pad:7.0f}")


@pytest.fixture(scope="module")
def gloo():
    """A one-rank gloo group in this process, for single-rank API tests (multi-rank cases spawn
    real ranks through harness.run_gloo / run_xla)."""
    import tempfile
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
