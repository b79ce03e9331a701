"""Layer-adaptive optimizers that stay exact when parameters are sharded.

- :class:`LARS` and :class:`LAMB`: timm's ``Lars`` / ``Lamb`` (same argument names and
  defaults; LAMB does not clip internally by default), with trust ratios built from the
  norms of whole parameters under FSDP2 (one collective per step) and DDP;
- :func:`param_groups`: weights in a decayed, adapted group; biases and norm gains in a
  group without weight decay or adaptation.

See docs/library/optimizers.md.
"""

from .groups import param_groups
from .lamb import LAMB
from .lars import LARS

__all__ = ["LAMB", "LARS", "param_groups"]
