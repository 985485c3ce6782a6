"""The physical cache of a plan: one buffer, typed views over it, and where each token lands.

Dimension legend:
  B  blocks (`num_blocks`, the null block 0 included)
  L  layers of a view (layer slots of the buffer for a typed cache)
  H  KV heads, N tokens per block (1 for a state layer), C row channels
  T  tokens of a call

Every view of a plan (`KVCacheConfig.tensors`) addresses the same buffer of
`num_blocks × bytes_per_block` bytes:

    address = offset + layer × layer_stride + block × block_stride + position × token_stride + head × head_stride

DeepSeek-V3.2's sparse attention, 2 layers, block 64, block-outer: one block is
100,864 B and packs both views of its one group,

    | MLA L0      | MLA L1      | IDX L0     | IDX L1     |
    0             41,984        83,968       92,416       100,864
    MLA view: offset 0,      layer_stride 41,984, block_stride 100,864, row 656 B
    IDX view: offset 83,968, layer_stride  8,448, block_stride 100,864, row 132 B

so token 130 with `block_table[2] = 5` (slot 5 × 64 + 2 = 322) lands at
41,984 + 5 × 100,864 + 2 × 656 in MLA layer 1.

How the buffer is held (`buffer_spec`):
- **Typed** (`is_typed`): every view has one row shape and dtype, with no padded
  pages (Gemma, Llama, gpt-oss). The buffer is one array in the layout's axis
  order, e.g. `[B, L, H, N, C]` for BLHNC — exactly what the Pallas kernels take,
  with `layer_idx` choosing the layer. `typed_view(cache, cfg, i)` returns the
  array itself: nothing is copied, ever.
- **Bytes** otherwise (rows that mix dtypes, like DeepSeek-V3.2's FP8 latent +
  float32 scales + bfloat16 RoPE part; a Mamba state beside attention pages; pages
  of different sizes in one block): one uint8 array `[size // U, U]`, where rows
  of U bytes (`bytes_per_block` for block-outer layouts, the gcd of the views'
  strides for layer-outer ones) keep every index within int32.

What XLA does with the typed access to a byte buffer (tests/memory/test_layout.py
checks the gather and the in-place write on CPU):
- `reshape` of the buffer is a bitcast (no copy), and a slice fuses into its consumer.
- A bitcast between dtypes of one width (uint8 → float8) is free; between
  widths (uint8 → bfloat16, float32) XLA's CPU and GPU compilers expand it into
  shifts and ORs (BitcastDtypesExpander), so a typed view is *computed*, never
  aliased.
- `typed_view` is therefore lazy only inside a jit: a gather or elementwise op
  that consumes it reads the buffer directly (nothing materialised); a jit
  output, a custom call such as a Pallas kernel, or (on CPU) a reduction gets a
  materialised copy of the whole view. Kernels that should read a byte buffer
  without a copy must take the uint8 buffer and bitcast inside the kernel.
- `write_rows` / `read_rows` scatter and gather only the bytes of the given
  slots, at the plan's addresses. `write_rows` donates the cache, so the scatter
  updates it in place (output aliased to input; temporaries the size of the rows).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.planner.config import LAYOUTS, KVCacheConfig, KVCacheTensor
from jaxkv.planner.planning import buffer_views
from jaxkv.planner.specs import NULL_BLOCK, AttentionSpec, MambaSpec, dtype_bytes

_frozen = dataclasses.dataclass(frozen=True, slots=True, kw_only=True)


@_frozen
class RowField:
    """A typed part of a view's head row: `shape` elements of `dtype` from byte `offset`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.offset < 0 or any(d <= 0 for d in self.shape):
            raise ValueError(f"field {self.name!r}: offset={self.offset} must be >= 0 and shape={self.shape} positive")

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * dtype_bytes(self.dtype)


DSA_LATENT_FIELDS = (
    RowField(name="latent", dtype="float8_e4m3fn", shape=(512,), offset=0),
    RowField(name="scales", dtype="float32", shape=(4,), offset=512),
    RowField(name="rope", dtype="bfloat16", shape=(64,), offset=528),
)
"""DeepSeek-V3.2's 656 B MLA row (fp8_ds_mla): FP8 latent, one float32 scale per 128, bfloat16 RoPE part."""

