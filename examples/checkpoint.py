"""Reading a Hugging Face checkpoint directory: config, weights (safetensors), tokenizer, EOS ids.

A directory holds `config.json`, `model.safetensors` or shards listed by
`model.safetensors.index.json`, and `tokenizer.json`; `generation_config.json` is read for more
EOS ids when present. Weights are read with `safetensors` on the numpy side (no torch), as stored
(bf16 in published checkpoints) or cast to `dtype`. gpt-oss experts stored as MXFP4
(`*_blocks` + `*_scales`) are dequantized as transformers does.

Errors name the file and the key: a missing tensor, a wrong shape, an unsupported model type.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import ml_dtypes  # noqa: F401  (safetensors' numpy side reads bf16 tensors through it)
import numpy as np
from hf_config import TextConfig

# The text model's tensors sit under one of these prefixes (gemma3 multimodal checkpoints nest it).
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
FLOAT_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}  # safetensors' names
FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


@dataclasses.dataclass
class Checkpoint:
    path: Path
    config: dict  # config.json as parsed
    text: TextConfig  # qwen3_next: qwen3_next.Qwen3NextConfig
    eos_token_ids: tuple[int, ...]
    tokenizer: object  # tokenizers.Tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids with the special tokens the checkpoint's tokenizer adds (Gemma: BOS)."""
        return self.tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{path} is missing; a checkpoint directory holds config.json, model.safetensors "
            "(or model.safetensors.index.json and its shards) and tokenizer.json"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}; expected an object ({{...}})")
    return value


def open_checkpoint(path) -> Checkpoint:
    """Reads the config, tokenizer and EOS ids of the checkpoint in directory `path`."""
    from tokenizers import Tokenizer

    path = Path(path)
    config = _read_json(path / "config.json")
    if config.get("model_type") == "qwen3_next":
        from qwen3_next import Qwen3NextConfig

        text = Qwen3NextConfig.from_hf(config)
    else:
        text = TextConfig.from_hf(config)
    if not (path / "tokenizer.json").exists():
        raise ValueError(f"{path / 'tokenizer.json'} is missing; the example reads prompts with it")
    eos: list[int] = []
    sources = [config, config.get("text_config") or {}]
    if (path / "generation_config.json").exists():
        sources.append(_read_json(path / "generation_config.json"))
    for source in sources:
        ids = source.get("eos_token_id")
        for i in [ids] if isinstance(ids, int) else ids or []:
            if i not in eos:
                eos.append(i)
    return Checkpoint(path, config, text, tuple(eos), Tokenizer.from_file(str(path / "tokenizer.json")))


class Weights:
    """The checkpoint's tensors by name, from one file or an index of shards."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.exists():
            self.files = {k: path / f for k, f in _read_json(index)["weight_map"].items()}
        elif (path / "model.safetensors").exists():
            from safetensors import safe_open

            with safe_open(path / "model.safetensors", framework="np") as f:
                self.files = dict.fromkeys(f.keys(), path / "model.safetensors")
        else:
            raise ValueError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
        self.prefix = next((p for p in TEXT_PREFIXES if f"{p}embed_tokens.weight" in self.files), None)
        if self.prefix is None:
            raise ValueError(
                f"no embedding tensor in {path}: looked for "
                + ", ".join(f"{p}embed_tokens.weight" for p in TEXT_PREFIXES)
            )
        self._open = {}

    def key(self, name: str) -> str:
        """The file's key of a text-model tensor named as in a text-only checkpoint."""
        if name == "lm_head.weight" and self.prefix == "language_model.model.":
            return "language_model.lm_head.weight"
        return self.prefix + name.removeprefix("model.") if name.startswith("model.") else name

    def _file(self, key: str):
        from safetensors import safe_open

        file = self.files[key]
        if file not in self._open:
            if not file.exists():
                raise ValueError(f"{file} is listed in the checkpoint's index but missing")
            self._open[file] = safe_open(file, framework="np")
        return self._open[file]

    def read(self, key: str) -> np.ndarray:
        return self._file(key).get_tensor(key)

    def dtype(self, key: str) -> np.dtype:
        """The stored dtype of tensor `key`, without reading it."""
        stored = self._file(key).get_slice(key).get_dtype()
        if stored not in FLOAT_DTYPES:
            raise ValueError(f"tensor {key!r} is stored as {stored}; expected one of {', '.join(FLOAT_DTYPES)}")
        return np.dtype(FLOAT_DTYPES[stored])

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        key = self.key(name)
        if key in self.files:
            array = self.read(key)
        elif f"{key}_blocks" in self.files:
            array = dequantize_mxfp4(self.read(f"{key}_blocks"), self.read(f"{key}_scales"))
        else:
            raise ValueError(f"the checkpoint in {next(iter(self.files.values())).parent} has no tensor {key!r}")
        if tuple(array.shape) != tuple(shape):
            raise ValueError(
                f"{self.files.get(key) or self.files[key + '_blocks']}: tensor {key!r} has shape {tuple(array.shape)}; "
                f"config.json implies {tuple(shape)}"
            )
        return array


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 expert weights -> float32 [E, in, out], as transformers dequantizes gpt-oss.

    blocks uint8 [E, out, G, 16]: two FP4 (E2M1) codes a byte, the low nibble first; scales uint8
    [E, out, G]: a power of two per 32 values, biased by 127. The stored rows are the outputs, so
    the result is transposed to the [E, in, out] layout of the unquantized `gate_up_proj`.
    """
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], -1)  # [E, out, G, 32]
    values = np.ldexp(FP4_VALUES[codes], scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*values.shape[:2], -1).transpose(0, 2, 1)


def load_model(checkpoint: Checkpoint, dtype=None):
    """The example's `hf_model.Decoder` (`qwen3_next.Decoder` for qwen3_next) with the checkpoint's weights, all
    in `dtype` (None: the embedding's dtype as stored, bf16 for published checkpoints)."""
    if checkpoint.text.model_type == "qwen3_next":
        from qwen3_next import Decoder
    else:
        from hf_model import Decoder

    weights = Weights(checkpoint.path)
    if dtype is None:
        dtype = weights.dtype(weights.key("model.embed_tokens.weight"))
    return Decoder(checkpoint.text, lambda name, shape: weights.get(name, shape).astype(dtype))
