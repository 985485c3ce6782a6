"""A self-contained HTML picture of a plan's memory: one physical block in each layout, and a token's address.

`python -m jaxkv layout --hf-config config.json --html layout.html` (or `--specs
layers.json`) writes one page with no external assets:

- for each of LAYOUTS, one physical block: block-outer layouts as the block's bytes
  with every view's layer pages at their offsets (one row per group: a block id
  belongs to one group at a time); layer-outer ones as the layer regions of the
  buffer, each holding one page of the block;
- for a layer and token position the reader picks (and a block table they can
  edit), the arithmetic token position → logical block → block table entry →
  slot mapping → byte address, in every layout.

The numbers come from `layout_data(cfg)` (the plan's views in every layout) via
`token_values(data, layer, token, block_table)`. The page's inline script is the
same function in JavaScript (`tokenValues`) over the same data; the defaults are
rendered here, so the numbers are in the HTML text, and tests/memory/test_layout_html.py
runs the script under node to check that both agree.
"""

from __future__ import annotations

import functools
import html
import json
import re
from collections.abc import Sequence

from jaxkv.memory.layout import with_layout
from jaxkv.planner.config import LAYOUTS, KVCacheConfig
from jaxkv.planner.hf_config import specs_from_hf_config
from jaxkv.planner.planning import GROUPINGS, plan
from jaxkv.planner.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

SPEC_CLASSES = {
    cls.__name__: cls
    for cls in (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, MLAAttentionSpec, MambaSpec)
}
"""The spec classes `--specs` names."""


def layout_data(cfg: KVCacheConfig) -> dict:
    """The plan's views in every layout, as JSON-ready values (what the page's script reads)."""
    views = {}
    for layout in LAYOUTS:
        views[layout] = [
            {
                "group": t.group_idx,
                "layers": list(t.layers),
                "offset": t.offset,
                "layer_stride": t.layer_stride,
                "block_stride": t.block_stride,
                "token_stride": t.token_stride,
                "head_stride": t.head_stride,
                "head_bytes": t.head_bytes,
                "row_bytes": t.row_bytes,
                "num_heads": t.num_heads,
                "tokens_per_block": t.tokens_per_block,
                "page_bytes": t.page_bytes,
                "real_page_bytes": t.spec.real_page_size_bytes,
            }
            for t in with_layout(cfg, layout).tensors
        ]
    layers = {name: [i, j] for i, t in enumerate(cfg.tensors) for j, name in enumerate(t.layers)}
    return {
        "num_blocks": cfg.num_blocks,
        "bytes_per_block": cfg.bytes_per_block,
        "groups": [{"block_size": g.block_size, "describe": g.describe()} for g in cfg.groups],
        "layers": layers,
        "shared": dict(cfg.shared_layers),
        "views": views,
    }


