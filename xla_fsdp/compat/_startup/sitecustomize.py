"""Run at the start of every Python process by ``python -m xla_fsdp.compat SCRIPT`` (this folder is
put on PYTHONPATH): serve ``torch_xla.distributed.fsdp`` from xla_fsdp there too, since
torch_xla.launch starts its device processes afresh, and, with ``PJRT_DEVICE=CPU``, let several
XLA:CPU devices run as threads of one process (the launcher's job: the program is unchanged).

Both happen right after the process imports torch_xla, not at start-up: the helper processes a
program starts without torch_xla (multiprocessing's resource tracker, tools it runs) would otherwise
each import torch_xla and xla_fsdp for nothing, about 6 s of CPU apiece. torch_xla reads the settings
``enable_xla_cpu_devices`` makes when its runtime starts, after the import.

Only this file's standard-library finder is installed at start-up; it leaves ``sys.meta_path`` as it
found it once torch_xla is imported (``xla_fsdp.patches`` lists what the two calls change)."""
import os
import sys

ENV = "XLA_FSDP_REPLACE_TORCH_XLA_FSDP"  # set by python -m xla_fsdp.compat


def _serve_xla_fsdp() -> None:
    from xla_fsdp import enable_xla_cpu_devices
    from xla_fsdp.compat import replace_torch_xla_fsdp

    enable_xla_cpu_devices()
    replace_torch_xla_fsdp()


class _Loader:
    """torch_xla's loader, then :func:`_serve_xla_fsdp` once torch_xla has run."""

    def __init__(self, loader, finder):
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        if self.finder in sys.meta_path:  # the first import only
            sys.meta_path.remove(self.finder)
            _serve_xla_fsdp()

    def __getattr__(self, name):  # the rest of the loader's interface (resources, get_code)
        return getattr(self.loader, name)


class _AfterTorchXla:
    """A ``sys.meta_path`` finder for ``torch_xla`` alone: the spec the other finders give, its loader
    wrapped. It stays until torch_xla is imported: a lookup alone (``importlib.util.find_spec``, which
    libraries call to see whether torch_xla is installed) loads nothing."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch_xla":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if finder is self or find is None else find(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, self)
                return spec
        return None


if os.environ.get(ENV) == "1":
    if "torch_xla" in sys.modules:  # imported by a site hook before this one
        _serve_xla_fsdp()
    else:
        sys.meta_path.insert(0, _AfterTorchXla())
