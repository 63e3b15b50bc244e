"""Lightning Fabric's XLA FSDP strategy, unchanged: run under ``python -m xla_fsdp.compat`` (its
``torch_xla.distributed.fsdp`` is xla_fsdp), it trains on every XLA device, saves a sharded
checkpoint, loads it into a new model and optimizer, and prints what test_clients compares."""
import json
import os
import sys

import torch
import torch.nn as nn
from lightning_fabric import Fabric
from lightning_fabric.accelerators import XLAAccelerator
from lightning_fabric.strategies import XLAFSDPStrategy


class XlaCpuAccelerator(XLAAccelerator):
    """Lightning's XLA accelerator counts TPU chips only: here it counts XLA:CPU's devices."""

    @staticmethod
    def auto_device_count() -> int:
        return int(os.environ.get("CPU_NUM_DEVICES", "1"))  # the runtime must not start before the launch

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def parse_devices(devices):
        return int(devices)

    @staticmethod
    def get_parallel_devices(devices):
        return [torch.device("xla", i) for i in range(int(devices))]


class XLAFSDPStrategyCheckedFirst(XLAFSDPStrategy):
    """Lightning's ``save_checkpoint`` checks on every rank that the folder is empty, then writes with no
    barrier between: a fast rank's shard file fails a slow rank's check (seen once in CI,
    where the ranks are threads; on TPU ranks are processes on a shared disk and the race is the same).
    A barrier before each rank writes closes it (its parallel save only; not with sequential_save)."""

    def _save_checkpoint_shard(self, *args, **kwargs):
        if not self._sequential_save:
            self.barrier("every-rank-checked-the-folder")
        super()._save_checkpoint_shard(*args, **kwargs)


def batches(rank: int, steps: int):
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(steps)]


def build(fabric: Fabric):
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, optimizer


def train(fabric: Fabric, model, optimizer, data):
    losses = []
    for x, y in data:
        x, y = x.to(fabric.device), y.to(fabric.device)
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def run(fabric: Fabric, folder: str) -> None:
    model, optimizer = build(fabric)
    data = batches(fabric.global_rank, 4)
    losses = train(fabric, model, optimizer, data[:2])
    fabric.save(folder, {"model": model, "optimizer": optimizer, "step": 2})
    resumed_model, resumed_optimizer = build(fabric)
    state = {"model": resumed_model, "optimizer": resumed_optimizer}
    rest = fabric.load(folder, state)
    after_load = train(fabric, resumed_model, resumed_optimizer, data[2:])
    continued = train(fabric, model, optimizer, data[2:])
    line = json.dumps({"rank": fabric.global_rank, "world_size": fabric.world_size, "losses": losses,
                       "step": rest.get("step"), "after_load": after_load, "continued": continued})
    sys.stdout.write(f"RESULT {line}\n")  # one write: the ranks are threads of one process
    sys.stdout.flush()


if __name__ == "__main__":
    fabric = Fabric(accelerator=XlaCpuAccelerator(), devices=XlaCpuAccelerator.auto_device_count(),
                    # the device threads build their models from the CPU generator they share:
                    # xla_fsdp would stop at the first forward; this takes rank 0's parameters
                    strategy=XLAFSDPStrategyCheckedFirst(state_dict_type="sharded", sync_module_states=True))
    fabric.launch(run, sys.argv[1])
