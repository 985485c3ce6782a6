"""Tile sizes and launch parameters, kept apart from the kernels.

Not tuned on hardware yet: these are safe starting points. A tile has
`block_q * group_pad` rows; Triton's matrix unit wants at least 16 rows and
power-of-2 shapes.
"""

from __future__ import annotations

MIN_ROWS = 16


def default_block_q(group_pad: int) -> int:
    """Queries per tile: just enough rows for one 16-row matrix tile. Decode
    tiles hold one query each, so larger tiles only add padding rows there."""
    return max(1, MIN_ROWS // group_pad)


def triton_launch(head_size: int) -> tuple[int, int]:
    """(num_warps, num_stages) for the Triton backend."""
    return (4 if head_size <= 128 else 8), 2
