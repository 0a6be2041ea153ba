"""The built-in demo models: deterministic builds that load and run with plain mlx-lm."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import generate
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from engine_bridge.models.demo import DEMO_MODEL_IDS, ensure_demo_model, is_demo_model

EXPECTED_CACHE_TYPES = {
    "demo-llama": ["KVCache", "KVCache"],
    "demo-hybrid": ["ArraysCache", "KVCache", "ArraysCache", "KVCache"],
    "demo-swa": ["RotatingKVCache", "KVCache", "RotatingKVCache", "KVCache"],
}
SPECIAL_IDS = {
    "<|endoftext|>": 4087,
    "<|im_start|>": 4088,
    "<|im_end|>": 4089,
    "<think>": 4090,
    "</think>": 4091,
    "<tool_call>": 4092,
    "</tool_call>": 4093,
    "<tool_response>": 4094,
    "</tool_response>": 4095,
}

# Written for this test and absent from the training corpus.
HELD_OUT_ENGLISH = """\
Our neighbors keep bees at the bottom of their garden, in three white hives that hum all
summer. Last September they invited us to help with the harvest. We wore borrowed veils
and gloves that were far too big, and we moved very slowly, which turns out to be the whole
trick. The frames came out heavy and golden, and the kitchen smelled of wax for days
afterwards. We went home with two jars of honey and a new respect for insects that work
harder than any of us. My daughter has since decided she wants to become a beekeeper, or
possibly an astronaut, depending on the day you ask her. Either way, she now checks the
flowers on the balcony every morning to see who is visiting.

