"""Paged scatter: write new tokens' K/V (or MLA latent) rows at their slots, in place."""

from pallas_kernels.paged_scatter.kernel import paged_scatter
from pallas_kernels.paged_scatter.reference import paged_scatter_reference

__all__ = ["paged_scatter", "paged_scatter_reference"]