def token_values(data: dict, layer: str, token: int, block_table: Sequence[int]) -> dict:
    """Every number the page shows for `layer` and token position `token`, by key.

    Keys: owner (the layer holding the cache), group, view, layer_idx, block_size,
    logical, entry (the block table entry), pos (position in block), tokens_per_block,
    slot; per layout L: `L:offset`, `L:layer_stride`, `L:block_stride`,
    `L:token_stride`, `L:head_stride`, `L:addr` (head 0's first byte),
    `L:block_start` (block-outer: where the block starts), `L:page:v:j` (where
    layer j of view v keeps the block), `L:marks` ([start in page, bytes] of each
    head's row). "error" explains a token the table does not place.
    """
    owner = data["shared"].get(layer, layer)
    if owner not in data["layers"]:
        return {"error": f"layer {layer} is not in this plan"}
    view_idx, layer_idx = data["layers"][owner]
    first = data["views"][LAYOUTS[0]][view_idx]
    block_size = data["groups"][first["group"]]["block_size"]
    n = first["tokens_per_block"]
    logical = token // block_size
    values = {
        "owner": owner,
        "group": first["group"],
        "view": view_idx,
        "layer_idx": layer_idx,
        "token": token,
        "block_size": block_size,
        "logical": logical,
        "tokens_per_block": n,
    }
    if token < 0 or logical >= len(block_table):
        return {**values, "error": f"token {token} is in logical block {logical}, past the block table"}
    entry = block_table[logical]
    if entry <= 0 or entry >= data["num_blocks"]:
        why = "the null block: the group does not hold this token" if entry == 0 else "not a block id of the pool"
        return {**values, "entry": entry, "error": f"block_table[{logical}] = {entry}: {why}"}
    pos = token % block_size if n == block_size else 0
    values |= {"entry": entry, "pos": pos, "slot": entry * n + pos}
    for layout, views in data["views"].items():
        t = views[view_idx]
        for key in ("offset", "layer_stride", "block_stride", "token_stride", "head_stride"):
            values[f"{layout}:{key}"] = t[key]
        values[f"{layout}:addr"] = (
            t["offset"] + layer_idx * t["layer_stride"] + entry * t["block_stride"] + pos * t["token_stride"]
        )
        values[f"{layout}:block_start"] = entry * data["bytes_per_block"]
        for v, u in enumerate(views):
            for j in range(len(u["layers"])):
                values[f"{layout}:page:{v}:{j}"] = u["offset"] + j * u["layer_stride"] + entry * u["block_stride"]
        values[f"{layout}:marks"] = [
            [pos * t["token_stride"] + h * t["head_stride"], t["head_bytes"]] for h in range(t["num_heads"])
        ]
    return values


