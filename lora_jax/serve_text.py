"""Text for `lora-jax-serve`: the model's own tokenizer (transformers), a UTF-8 byte
tokenizer where it has none, and the end-of-sequence ids HF `generate` would stop at."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (for the embedded default and byte-vocab models).

    Example:
        >>> ByteTokenizer().encode("hi")
        [104, 105]
    """

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes for ids below 256; a larger id (a model with a bigger vocabulary) shows
        as `<id>`."""
        out, run = [], bytearray()
        for i in (int(t) for t in ids):
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            out.append(f"<{i}>")
            run = bytearray()
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def hf_tokenizer(model_dir: str | None):
    """The model directory's own tokenizer (transformers), or None where it has none."""
    files = [] if model_dir is None else [os.path.join(model_dir, f) for f in TOKENIZER_FILES]
    files = [f for f in files if os.path.exists(f)]
    if not files:
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(
            f"{model_dir} has its own tokenizer, which needs transformers "
            "(pip install transformers); without it the prompts would be fed as bytes"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # transformers' own errors: KeyError, JSONDecodeError, OSError ...
        raise ValueError(
            f"{' / '.join(files)}: transformers cannot load the tokenizer of {model_dir} "
            f"({type(e).__name__}: {e})"
        ) from e


def byte_tokenizer(model_dir: str | None, vocab_size: int) -> ByteTokenizer:
    if vocab_size < 256:
        raise ValueError(
            f"{model_dir}: no tokenizer files and vocab_size {vocab_size} < 256, so the "
            "byte tokenizer cannot be used"
        )
    if model_dir is not None:
        print(
            f"lora-jax-serve: {model_dir} has no {' / '.join(TOKENIZER_FILES)}: prompts are "
            "encoded as UTF-8 bytes (token ids 0-255)",
            file=sys.stderr,
        )
    return ByteTokenizer()


def eos_ids(model_dir: str | None) -> list[int] | None:
    """The model's end-of-sequence ids, as HF `generate` takes them: where the directory
    has a `generation_config.json`, its `eos_token_id` alone (none there: no eos, even if
    `config.json` names one); else `config.json`'s (an id or a list); None if unset."""
    from lora_jax.models.loading import _read_json

    if model_dir is None:
        return None
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):  # transformers then builds one from config.json
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            return None
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    eos = data.get("eos_token_id")
    if eos is None:
        return None
    ids = eos if isinstance(eos, list) else [eos]
    if not ids or any(isinstance(e, bool) or not isinstance(e, int) for e in ids):
        raise ValueError(
            f"{path}: eos_token_id must be an int token id or a list of them, got {eos!r}"
        )
    return ids
