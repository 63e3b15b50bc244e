"""Every command-line tool, one module each (argparse; problems end in one line and exit 2):
``consolidate`` (rank files -> one full state dict), ``resize`` (rank files for another world
size), ``convert`` (DCP both ways), ``inspect`` (metadata, sizes, checksums). Run as
``python -m xla_fsdp.cli.<name>``, or by the short names ``python -m xla_fsdp.consolidate_sharded_ckpts``
(torch_xla's), ``python -m xla_fsdp.resize``, ``python -m xla_fsdp.convert`` and
``python -m xla_fsdp.inspect``."""
