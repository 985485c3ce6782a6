"""What the tests of the Mosaic GPU bodies share: the skip on a jax without them, and the race detector's verdict."""

from __future__ import annotations

import jax
import pytest

from pallas_kernels import _common

needs_mosaic_gpu = pytest.mark.skipif(
    not _common.mosaic_gpu_supported(), reason=f"Mosaic GPU bodies need jax >= 0.11, this is {jax.__version__}"
)


def no_races_found() -> bool:
    """Whether the Mosaic GPU interpreter's race detector (on in every interpreted Mosaic GPU call) found none."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    return not interpret_pallas_call.get_races().races_found
