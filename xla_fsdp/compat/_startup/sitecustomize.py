"""Run at the start of every Python process by ``python -m xla_fsdp.compat SCRIPT`` (this folder is
put on PYTHONPATH): serve ``torch_xla.distributed.fsdp`` from xla_fsdp there too, since
torch_xla.launch starts its device processes afresh, and, with ``PJRT_DEVICE=CPU``, let several
XLA:CPU devices run as threads of one process (the launcher's job: the program is unchanged)."""
import os

if os.environ.get("XLA_FSDP_REPLACE_TORCH_XLA_FSDP") == "1":
    from xla_fsdp import enable_xla_cpu_devices
    from xla_fsdp.compat import replace_torch_xla_fsdp

    enable_xla_cpu_devices()
    replace_torch_xla_fsdp()
