"""`python -m jaxkv layout`: the page for DeepSeek-V3.2's 2-layer example, and its script under node."""

import glob
import json
import pathlib
import re
import shutil
import subprocess

import pytest

from jaxkv import plan
from jaxkv.cli import main
from jaxkv.memory.layout import locate_token
from jaxkv.memory.layout_html import layout_data, render_layout_html, specs_from_json, token_values

ROOT = pathlib.Path(__file__).parents[2]
DSA_CONFIG = str(ROOT / "tests/configs/deepseek_v32.json")
MLA_L1, IDX_L1 = "model.layers.1.self_attn.attn", "model.layers.1.self_attn.indexer.k_cache"
DSA_ARGS = ["layout", "--hf-config", DSA_CONFIG, "--num-layers", "2", "--block-table", "3,1,5"]


def numbers(page: str) -> dict[str, str]:
    """key → text of every `<b data-k=key>` the script fills in (first occurrence)."""
    out = {}
    for key, text in re.findall(r'<b data-k="([^"]+)">([^<]*)</b>', page):
        out.setdefault(key, text)
    return out


@pytest.fixture(scope="module")
def dsa_page(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("html") / "dsa.html"
    assert main([*DSA_ARGS, "--html", str(path)]) == 0
    return path.read_text()


def test_dsa_page_shows_the_block_offsets_and_the_address(dsa_page):
    # One block: [MLA L0 | MLA L1 | IDX L0 | IDX L1] at 0, 41,984, 83,968, 92,416 of 100,864 B.
    block_outer = dsa_page[dsa_page.index("<h2>BLHNC") : dsa_page.index("<h2>LBHNC")]
    labels = re.findall(r'data-layers="([^"]+)"[^>]*>[^<]*<small>([\d,]+)</small>', block_outer)
    assert labels[:4] == [
        ("model.layers.0.self_attn.attn", "0"),
        (MLA_L1, "41,984"),
        ("model.layers.0.self_attn.indexer.k_cache", "83,968"),
        (IDX_L1, "92,416"),
    ]
    assert "(bytes 0 to 100,864 of the block)" in block_outer
    # Token 130 in layer 1 of the latent view: logical block 2, block_table[2] = 5, slot 322.
    shown = numbers(dsa_page)
    assert shown["owner"] == MLA_L1
    assert [shown[k] for k in ("token", "logical", "entry", "pos", "slot")] == ["130", "2", "5", "2", "322"]
    assert shown["BLHNC:addr"] == f"{41_984 + 5 * 100_864 + 2 * 656:,}" == "547,616"
    assert [shown[f"BLHNC:{k}"] for k in ("offset", "layer_stride", "block_stride", "token_stride")] == [
        "0", "41,984", "100,864", "656"]  # fmt: skip
    # Layer-outer: each layer owns num_blocks pages; MLA layer 1's region starts at num_blocks × 41,984.
    num_blocks = json.loads(re.search(r'id="layout-data">(.*?)</script>', dsa_page)[1])["num_blocks"]
    assert shown["LBHNC:addr"] == f"{num_blocks * 41_984 + 5 * 41_984 + 2 * 656:,}"
    assert f"region at {num_blocks * 41_984:,}" in dsa_page


def test_dsa_page_for_the_indexer_layer(tmp_path):
    path = tmp_path / "idx.html"
    assert main([*DSA_ARGS, "--layer", IDX_L1, "--token", "130", "--html", str(path)]) == 0
    shown = numbers(path.read_text())
    assert shown["BLHNC:addr"] == f"{83_968 + 8_448 + 5 * 100_864 + 2 * 132:,}"
    assert [shown[f"BLHNC:{k}"] for k in ("offset", "layer_stride")] == ["83,968", "8,448"]


def test_page_is_self_contained(dsa_page):
    for external in ("http://", "https://", "src=", "<link", "@import", "url("):
        assert external not in dsa_page


def test_spec_list_gives_the_same_page(tmp_path, dsa_page):
    mla = {"spec": "MLAAttentionSpec", "block_size": 64, "num_kv_heads": 1, "head_size": 656, "dtype": "uint8"}
    idx = {**mla, "head_size": 132}
    names = ["model.layers.0.self_attn.attn", "model.layers.0.self_attn.indexer.k_cache", MLA_L1, IDX_L1]
    specs = tmp_path / "dsa_specs.json"
    specs.write_text(json.dumps(dict(zip(names, [mla, idx, mla, idx]))))
    path = tmp_path / "specs.html"
    assert main(["layout", "--specs", str(specs), "--block-table", "3,1,5", "--html", str(path)]) == 0
    assert numbers(path.read_text()) == numbers(dsa_page)
    with pytest.raises(ValueError, match="spec='Attention' is not one of"):
        specs_from_json({"l0": {"spec": "Attention"}})


def test_token_without_a_block_exits_2(capsys):
    assert main([*DSA_ARGS, "--token", "300"]) == 2
    assert "token 300 is in logical block 4, past the block table" in capsys.readouterr().err
    assert main([*DSA_ARGS, "--block-table", "3,0,5", "--token", "70"]) == 2
    assert "block_table[1] = 0: the null block" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted(glob.glob(str(ROOT / "tests/configs/*.json"))))