_SCRIPT = r"""
function tokenValues(data, layer, token, table) {
  const owner = data.shared[layer] ?? layer;
  if (!(owner in data.layers)) return {error: `layer ${layer} is not in this plan`};
  const [view, layerIdx] = data.layers[owner];
  const first = data.views["BLHNC"][view];
  const blockSize = data.groups[first.group].block_size;
  const n = first.tokens_per_block;
  const logical = Math.floor(token / blockSize);
  const values = {owner: owner, group: first.group, view: view, layer_idx: layerIdx, token: token,
                  block_size: blockSize, logical: logical, tokens_per_block: n};
  if (!Number.isInteger(token) || token < 0 || logical >= table.length)
    return {...values, error: `token ${token} is in logical block ${logical}, past the block table`};
  const entry = table[logical];
  if (!Number.isInteger(entry) || entry <= 0 || entry >= data.num_blocks) {
    const why = entry === 0 ? "the null block: the group does not hold this token" : "not a block id of the pool";
    return {...values, entry: entry, error: `block_table[${logical}] = ${entry}: ${why}`};
  }
  const pos = n === blockSize ? token % blockSize : 0;
  Object.assign(values, {entry: entry, pos: pos, slot: entry * n + pos});
  for (const [layout, views] of Object.entries(data.views)) {
    const t = views[view];
    for (const key of ["offset", "layer_stride", "block_stride", "token_stride", "head_stride"])
      values[`${layout}:${key}`] = t[key];
    values[`${layout}:addr`] = t.offset + layerIdx * t.layer_stride + entry * t.block_stride + pos * t.token_stride;
    values[`${layout}:block_start`] = entry * data.bytes_per_block;
    views.forEach((u, v) => u.layers.forEach((_, j) => {
      values[`${layout}:page:${v}:${j}`] = u.offset + j * u.layer_stride + entry * u.block_stride;
    }));
    values[`${layout}:marks`] = Array.from({length: t.num_heads},
        (_, h) => [pos * t.token_stride + h * t.head_stride, t.head_bytes]);
  }
  return values;
}

function fmt(x) { return typeof x === "number" ? x.toLocaleString("en-US") : String(x); }

function marksHtml(data, values, layout) {
  const t = data.views[layout][values.view];
  const bp = x => Math.floor(10000 * x / t.page_bytes);  // basis points of the page, as // in Python
  return values[`${layout}:marks`].map(([start, size]) =>
      `<i class="mark" style="left:calc(${bp(start)}% / 100);width:calc(${bp(size)}% / 100)"></i>`).join("");
}

function update() {
  const data = JSON.parse(document.getElementById("layout-data").textContent);
  const layer = document.getElementById("layer").value;
  const token = parseInt(document.getElementById("token").value, 10);
  const table = document.getElementById("table").value.split(/[\s,]+/).filter(s => s).map(Number);
  const values = tokenValues(data, layer, token, table);
  document.getElementById("error").textContent = values.error ?? "";
  for (const el of document.querySelectorAll("[data-k]"))
    el.textContent = el.dataset.k in values && !values.error ? fmt(values[el.dataset.k]) : "—";
  for (const el of document.querySelectorAll("[data-layers]"))
    el.classList.toggle("sel", el.dataset.layers.split(" ").includes(values.owner));
  for (const el of document.querySelectorAll(".page[data-layout]"))
    el.innerHTML = values.error ? "" : marksHtml(data, values, el.dataset.layout);
}

if (typeof document !== "undefined") {
  for (const id of ["layer", "token", "table"]) document.getElementById(id).addEventListener("input", update);
}
"""

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em; color: #222; max-width: 1200px; }
pre { background: #f6f6f6; padding: .8em; overflow-x: auto; }
label { margin-right: 1.5em; }
.bar { display: flex; border: 1px solid #555; height: 3.2em; margin: .2em 0 1em; }
.seg { border-right: 1px solid #555; overflow: hidden; font-size: 11px; padding: 2px; box-sizing: border-box;
       background: #e8eef8; white-space: nowrap; }
.seg.pad { background: repeating-linear-gradient(45deg, #eee, #eee 4px, #ddd 4px, #ddd 8px); }
.seg.sel { background: #ffd27f; }
.seg small { display: block; color: #555; }
.row.sel > .glabel { font-weight: bold; }
.page { position: relative; height: 1.2em; border: 1px solid #555; background: #f3f3f3; margin-bottom: 1em; }
.mark { position: absolute; top: 0; bottom: 0; min-width: 2px; background: #d9480f; }
.cells span { display: inline-block; border: 1px solid #999; padding: 0 .4em; margin-right: 2px; }
.cells span.hit { background: #ffd27f; }
table.arith td { padding: .15em .8em .15em 0; vertical-align: top; }
#error { color: #b00; font-weight: bold; }
b[data-k] { color: #0b5394; }
"""


def _fmt(x) -> str:
    return f"{x:,}" if isinstance(x, int) else str(x)


def _k(values: dict, key: str) -> str:
    """A number the script recomputes: `<b data-k=key>` holding the default."""
    return f'<b data-k="{html.escape(key)}">{html.escape(_fmt(values[key]))}</b>'


def _marks(data: dict, values: dict, layout: str) -> str:
    page = data["views"][layout][values["view"]]["page_bytes"]
    return "".join(
        f'<i class="mark" style="left:calc({10000 * start // page}% / 100);'
        f'width:calc({10000 * size // page}% / 100)"></i>'
        for start, size in values[f"{layout}:marks"]
    )


def _short(name: str) -> str:
    """ "model.layers.1.self_attn.attn" → "1.attn" for segment labels (the full name is the tooltip)."""
    return name.removeprefix("model.layers.").replace(".self_attn", "")


def _sel(layers: Sequence[str], owner: str) -> str:
    return " sel" if owner in layers else ""


def _block_outer(data: dict, values: dict, layout: str) -> str:
    bpb, owner = data["bytes_per_block"], values["owner"]
    rows = []
    for g, group in enumerate(data["groups"]):
        segs, used = [], 0
        for t in data["views"][layout]:
            if t["group"] != g:
                continue
            for j, name in enumerate(t["layers"]):
                start = t["offset"] + j * t["layer_stride"]
                segs.append(
                    f'<div class="seg{_sel([name], owner)}" data-layers="{html.escape(name)}" '
                    f'style="width:{100 * t["page_bytes"] / bpb:.4f}%" title="{html.escape(name)}: bytes {start:,} '
                    f'to {start + t["page_bytes"]:,} of the block">'
                    f"{html.escape(_short(name))}<small>{start:,}</small></div>"
                )
                used = max(used, start + t["page_bytes"])
        if used < bpb:
            segs.append(
                f'<div class="seg pad" style="width:{100 * (bpb - used) / bpb:.4f}%" '
                f'title="padding: bytes {used:,} to {bpb:,}">padding<small>{used:,}</small></div>'
            )
        layers = " ".join(n for t in data["views"][layout] if t["group"] == g for n in t["layers"])
        rows.append(
            f'<div class="row{_sel(layers.split(), owner)}" data-layers="{html.escape(layers)}">'
            f'<span class="glabel">group {g}: {html.escape(group["describe"])}</span> '
            f'(bytes 0 to {bpb:,} of the block)<div class="bar">{"".join(segs)}</div></div>'
        )
    return (
        f"<p>Block {_k(values, 'entry')} starts at {_k(values, 'entry')} × {bpb:,} = "
        f"{_k(values, f'{layout}:block_start')}. A block id belongs to one group at a time; each row is "
        "that group's use of it, with every layer page's offset in the block.</p>" + "".join(rows)
    )


def _layer_outer(data: dict, values: dict, layout: str) -> str:
    regions: dict[int, list] = {}  # start → [bytes, layers, (view, layer) of the first, page bytes]
    for v, t in enumerate(data["views"][layout]):
        for j, name in enumerate(t["layers"]):
            start = t["offset"] + j * t["layer_stride"]
            regions.setdefault(start, [t["layer_stride"], [], (v, j), t["block_stride"]])[1].append(name)
    total = data["num_blocks"] * data["bytes_per_block"]
    segs, rows = [], []
    for start, (size, names, (v, j), page) in sorted(regions.items()):
        joined = " ".join(names)
        segs.append(
            f'<div class="seg{_sel(names, values["owner"])}" data-layers="{html.escape(joined)}" '
            f'style="width:{100 * size / total:.4f}%" title="{html.escape(joined)}">'
            f"{html.escape(_short(names[0]))}<small>{start:,}</small></div>"
        )
        rows.append(
            f'<tr class="row{_sel(names, values["owner"])}" data-layers="{html.escape(joined)}">'
            f"<td>{html.escape(', '.join(names))}</td><td>region at {start:,}, {size:,} B = "
            f"{data['num_blocks']:,} pages of {page:,} B</td>"
            f'<td class="cells"><span>0 (null)</span><span>1</span><span>…</span>'
            f'<span class="hit">block {_k(values, "entry")} at {_k(values, f"{layout}:page:{v}:{j}")}</span>'
            f"<span>…</span><span>{data['num_blocks'] - 1:,}</span></td></tr>"
        )
    return (
        f"<p>Each layer owns a region of {data['num_blocks']:,} pages; one block is one page in each region "
        "(groups share a region at disjoint block ids).</p>"
        f'<div class="bar">{"".join(segs)}</div><table class="arith">{"".join(rows)}</table>'
    )


def _arithmetic(values: dict) -> str:
    k = functools.partial(_k, values)
    lines = [
        f"<tr><td>token position</td><td>{k('token')}</td></tr>",
        f"<tr><td>layer</td><td>{k('owner')}: group {k('group')}, view {k('view')}, "
        f"layer {k('layer_idx')} of the view</td></tr>",
        f"<tr><td>logical block</td><td>{k('token')} // {k('block_size')} = {k('logical')}</td></tr>",
        f"<tr><td>block table entry</td><td>block_table[{k('logical')}] = {k('entry')}</td></tr>",
        f"<tr><td>position in block</td><td>{k('token')} % {k('block_size')} = {k('pos')} "
        "(0 for a state layer: one state per block)</td></tr>",
        f"<tr><td>slot mapping</td><td>{k('entry')} × {k('tokens_per_block')} + {k('pos')} = {k('slot')}</td></tr>",
    ]
    for layout in LAYOUTS:
        lines.append(
            f"<tr><td>byte address, {layout}</td><td>offset + layer × layer_stride + block × block_stride + "
            f"position × token_stride = {k(f'{layout}:offset')} + {k('layer_idx')} × {k(f'{layout}:layer_stride')} "
            f"+ {k('entry')} × {k(f'{layout}:block_stride')} + {k('pos')} × {k(f'{layout}:token_stride')} = "
            f"{k(f'{layout}:addr')}"
            + (f"; head h adds h × {k(f'{layout}:head_stride')}" if layout.endswith("HNC") else "")
            + "</td></tr>"
        )
    return f'<table class="arith">{"".join(lines)}</table>'


def render_layout_html(
    cfg: KVCacheConfig,
    *,
    layer: str | None = None,
    token: int | None = None,
    block_table: Sequence[int] | None = None,
    title: str = "",
) -> str:
    """The page for `cfg` (its groups and blocks; every layout is drawn whatever `cfg.layout`).

    Defaults: layer 1 of the first view (else layer 0), token `2 × block_size + 2`,
    block table `1, 2, ...` up to the token's logical block. Raises ValueError
    when the default token has no block in the table.
    """
    data = layout_data(cfg)
    if layer is None:
        first = cfg.tensors[0].layers
        layer = first[1] if len(first) > 1 else first[0]
    owner = data["shared"].get(layer, layer)
    if owner not in data["layers"]:
        raise ValueError(f"layer {layer!r} is not in this plan; its layers are {list(data['layers'])}")
    group = data["views"][LAYOUTS[0]][data["layers"][owner][0]]["group"]
    block_size = data["groups"][group]["block_size"]
    token = 2 * block_size + 2 if token is None else token
    block_table = list(range(1, token // block_size + 2)) if block_table is None else list(block_table)
    values = token_values(data, layer, token, block_table)
    if "error" in values:
        raise ValueError(f"{values['error']}; pick another --token or --block-table")
    options = "".join(
        f'<option value="{html.escape(name)}"{" selected" if name == layer else ""}>{html.escape(name)}'
        + (f" (shares {html.escape(data['shared'][name])})" if name in data["shared"] else "")
        + "</option>"
        for name in [*data["layers"], *data["shared"]]
    )
    sections = []
    for layout in LAYOUTS:
        kind = "block-outer" if layout.startswith("B") else "layer-outer"
        picture = _block_outer(data, values, layout) if kind == "block-outer" else _layer_outer(data, values, layout)
        page = data["views"][layout][values["view"]]
        sections.append(
            f"<h2>{layout} ({kind}, {'head-major' if layout.endswith('HNC') else 'token-major'} pages)</h2>"
            + picture
            + f"<p>Inside the page of {_k(values, 'owner')} ({page['page_bytes']:,} B): the token's row at "
            f"{_k(values, 'pos')} × {_k(values, f'{layout}:token_stride')}, each head h at + h × "
            f"{_k(values, f'{layout}:head_stride')}, {page['head_bytes']:,} B per head.</p>"
            f'<div class="page" data-layout="{layout}">{_marks(data, values, layout)}</div>'
        )
    heading = html.escape(title or "KV cache layout")
    payload = json.dumps(data).replace("<", "\\u003c")  # nothing in it can close the script element
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{heading}</title><style>{_STYLE}</style></head>
<body>
<h1>{heading}</h1>
<pre>{html.escape(cfg.summary())}</pre>
<p>address = offset + layer × layer_stride + block × block_stride + position × token_stride
(+ head × head_stride); slot = block_id × block_size + position in block.</p>
<p><label>layer <select id="layer">{options}</select></label>
<label>token position <input id="token" type="number" min="0" value="{token}"></label>
<label>block table <input id="table" size="40" value="{html.escape(", ".join(map(str, block_table)))}"></label></p>
<p id="error"></p>
<h2>From token position to byte address</h2>
{_arithmetic(values)}
{"".join(sections)}
<script type="application/json" id="layout-data">{payload}</script>
<script>{_SCRIPT}</script>
</body></html>
"""


# Command line.


def add_layout_parser(sub, parse_bytes, positive_int, read_json) -> None:
    """Registers `python -m jaxkv layout` (called by jaxkv.cli, which owns `parse_bytes`, `positive_int` and
    `read_json`)."""
    p = sub.add_parser("layout", help="write an HTML picture of the cache layout and a token's byte address")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-config", metavar="PATH", help="the model's config.json")
    source.add_argument(
        "--specs", metavar="PATH",
        help='JSON: layer name -> {"spec": "FullAttentionSpec", "block_size": 16, ...} (one of '
        f"{', '.join(SPEC_CLASSES)}), or -> the name of the layer whose cache it shares",
    )  # fmt: skip
    p.add_argument("--html", metavar="FILE", help="where to write the page (default: standard output)")
    p.add_argument("--num-layers", type=positive_int, help="keep only layers numbered below N (model.layers.{i}.…)")
    p.add_argument("--memory", type=parse_bytes, default="16GiB", help="KV cache budget (default 16GiB)")
    p.add_argument("--max-model-len", type=positive_int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    p.add_argument("--dtype", default="bfloat16", help="KV cache dtype for --hf-config (default bfloat16)")
    p.add_argument("--block-size", type=positive_int, default=None, help="tokens per block for --hf-config")
    p.add_argument("--grouping", choices=GROUPINGS, default="auto")
    p.add_argument("--layer", help="layer whose address to show (default: the first view's layer 1)")
    p.add_argument("--token", type=int, help="token position (default: 2 × block size + 2)")
    p.add_argument("--block-table", help="comma-separated block ids of the layer's group (default: 1, 2, ...)")
    p.set_defaults(func=functools.partial(_cmd_layout, read_json=read_json))


def _cmd_layout(args, read_json) -> None:
    source = read_json(args.hf_config or args.specs)
    if args.hf_config:
        layers = specs_from_hf_config(source, dtype=args.dtype, block_size=args.block_size)
        title = f"{source.get('model_type', 'model')} KV cache layout"
    else:
        layers = specs_from_json(source)
        title = "KV cache layout"
    if args.num_layers is not None:
        layers = first_layers(layers, args.num_layers)
        title += f" (first {args.num_layers} layers)"
    cfg = plan(
        layers,
        args.memory,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        grouping=args.grouping,
    )
    table = None if args.block_table is None else parse_block_table(args.block_table)
    page = render_layout_html(cfg, layer=args.layer, token=args.token, block_table=table, title=title)
    if args.html:
        with open(args.html, "w") as f:
            f.write(page)
    else:
        print(page)


def parse_block_table(text: str) -> list[int]:
    """'3,1,5' or '3 1 5' → [3, 1, 5]; ValueError naming --block-table otherwise."""
    try:
        return [int(b) for b in re.split(r"[\s,]+", text.strip())]
    except ValueError:
        raise ValueError(f"--block-table {text!r}: expected block ids separated by commas, e.g. 3,1,5") from None


def specs_from_json(source: dict) -> dict:
    """Layer name → spec from `{"layer": {"spec": "MLAAttentionSpec", ...fields}}` (str values: KV sharing)."""
    layers = {}
    for name, value in source.items():
        if isinstance(value, str):
            layers[name] = value
            continue
        if not isinstance(value, dict):
            raise ValueError(f"layer {name!r}: expected {{'spec': ..., fields}} or the name of a layer, got {value!r}")
        fields = dict(value)
        kind = fields.pop("spec", None)
        if kind not in SPEC_CLASSES:
            raise ValueError(f"layer {name!r}: spec={kind!r} is not one of {tuple(SPEC_CLASSES)}")
        try:
            layers[name] = SPEC_CLASSES[kind](**fields)
        except TypeError as e:  # a field the spec does not have, or one it needs
            raise ValueError(f"layer {name!r}: {e}") from None
    return layers


def first_layers(layers: dict, num_layers: int) -> dict:
    """The layers numbered below `num_layers` (`….layers.{i}.…`); names without a number are kept."""
    if num_layers <= 0:
        raise ValueError(f"--num-layers {num_layers} must be positive")
    kept = {}
    for name, value in layers.items():
        m = re.search(r"layers\.(\d+)\.", name)
        if m is None or int(m[1]) < num_layers:
            kept[name] = value
    return kept
