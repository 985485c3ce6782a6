"""Ragged paged attention that reads only the blocks a group still needs."""

from pallas_kernels.paged_attention.kernel import paged_attention
from pallas_kernels.paged_attention.reference import paged_attention_reference
from pallas_kernels.paged_attention.softmax import MASK_VALUE

__all__ = ["MASK_VALUE", "paged_attention", "paged_attention_reference"]