def test_every_sample_config_renders(path, tmp_path):
    out = tmp_path / "page.html"
    assert main(["layout", "--hf-config", path, "--html", str(out)]) == 0
    shown = numbers(out.read_text())
    assert all(shown[f"{layout}:addr"] != "—" for layout in ("BLHNC", "BLNHC", "LBHNC", "LBNHC"))


def test_values_agree_with_locate_token():
    """The page's numbers are the ones the cache uses (`locate_token`, `KVCacheTensor.address`)."""
    specs = specs_from_json({f"l{i}": {"spec": "FullAttentionSpec", "block_size": 4, "num_kv_heads": 2,
                                       "head_size": 8, "dtype": "float32"} for i in range(3)})  # fmt: skip
    cfg = plan(specs, 1 << 20, max_model_len=64)
    data = layout_data(cfg)
    table = [7, 3, 9, 4]
    for token in (0, 5, 15):
        for layer in ("l0", "l2"):
            values = token_values(data, layer, token, table)
            loc = locate_token(cfg, 0, token, table)
            assert (values["slot"], values[f"{cfg.layout}:addr"]) == (loc.slot, loc.address(layer))


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script")
def test_script_fills_in_the_numbers_rendered_here(dsa_page):
    script = re.search(r"<script>(.*?)</script>", dsa_page, re.S)[1]
    data = json.loads(re.search(r'id="layout-data">(.*?)</script>', dsa_page)[1])
    keys = re.findall(r'<b data-k="([^"]+)">', dsa_page)
    selectable = re.findall(r'data-layers="([^"]+)"', dsa_page)
    layouts = re.findall(r'class="page" data-layout="([^"]+)"', dsa_page)
    cases = [(IDX_L1, 70, [3, 1, 5]), (MLA_L1, 63, [2]), ("model.layers.0.self_attn.attn", 200, [3, 1, 5, 9])]
    harness = f"""
const inputs = {{layer: {{value: "{MLA_L1}"}}, token: {{value: "130"}}, table: {{value: "3, 1, 5"}}}};
for (const el of Object.values(inputs)) el.addEventListener = () => {{}};
const error = {{textContent: ""}};
const numbers = {json.dumps(keys)}.map(k => ({{dataset: {{k}}, textContent: ""}}));
const layers = {json.dumps(selectable)}.map(l =>
  ({{dataset: {{layers: l}}, classList: {{toggle(c, on) {{ this.on = on; }}}}}}));
const pages = {json.dumps(layouts)}.map(l => ({{dataset: {{layout: l}}, innerHTML: ""}}));
globalThis.document = {{
  getElementById: id =>
    id === "layout-data" ? {{textContent: {json.dumps(json.dumps(data))}}} : id === "error" ? error : inputs[id],
  querySelectorAll: sel => sel === "[data-k]" ? numbers : sel === "[data-layers]" ? layers : pages,
}};
{script}
update();
const data = JSON.parse(document.getElementById("layout-data").textContent);
console.log(JSON.stringify({{
  texts: numbers.map(e => e.textContent), selected: layers.map(e => e.classList.on),
  pages: pages.map(e => e.innerHTML), error: error.textContent,
  cases: {json.dumps(cases)}.map(([layer, token, table]) => tokenValues(data, layer, token, table)),
}}));
"""
    out = json.loads(subprocess.run(["node", "-e", harness], capture_output=True, text=True, check=True).stdout)
    assert out["error"] == ""
    assert out["texts"] == re.findall(r'<b data-k="[^"]+">([^<]*)</b>', dsa_page)
    assert out["selected"] == [
        bool(re.search(rf'class="[^"]*\bsel\b[^"]*" data-layers="{re.escape(s)}"', dsa_page)) for s in selectable
    ]
    assert out["pages"] == re.findall(r'class="page" data-layout="[^"]+">(.*?)</div>', dsa_page)
    assert out["cases"] == [token_values(data, *case) for case in cases]


def test_default_token_and_table():
    mla = {"spec": "MLAAttentionSpec", "block_size": 64, "num_kv_heads": 1, "head_size": 656, "dtype": "uint8"}
    cfg = plan(specs_from_json({"a": mla, "b": mla}), 1 << 24, max_model_len=256)
    shown = numbers(render_layout_html(cfg))
    # Layer 1 of the first view, token 2 × 64 + 2, table 1, 2, 3.
    assert [shown[k] for k in ("owner", "token", "entry", "slot")] == ["b", "130", "3", "194"]
