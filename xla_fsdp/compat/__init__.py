"""torch_xla's FSDP import paths, served by xla_fsdp, so programs written for torch_xla's FSDP run
unchanged: ``replace_torch_xla_fsdp()`` in a process, or ``python -m xla_fsdp.compat SCRIPT [ARGS]``
without editing the program (see ``__main__``)."""
from .torch_xla_paths import replace_torch_xla_fsdp, torch_xla_modules
from .torch_xla_utils import (BucketizedReduceScatter, DummyReduceScatter, XLAPatchedLinear,
                              apply_xla_patch_to_nn_linear, dummy_all_gather, dummy_all_reduce)

__all__ = ["BucketizedReduceScatter", "DummyReduceScatter", "XLAPatchedLinear", "apply_xla_patch_to_nn_linear",
           "dummy_all_gather", "dummy_all_reduce", "replace_torch_xla_fsdp", "torch_xla_modules"]
