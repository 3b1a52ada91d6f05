"""Which parameters hold zero rows after their real ones, and how many rows are real (torch only: the checkpoints read
it without XLA). The SPMD engine pads ([Note: padded rows] in xla_fsdp/gspmd_engine/padded_rows.py)."""

from __future__ import annotations

import torch

_REAL_ROWS = "_xla_fsdp_real_rows"


def set_real_rows(param: torch.Tensor, rows: int) -> None:
    """Records that `param` holds `rows` real rows and zero rows after them."""
    setattr(param, _REAL_ROWS, rows)


def real_shape(param: torch.Tensor) -> torch.Size:
    """The shape the model's state dict shows: without the zero rows of a padded parameter."""
    rows = getattr(param, _REAL_ROWS, None)
    return param.shape if rows is None else torch.Size((rows,) + tuple(param.shape[1:]))
