"""Train the demo models' byte-level BPE tokenizer and write its Hugging Face files."""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from .specs import HERMES_TEMPLATE, MAX_POSITIONS

VOCAB_SIZE = 4096
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# Control tokens are skipped by decode(skip_special_tokens=True); the markup tokens are
# not, so reasoning and tool-call parsers still see them in decoded text (as in Qwen).
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKUP_TOKENS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
SPECIAL_TOKENS = CONTROL_TOKENS + MARKUP_TOKENS

# transformers loads any model_type "qwen3_5" tokenizer as Qwen3_5Tokenizer, which
# replaces tokenizer.json's normalizer and pre-tokenizer with NFC and this split. All
# demo models use exactly that pipeline, so every loader encodes text the same way.
# (It also keeps indentation and code punctuation in fewer pieces than GPT-2's split.)
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _data(name: str) -> bytes:
    return resources.files("engine_bridge.models.demo").joinpath("data", name).read_bytes()


def corpus_bytes() -> bytes:
    return _data("corpus.txt")


def chat_template(filename: str = HERMES_TEMPLATE) -> str:
    """The text of a chat template shipped in demo/data."""
    return _data(filename).decode("utf-8")


def train_tokenizer() -> Tokenizer:
    """Train on the shipped corpus; the same corpus always yields the same merges.

    Trained once per process: each call returns a fresh copy, free for its caller to extend.
    """
    return Tokenizer.from_str(_trained_json())


@functools.cache
def _trained_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        # Specials go last, after every learned merge, so byte and merge ids stay put.
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        # A small corpus cannot reach the target vocab with min_frequency=2; pairs seen
        # once still help on text like the corpus and cost nothing at this size.
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus_bytes().decode("utf-8")], trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    size = tok.get_vocab_size(with_added_tokens=True)
    assert size == VOCAB_SIZE, f"tokenizer has {size} ids, expected {VOCAB_SIZE}"
    return tok.to_str()


def added_tokens_decoder(tok: Tokenizer) -> dict[str, dict[str, object]]:
    """tokenizer_config.json's `added_tokens_decoder`, as transformers writes it."""
    return {
        str(token_id): {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
        for token_id, t in sorted(tok.get_added_tokens_decoder().items())
    }


def write_tokenizer_files(
    tok: Tokenizer,
    out: Path,
    template: str | None = None,
    *,
    eos_token: str = EOS_TOKEN,
    pad_token: str = PAD_TOKEN,
    extra: dict[str, object] | None = None,
) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out`,
    with `template` (the Hermes one when None) as the chat template and `extra` keys added
    to tokenizer_config.json (e.g. mlx-lm's tool_parser_type)."""
    out.joinpath("tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    added = added_tokens_decoder(tok)
    config = {
        # Explicit class: otherwise transformers picks one from config.json's model_type
        # (e.g. a Llama or Gemma tokenizer) and may add a BOS the template never expects.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": eos_token,
        "pad_token": pad_token,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": chat_template() if template is None else template,
        **(extra or {}),
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", {"eos_token": eos_token, "pad_token": pad_token})


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