DSA_INDEXER_FIELDS = (
    RowField(name="key", dtype="float8_e4m3fn", shape=(128,), offset=0),
    RowField(name="scale", dtype="float32", shape=(1,), offset=128),
)
"""DeepSeek-V3.2's 132 B indexer row: FP8 key and its float32 scale."""


def state_fields(spec: MambaSpec) -> tuple[RowField, ...]:
    """The state tensors of a state layer's page, one after the other."""
    fields, offset = [], 0
    for i, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes)):
        fields.append(RowField(name=f"state{i}", dtype=dtype, shape=shape, offset=offset))
        offset += fields[-1].num_bytes
    return tuple(fields)


def whole_row(tensor: KVCacheTensor) -> RowField:
    """The whole head row of a view: C channels of the spec's dtype (raw bytes for a state)."""
    if isinstance(tensor.spec, AttentionSpec):
        dtype = tensor.spec.dtype
        return RowField(name="row", dtype=dtype, shape=(tensor.head_bytes // dtype_bytes(dtype),))
    return RowField(name="state", dtype="uint8", shape=(tensor.head_bytes,))


# Buffer.


def is_typed(cfg: KVCacheConfig) -> bool:
    """True when one typed array in the layout's axis order holds every view (see the module docstring)."""
    return _typed_shape(cfg) is not None


def buffer_spec(cfg: KVCacheConfig) -> jax.ShapeDtypeStruct:
    """Shape and dtype of the cache array of `cfg` (typed, else bytes)."""
    shape = _typed_shape(cfg)
    if shape is not None:
        return jax.ShapeDtypeStruct(shape, cfg.tensors[0].spec.dtype)
    size, unit = cfg.tensors[0].size, _row_unit(cfg)
    return jax.ShapeDtypeStruct((size // unit, unit), jnp.uint8)


def allocate_cache(cfg: KVCacheConfig) -> jax.Array:
    """The zero-filled cache of `cfg`. For a sharded cache, jit this with `static_argnums=0` and `out_shardings`."""
    spec = buffer_spec(cfg)
    return jnp.zeros(spec.shape, spec.dtype)


def with_layout(cfg: KVCacheConfig, layout: str) -> KVCacheConfig:
    """The same plan (groups, blocks) with its views laid out in `layout`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    nested = {
        name: with_layout(getattr(cfg, name), layout)
        for name in ("all_full", "vllm_grouping")
        if getattr(cfg, name) is not None
    }
    tensors = buffer_views(cfg.groups, cfg.num_blocks, layout)
    return dataclasses.replace(cfg, layout=layout, tensors=tensors, **nested)


def num_layer_slots(cfg: KVCacheConfig) -> int:
    """L of a typed cache: page-sized layer slots per block (a group with fewer layers leaves the rest unused)."""
    t = cfg.tensors[0]
    return cfg.bytes_per_block // t.page_bytes


def _typed_shape(cfg: KVCacheConfig) -> tuple[int, ...] | None:
    t0 = cfg.tensors[0]
    if not isinstance(t0.spec, AttentionSpec) or t0.page_bytes != t0.spec.real_page_size_bytes:
        return None
    if cfg.bytes_per_block % t0.page_bytes:
        return None
    num_slots = num_layer_slots(cfg)
    block_outer = cfg.layout.startswith("B")
    layer_stride = t0.page_bytes if block_outer else cfg.num_blocks * t0.page_bytes
    block_stride = cfg.bytes_per_block if block_outer else t0.page_bytes

    def same_array(t: KVCacheTensor) -> bool:
        return (
            isinstance(t.spec, AttentionSpec)
            and (t.num_heads, t.tokens_per_block, t.head_bytes, t.page_bytes, t.spec.dtype)
            == (t0.num_heads, t0.tokens_per_block, t0.head_bytes, t0.page_bytes, t0.spec.dtype)
            and (t.offset, t.layer_stride, t.block_stride) == (0, layer_stride, block_stride)
        )

    if not all(same_array(t) for t in cfg.tensors):
        return None
    dims = {
        "B": cfg.num_blocks,
        "L": num_slots,
        "H": t0.num_heads,
        "N": t0.tokens_per_block,
        "C": t0.head_bytes // dtype_bytes(t0.spec.dtype),
    }
    return tuple(dims[axis] for axis in cfg.layout)


def _row_unit(cfg: KVCacheConfig) -> int:
    """U, the bytes of one row of a byte buffer: every block stride (and, layer-outer, every offset
    and layer stride) is a multiple of it."""
    if cfg.layout.startswith("B"):
        return cfg.bytes_per_block
    return math.gcd(*(n for t in cfg.tensors for n in (t.offset, t.layer_stride, t.block_stride)))


# Finding layers and tokens.


def find_layer(cfg: KVCacheConfig, layer: str) -> tuple[int, int]:
    """(index of the view in `cfg.tensors`, layer index in that view) of a layer; a KV-sharing
    layer resolves to the layer whose cache it reuses."""
    owner = dict(cfg.shared_layers).get(layer, layer)
    for i, t in enumerate(cfg.tensors):
        if owner in t.layers:
            return i, t.layers.index(owner)
    names = [n for t in cfg.tensors for n in t.layers]
    raise ValueError(f"layer {layer!r} is not in this plan; its layers are {names}")


@_frozen
class LayerAddress:
    """Where one layer keeps a token: view, layer index in the view, byte address of head 0."""

    layer: str
    tensor_idx: int
    layer_idx: int
    address: int
    row_bytes: int


@_frozen
class TokenLocation:
    """The arithmetic from a token position to its slot and its bytes, for one group.

    logical_block = position // block_size; block_id = block_table[logical_block];
    slot = block_id × N + position_in_block (N = block_size; 1 for a state group,
    whose block holds one state, at position_in_block 0); one address per layer.
    """

    group_idx: int
    position: int
    block_size: int
    logical_block: int
    block_id: int
    position_in_block: int
    slot: int
    layers: tuple[LayerAddress, ...]

    def address(self, layer: str) -> int:
        for a in self.layers:
            if a.layer == layer:
                return a.address
        raise ValueError(f"layer {layer!r} is not in group {self.group_idx}: {[a.layer for a in self.layers]}")


def locate_token(cfg: KVCacheConfig, group_idx: int, position: int, block_table) -> TokenLocation:
    """Slot mapping and byte addresses of the token at `position` in group `group_idx`.

    `block_table` is the request's table of that group (sequence of block ids).
    These are the numbers the kernels use: `paged_scatter` writes the token at
    `slot`, and its row starts at `address` in the buffer's bytes.
    """
    if not 0 <= group_idx < len(cfg.groups):
        raise ValueError(f"{group_idx=} must be in [0, {len(cfg.groups)})")
    if position < 0:
        raise ValueError(f"{position=} must be non-negative")
    block_size = cfg.groups[group_idx].block_size
    logical_block = position // block_size
    if logical_block >= len(block_table):
        raise ValueError(
            f"position {position} is in logical block {logical_block}, past the block table "
            f"({len(block_table)} entries); allocate the token first"
        )
    block_id = int(block_table[logical_block])
    if not 0 < block_id < cfg.num_blocks:
        raise ValueError(
            f"block_table[{logical_block}] = {block_id}: "
            + ("the null block, so the group does not hold this token (behind its window or not allocated)"
               if block_id == NULL_BLOCK else f"not a block id of this pool (1 to {cfg.num_blocks - 1})")
        )  # fmt: skip
    views = [(i, t) for i, t in enumerate(cfg.tensors) if t.group_idx == group_idx]
    tokens_per_block = views[0][1].tokens_per_block
    position_in_block = position % block_size if tokens_per_block == block_size else 0
    layers = tuple(
        LayerAddress(
            layer=name,
            tensor_idx=i,
            layer_idx=j,
            address=t.address(j, block_id, position_in_block),
            row_bytes=t.row_bytes,
        )
        for i, t in views
        for j, name in enumerate(t.layers)
    )
    return TokenLocation(
        group_idx=group_idx,
        position=position,
        block_size=block_size,
        logical_block=logical_block,
        block_id=block_id,
        position_in_block=position_in_block,
        slot=block_id * tokens_per_block + position_in_block,
        layers=layers,
    )


# Typed access.


def typed_view(cache: jax.Array, cfg: KVCacheConfig, tensor_idx: int, field: RowField | None = None) -> jax.Array:
    """View `tensor_idx` of the cache as a typed array in the layout's axis order.

    Returns [B, L, H, N, *field.shape] for BLHNC ([L, B, N, H, ...] for LBNHC, and
    so on); `field` defaults to the whole row (`whole_row`). A typed cache with the
    default field is returned as is (L = `num_layer_slots`), so kernels get it
    without a copy; anything else is computed from the bytes (see the module
    docstring for when XLA copies).
    """
    t = cfg.tensors[tensor_idx]
    field = _check_field(t, field)
    if is_typed(cfg):
        if field == whole_row(t):
            return cache
        return _from_bytes(_slice_field(_to_bytes(cache), field), field)
    num_layers = len(t.layers)
    if cfg.layout.startswith("B"):
        pages = cache.reshape(cfg.num_blocks, cfg.bytes_per_block)
        pages = pages[:, t.offset : t.offset + num_layers * t.layer_stride].reshape(-1, num_layers, t.layer_stride)
    else:
        pages = cache.reshape(-1)[t.offset : t.offset + num_layers * t.layer_stride]
        pages = pages.reshape(num_layers, cfg.num_blocks, t.block_stride)
    pages = pages[:, :, : t.num_heads * t.tokens_per_block * t.head_bytes]  # drop page padding
    inner = (t.num_heads, t.tokens_per_block) if cfg.layout.endswith("HNC") else (t.tokens_per_block, t.num_heads)
    rows = pages.reshape(*pages.shape[:2], *inner, t.head_bytes)
    return _from_bytes(_slice_field(rows, field), field)


@functools.partial(jax.jit, static_argnames=("cfg", "tensor_idx", "field"), donate_argnames=("cache",))
def write_rows(
    cache: jax.Array,  # from allocate_cache(cfg)
    rows: jax.Array,  # [T, H, *field.shape] of field.dtype
    slot_mapping: jax.Array,  # int32[T]
    layer_idx: int | jax.Array,  # int32 scalar
    *,
    cfg: KVCacheConfig,
    tensor_idx: int = 0,
    field: RowField | None = None,
) -> jax.Array:  # the same buffer, updated
    """Writes each token's row (or `field` of it) at its slot in layer `layer_idx` of view `tensor_idx`.

    Slot s is block `s // N`, position `s % N`; the bytes land at the plan's
    addresses (`KVCacheTensor.address`). Slot −1, a slot outside
    [0, num_blocks × N) or a `layer_idx` outside the view writes nothing.
    `field` defaults to the whole row ([T, H, C] of the spec's dtype).

    Jitted, config static, `layer_idx` traced (one compilation serves every
    layer); the cache is donated and updated in place: use the returned array.
    """
    t = cfg.tensors[tensor_idx]
    field = _check_field(t, field)
    expected = (slot_mapping.shape[0], t.num_heads, *field.shape)
    if rows.shape != expected or rows.dtype != jnp.dtype(field.dtype):
        raise ValueError(
            f"rows {rows.shape} {rows.dtype} must be [T, H, *field.shape] = {expected} of {field.dtype} "
            f"for view {tensor_idx} (field {field.name!r})"
        )
    row_bytes = _to_bytes(rows.reshape(*expected[:2], -1))  # [T, H, field bytes]
    if is_typed(cfg):
        index = _typed_index(cache, cfg, t, slot_mapping, layer_idx, field)
        channels = RowField(name="channels", dtype=cache.dtype, shape=(field.num_bytes // cache.dtype.itemsize,))
        return cache.at[index].set(_from_bytes(row_bytes, channels), mode="drop")
    row, col = _byte_index(cfg, t, slot_mapping, layer_idx, field)
    return cache.at[row, col].set(row_bytes, mode="drop")


@functools.partial(jax.jit, static_argnames=("cfg", "tensor_idx", "field"))
def read_rows(
    cache: jax.Array,  # from allocate_cache(cfg)
    slot_mapping: jax.Array,  # int32[T]
    layer_idx: int | jax.Array,  # int32 scalar
    *,
    cfg: KVCacheConfig,
    tensor_idx: int = 0,
    field: RowField | None = None,
) -> jax.Array:  # [T, H, *field.shape] of field.dtype
    """The rows (or `field` of them) at the given slots of layer `layer_idx` of view `tensor_idx`.

    Zeros for the slots and layers `write_rows` ignores. Jitted, config static.
    """
    t = cfg.tensors[tensor_idx]
    field = _check_field(t, field)
    if is_typed(cfg):
        index = _typed_index(cache, cfg, t, slot_mapping, layer_idx, field)
        row_bytes = _to_bytes(cache.at[index].get(mode="fill", fill_value=0))
    else:
        row, col = _byte_index(cfg, t, slot_mapping, layer_idx, field)
        row_bytes = cache.at[row, col].get(mode="fill", fill_value=0)
    return _from_bytes(row_bytes, field)


def _check_field(t: KVCacheTensor, field: RowField | None) -> RowField:
    if field is None:
        return whole_row(t)
    if field.offset + field.num_bytes > t.head_bytes:
        raise ValueError(
            f"field {field.name!r} covers bytes [{field.offset}, {field.offset + field.num_bytes}) of a "
            f"{t.head_bytes} B head row of {t.layers[0]!r}; choose a field inside the row"
        )
    return field


def _valid(t: KVCacheTensor, num_blocks: int, slot_mapping, layer_idx):
    """bool[T]: slots of the pool and a layer of the view; everything else writes nothing."""
    slot_mapping = jnp.asarray(slot_mapping, jnp.int32)
    layer_idx = jnp.asarray(layer_idx, jnp.int32)
    in_layer = (layer_idx >= 0) & (layer_idx < len(t.layers))
    return (slot_mapping >= 0) & (slot_mapping < num_blocks * t.tokens_per_block) & in_layer


def _typed_index(cache, cfg, t, slot_mapping, layer_idx, field) -> tuple:
    """Index (layout order) of the field's K channels of each token and head of a typed cache;
    the indices broadcast to [T, H, K]."""
    itemsize = cache.dtype.itemsize
    if field.offset % itemsize or field.num_bytes % itemsize:
        raise ValueError(
            f"field {field.name!r} (bytes {field.offset} to {field.offset + field.num_bytes}) does not cover "
            f"whole {cache.dtype} channels of this typed cache; align it to {itemsize} B"
        )
    slot_mapping = jnp.asarray(slot_mapping, jnp.int32)
    valid = _valid(t, cfg.num_blocks, slot_mapping, layer_idx)
    n = t.tokens_per_block
    where = {
        "B": jnp.where(valid, slot_mapping // n, cfg.num_blocks)[:, None, None],  # out of range: dropped
        "L": jnp.asarray(layer_idx, jnp.int32),
        "H": jnp.arange(t.num_heads)[None, :, None],
        "N": (slot_mapping % n)[:, None, None],
        "C": (field.offset // itemsize + jnp.arange(field.num_bytes // itemsize))[None, None, :],
    }
    return tuple(where[axis] for axis in cfg.layout)


def _byte_index(cfg, t, slot_mapping, layer_idx, field):
    """(row, col), each int32[T, H, field bytes], of a byte buffer [size // U, U].

    address = offset + layer × layer_stride + block × block_stride + inner, split
    into row = address // U and col = address % U term by term so nothing
    overflows int32: U divides block_stride, and either U is the whole block
    (block-outer: offset + layer × layer_stride + inner < U) or U divides offset
    and layer_stride (layer-outer).
    """
    unit = _row_unit(cfg)
    slot_mapping = jnp.asarray(slot_mapping, jnp.int32)
    layer_idx = jnp.asarray(layer_idx, jnp.int32)
    valid = _valid(t, cfg.num_blocks, slot_mapping, layer_idx)
    n = t.tokens_per_block
    block = (slot_mapping // n)[:, None, None]
    inner = (
        (slot_mapping % n)[:, None, None] * t.token_stride
        + jnp.arange(t.num_heads)[None, :, None] * t.head_stride
        + field.offset
        + jnp.arange(field.num_bytes)[None, None, :]
    )
    low = t.offset % unit + layer_idx * (t.layer_stride % unit) + inner
    row = t.offset // unit + layer_idx * (t.layer_stride // unit) + block * (t.block_stride // unit) + low // unit
    num_rows = t.size // unit
    return jnp.where(valid[:, None, None], row, num_rows), low % unit  # out of range: dropped


def _to_bytes(x: jax.Array) -> jax.Array:
    """[..., K] of any dtype -> uint8 [..., K × itemsize] (little-endian bytes of each element)."""
    if x.dtype == jnp.uint8:
        return x
    b = lax.bitcast_convert_type(x, jnp.uint8)
    return b.reshape(*x.shape[:-1], -1) if x.dtype.itemsize > 1 else b


def _slice_field(row_bytes: jax.Array, field: RowField) -> jax.Array:
    return row_bytes[..., field.offset : field.offset + field.num_bytes]


def _from_bytes(b: jax.Array, field: RowField) -> jax.Array:
    """uint8 [..., field bytes] -> [..., *field.shape] of field.dtype."""
    dtype = jnp.dtype(field.dtype)
    itemsize = dtype.itemsize
    b = b.reshape(*b.shape[:-1], *field.shape, *((itemsize,) if itemsize > 1 else ()))
    return b if dtype == jnp.uint8 else lax.bitcast_convert_type(b, dtype)


# Copies between blocks.


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def copy_blocks(
    cache: jax.Array,  # from allocate_cache(cfg)
    copies: jax.Array,  # int32[C, 2 or more]: source block, destination block, ...
    *,
    cfg: KVCacheConfig,
) -> jax.Array:  # the same buffer, updated
    """Copies whole blocks: every layer's page of block `copies[i, 0]` to block `copies[i, 1]`.

    The block copies the manager returns (`KVCacheManager.take_block_copies`,
    `AllocateResult.copies`: source, destination, valid tokens) go through here before the
    forward pass. A block-outer layout copies the block's whole row of the buffer; a
    layer-outer one each layer's `block_stride` bytes of the block, in every view. Rows whose
    source or destination is NULL_BLOCK (or outside the pool) copy nothing. All sources are
    read before any destination is written: destinations must be distinct, and no destination
    may be a source of the same call. Jitted, config static; the cache is donated and updated
    in place: use the returned array.
    """
    copies = jnp.asarray(copies, jnp.int32).reshape(-1, copies.shape[-1])
    src, dst = copies[:, 0], copies[:, 1]
    valid = (src > NULL_BLOCK) & (src < cfg.num_blocks) & (dst > NULL_BLOCK) & (dst < cfg.num_blocks)
    src = jnp.where(valid, src, NULL_BLOCK)
    if is_typed(cfg) or cfg.layout.startswith("B"):
        axis = cfg.layout.index("B") if is_typed(cfg) else 0  # a block-outer byte buffer has one row per block
        index = [slice(None)] * cache.ndim
        index[axis] = jnp.where(valid, dst, cfg.num_blocks)  # out of range: dropped
        return cache.at[tuple(index)].set(jnp.take(cache, src, axis=axis), mode="drop")
    # Layer-outer bytes: rows of U bytes; block b of layer l of view t spans block_stride // U rows.
    unit = _row_unit(cfg)
    num_rows = cache.shape[0]
    bases = sorted({(t.offset + layer * t.layer_stride) // unit for t in cfg.tensors for layer in range(len(t.layers))})
    span = max(t.block_stride for t in cfg.tensors) // unit
    if any(t.block_stride // unit != span for t in cfg.tensors):
        raise ValueError(
            f"views of one buffer have different block strides: {sorted({t.block_stride for t in cfg.tensors})}"
        )
    within = jnp.asarray(bases, jnp.int32)[:, None] + jnp.arange(span, dtype=jnp.int32)[None, :]  # [V, span]
    src_rows = within[None] + (src * span)[:, None, None]  # [C, V, span]
    dst_rows = jnp.where(valid[:, None, None], within[None] + (dst * span)[:, None, None], num_rows)
    return cache.at[dst_rows.reshape(-1)].set(cache[src_rows.reshape(-1)], mode="drop")
