"""Lay out the physical cache: block-outer arrays, typed views with offsets and strides, where a
token's K/V lives, block copies; and the HTML page that draws a plan's layout.

layout.py       `allocate_cache`, `typed_view`, `locate_token`, `read_rows`, `write_rows`, `copy_blocks`
layout_html.py  `render_layout_html` and `python -m jaxkv layout`

Internal: use the names `jaxkv` exports.
"""
