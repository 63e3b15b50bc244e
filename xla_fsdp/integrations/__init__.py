"""What the ecosystem's trainers need from xla_fsdp: Accelerate/Transformers FSDP configs read into
wrapper keywords (``accelerate_config``), and Accelerate's clipping routed to ours
(``accelerate_clipping``)."""
from .accelerate_config import from_accelerate

__all__ = ["from_accelerate"]