The quarterly report was late again, and this time nobody could blame the printer. Half
the numbers lived in a spreadsheet that only one person understood, and she was on holiday
in Norway with no signal. When she came back, she spent an afternoon writing down how the
sheet worked, with notes on every formula and a small diagram of where the data came from.
The next report arrived two days early.
"""
HELD_OUT_CODE = '''\
def load_profiles(directory: Path) -> dict[str, dict]:
    """Read every profile file in a directory, skipping the ones that fail to parse."""
    profiles: dict[str, dict] = {}
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            logger.warning("skipping profile %s: %s", path.name, exc)
            continue
        if not isinstance(data, dict) or "name" not in data:
            logger.warning("profile %s has no name", path.name)
            continue
        profiles[data["name"]] = data
    return profiles


class Thermostat:
    def __init__(self, target: float, tolerance: float = 0.5) -> None:
        self.target = target
        self.tolerance = tolerance
        self.heating = False

    def update(self, reading: float) -> bool:
        if reading < self.target - self.tolerance:
            self.heating = True
        elif reading > self.target + self.tolerance:
            self.heating = False
        return self.heating

export function summarizeOrders(orders) {
  const byCustomer = new Map();
  for (const order of orders) {
    const total = order.items.reduce((sum, item) => sum + item.price * item.quantity, 0);
    byCustomer.set(order.customer, (byCustomer.get(order.customer) ?? 0) + total);
  }
  return [...byCustomer.entries()].sort((a, b) => b[1] - a[1]);
}

#!/usr/bin/env bash
set -euo pipefail
for dir in "$@"; do
  count=$(find "$dir" -type f -name "*.log" | wc -l)
  echo "$dir: $count log files"
done
'''


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("demo-cache")
    for name in DEMO_MODEL_IDS:
        ensure_demo_model(name, root)
    return root


@pytest.fixture(scope="session")
def loaded(demo_root):
    return {name: load(str(demo_root / "models" / name)) for name in DEMO_MODEL_IDS}


def _file_bytes(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir())}


def test_demo_model_ids_are_the_three_builtins():
    assert DEMO_MODEL_IDS == ("demo-llama", "demo-hybrid", "demo-swa")
    assert all(is_demo_model(name) for name in DEMO_MODEL_IDS)
    assert not is_demo_model("llama")
    assert not is_demo_model("/models/demo-llama")


def test_unknown_demo_model_raises_value_error_naming_valid_ids(tmp_path):
    with pytest.raises(ValueError, match="demo-llama, demo-hybrid, demo-swa"):
        ensure_demo_model("demo-gpt", tmp_path)
    assert not (tmp_path / "models").exists()


def test_build_is_byte_identical_across_two_roots(demo_root, tmp_path):
    for name in DEMO_MODEL_IDS:
        again = ensure_demo_model(name, tmp_path)
        assert again == tmp_path / "models" / name
        first, second = _file_bytes(demo_root / "models" / name), _file_bytes(again)
        assert sorted(first) == sorted(second)
        for filename in first:
            assert first[filename] == second[filename], f"{name}/{filename} differs"


def test_existing_build_is_returned_without_rebuilding(demo_root, caplog):
    path = demo_root / "models" / "demo-llama"
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="engine_bridge.models.demo"):
        assert ensure_demo_model("demo-llama", demo_root) == path
    assert caplog.records == []
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_incomplete_directory_is_replaced_by_a_fresh_build(demo_root, tmp_path, caplog):
    broken = tmp_path / "models" / "demo-swa"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{}")
    (tmp_path / "models" / ".demo-swa.tmp-crashed").mkdir()
    with caplog.at_level(logging.INFO, logger="engine_bridge.models.demo"):
        assert ensure_demo_model("demo-swa", tmp_path) == broken
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == [
        "built demo model demo-swa"
    ]
    assert _file_bytes(broken) == _file_bytes(demo_root / "models" / "demo-swa")
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".demo-swa.lock", "demo-swa"]


@pytest.mark.parametrize("name", DEMO_MODEL_IDS)
def test_config_is_tiny_float32_and_covers_every_token_id(demo_root, loaded, name):
    model_dir = demo_root / "models" / name
    config = json.loads((model_dir / "config.json").read_text())
    _, tokenizer = loaded[name]
    assert config["hidden_size"] == 64
    assert config["max_position_embeddings"] == 32768
    assert config["vocab_size"] == len(tokenizer) == 4096
    assert config["eos_token_id"] == SPECIAL_IDS["<|im_end|>"]
    assert "text_config" not in config
    weights = mx.load(str(model_dir / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {mx.float32}


@pytest.mark.parametrize("name", DEMO_MODEL_IDS)
def test_loaded_parameters_equal_saved_weights(demo_root, loaded, name):
    # Guards against sanitize() rewriting what we saved (qwen3_5 shifts norms by +1
    # when conv1d weights look unconverted).
    saved = mx.load(str(demo_root / "models" / name / "model.safetensors"))
    model, _ = loaded[name]
    params = dict(tree_flatten(model.parameters()))
    # demo-hybrid also carries an MTP head (`mtp.*`, as Qwen3.5 ships it), which mlx-lm
    # drops: tests/scheduling/test_speculative_mtp.py loads it.
    head = sorted(k for k in saved if k.startswith("mtp."))
    assert bool(head) == (name == "demo-hybrid"), head
    saved = {k: v for k, v in saved.items() if not k.startswith("mtp.")}
    assert sorted(params) == sorted(saved)
    for key, value in saved.items():
        assert mx.array_equal(params[key], value).item(), key


@pytest.mark.parametrize("name", DEMO_MODEL_IDS)
def test_cache_layer_types(loaded, name):
    model, _ = loaded[name]
    assert [type(c).__name__ for c in make_prompt_cache(model)] == EXPECTED_CACHE_TYPES[name]
    assert [type(c).__name__ for c in model.make_cache()] == EXPECTED_CACHE_TYPES[name]


def test_swa_window_is_128_tokens(loaded):
    model, _ = loaded["demo-swa"]
    assert [getattr(c, "max_size", None) for c in model.make_cache()] == [128, None, 128, None]


@pytest.mark.parametrize("name", DEMO_MODEL_IDS)
def test_greedy_generation_runs_16_tokens_without_looping_on_one(loaded, name):
    model, tokenizer = loaded[name]
    messages = [{"role": "user", "content": "Tell me about caching in local language models."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    steps = generate_step(mx.array(prompt), model, max_tokens=16)
    tokens = [int(token) for token, _ in steps]
    assert len(tokens) == 16
    assert not set(tokens) & set(SPECIAL_IDS.values())
    assert len(set(tokens)) >= 8, tokens
    text = generate(model, tokenizer, prompt, max_tokens=16)
    # mlx-lm's BPE streaming detokenizer drops the first token's leading space.
    assert text == tokenizer.decode(tokens).removeprefix(" ")


def _chars_per_token(tokenizer, text: str) -> float:
    return len(text) / len(tokenizer.encode(text))


def test_chars_per_token_on_held_out_english_and_code(loaded):
    _, tokenizer = loaded["demo-llama"]
    english = _chars_per_token(tokenizer, HELD_OUT_ENGLISH)
    code = _chars_per_token(tokenizer, HELD_OUT_CODE)
    print(f"chars/token: english {english:.2f}, code {code:.2f}")
    assert 3.0 <= english <= 4.5
    assert 3.0 <= code <= 4.5


@pytest.mark.parametrize("name", DEMO_MODEL_IDS)
def test_transformers_tokenizer_encodes_like_tokenizer_json(demo_root, loaded, name):
    # transformers swaps in Qwen3_5Tokenizer for model_type qwen3_5 and rebuilds its
    # pre-tokenizer; the demo tokenizer must encode identically either way.
    model_dir = demo_root / "models" / name
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    _, wrapped = loaded[name]
    text = HELD_OUT_CODE + "<|im_start|>user\nCafé, naïve 😀 12345<think>x</think><|im_end|>"
    expected = raw.encode(text).ids
    assert hf.encode(text, add_special_tokens=False) == expected
    assert wrapped.encode(text, add_special_tokens=False) == expected


def test_special_tokens_are_single_ids_and_eos_is_im_end(loaded):
    _, tokenizer = loaded["demo-hybrid"]
    for token, token_id in SPECIAL_IDS.items():
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == {SPECIAL_IDS["<|im_end|>"]}
    assert tokenizer.bos_token is None
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)
    ids = tokenizer.encode("<|im_start|>assistant\n<think>a</think><tool_call>{}</tool_call>")
    # Control tokens vanish when skipping specials; markup stays for reasoning/tool parsers.
    assert tokenizer.decode(ids, skip_special_tokens=True) == (
        "assistant\n<think>a</think><tool_call>{}</tool_call>"
    )


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOLS_BLOCK = (
    "# Tools\n\nThese functions are available. Each line inside <tools></tools> is one "
    "function signature in JSON:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather for a '
    'city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
    '"required": ["city"]}}}\n</tools>\n\nTo call a function, answer with one line per call:\n'
    '<tool_call>{"name": <function name>, "arguments": <JSON object>}</tool_call>'
)


def _render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_template_renders_system_tools_and_generation_prompt(loaded):
    _, tokenizer = loaded["demo-llama"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
        },
    ]
    assert _render(tokenizer, messages, tools=[WEATHER_TOOL], add_generation_prompt=True) == (
        f"<|im_start|>system\nBe brief.\n\n{TOOLS_BLOCK}<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert _render(tokenizer, messages[1:], tools=[WEATHER_TOOL]) == (
        f"<|im_start|>system\n{TOOLS_BLOCK}<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    )
    assert _render(tokenizer, messages[1:]) == "<|im_start|>user\nHi there<|im_end|>\n"


AGENT_TURNS = [
    {"role": "user", "content": "Weather in Lisbon?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should look it up.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Lisbon"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "19C, cloudy"},
    {"role": "assistant", "content": "It is 19C.", "reasoning_content": "Report it."},
    {"role": "user", "content": "And Porto and Faro?"},
    {
        "role": "assistant",
        "content": "Checking both.",
        "reasoning_content": "\nTwo calls.\n",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Porto"}},
            },
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Faro"}},
            },
        ],
    },
    {"role": "tool", "content": "17C"},
    {"role": "tool", "content": [{"type": "text", "text": "24C"}]},
]


def test_template_renders_tool_calls_results_and_thinking_after_last_user_only(loaded):
    _, tokenizer = loaded["demo-swa"]
    rendered = _render(tokenizer, AGENT_TURNS, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>user\nWeather in Lisbon?<|im_end|>\n"
        # Thinking before the last user message is dropped, like Qwen3.
        "<|im_start|>assistant\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Lisbon"}}</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n19C, cloudy\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nIt is 19C.<|im_end|>\n"
        "<|im_start|>user\nAnd Porto and Faro?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo calls.\n</think>\n\nChecking both.\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Porto"}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Faro"}}</tool_call>'
        "<|im_end|>\n"
        # Consecutive tool results share one user turn.
        "<|im_start|>user\n<tool_response>\n17C\n</tool_response>\n"
        "<tool_response>\n24C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_thinking_of_the_current_turn_is_dropped_once_a_user_message_follows(loaded):
    _, tokenizer = loaded["demo-hybrid"]
    turn = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
    ]
    assert "<think>\nGreet back.\n</think>\n\nHello." in _render(tokenizer, turn)
    later = _render(tokenizer, [*turn, {"role": "user", "content": "Bye"}])
    assert "Greet back" not in later
    assert "<|im_start|>assistant\nHello.<|im_end|>\n" in later


def test_next_turn_prompt_extends_previous_prompt_plus_answer(loaded):
    # The cache depends on this: turn N+1's tokens start with turn N's prompt tokens.
    _, tokenizer = loaded["demo-llama"]
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt1 = tokenizer.apply_chat_template(turn1, tools=[WEATHER_TOOL], add_generation_prompt=True)
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Weather?"},
    ]
    prompt2 = tokenizer.apply_chat_template(turn2, tools=[WEATHER_TOOL], add_generation_prompt=True)
    answer = tokenizer.encode("Hello! How can I help?<|im_end|>\n", add_special_tokens=False)
    assert prompt2[: len(prompt1) + len(answer)] == prompt1 + answer


def test_tool_calls_parse_with_mlx_lm_json_tool_parser(loaded):
    _, tokenizer = loaded["demo-llama"]
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<tool_call>", "</tool_call>")
    rendered = _render(tokenizer, AGENT_TURNS[:2])
    body = rendered.split("<tool_call>")[1].split("</tool_call>")[0]
    assert tokenizer.tool_parser(body, [WEATHER_TOOL]) == {
        "name": "get_weather",
        "arguments": {"city": "Lisbon"},
    }


_RACE_SCRIPT = textwrap.dedent(
    """
    import logging, sys, time
    from pathlib import Path
    from engine_bridge.models.demo import ensure_demo_model

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    root, me, other = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    me.touch()
    deadline = time.monotonic() + 120
    while not other.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    print(ensure_demo_model("demo-hybrid", root))
    """
)


def test_concurrent_ensure_from_two_processes_builds_one_intact_model(demo_root, tmp_path):
    root = tmp_path / "root"
    ready = [tmp_path / "ready-0", tmp_path / "ready-1"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACE_SCRIPT, str(root), str(ready[i]), str(ready[1 - i])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    final = root / "models" / "demo-hybrid"
    assert [out.strip() for out, _ in results] == [str(final), str(final)]
    builds = [line for _, err in results for line in err.splitlines() if "built demo model" in line]
    assert len(builds) == 1, results
    assert _file_bytes(final) == _file_bytes(demo_root / "models" / "demo-hybrid")
    assert sorted(p.name for p in (root / "models").iterdir()) == [
        ".demo-hybrid.lock",
        "demo-hybrid",
    ]
    model, tokenizer = load(str(final))
    assert len(generate(model, tokenizer, "Hello", max_tokens=4)) > 0
