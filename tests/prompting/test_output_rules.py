"""tool_choice and parallel switches as token rules, run through the real row sampler.

Each test drives `RowSampler` step by step, as the scheduler does, with logits that favour
some other token, and checks which token the rule makes it take.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine_bridge.prompting.output_format import OutputFormat
from engine_bridge.scheduling.output_rules import call_marker_is_token, output_rule
from engine_bridge.scheduling.sampling import RowSampler
from engine_bridge.types import Sampling, ToolChoice


@pytest.fixture(scope="module")
def tok(demo_root):
    from mlx_lm.tokenizer_utils import load

    return load(demo_root / "models" / "demo-llama")


@pytest.fixture(scope="module")
def fmt(tok) -> OutputFormat:
    return OutputFormat.of(tok)


def ids(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def run(sampler: RowSampler, out: list[int], favoured: int, steps: int, vocab: int) -> list[int]:
    """Sample `steps` tokens from logits that favour `favoured`, appending to `out`."""
    logits = mx.zeros((1, vocab))
    logits[0, favoured] = 10.0
    for _ in range(steps):
        out.append(sampler.sample(sampler.process(out, logits)).item())
    return out


def sampler_for(tok, fmt, choice: ToolChoice, *, opens_in_reasoning=False, temperature=0.0):
    rule = output_rule(tok, fmt, choice, has_tools=True, opens_in_reasoning=opens_in_reasoning)
    assert rule is not None
    out: list[int] = []
    rule.out = out
    return RowSampler(Sampling(temperature=temperature, seed=1), rule), out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tool_choice_none_bans_the_call_marker(tok, fmt, temperature):
    start = ids(tok, "<tool_call>")
    assert len(start) == 1 and call_marker_is_token(tok, fmt)
    sampler, out = sampler_for(tok, fmt, ToolChoice("none"), temperature=temperature)
    assert start[0] not in run(sampler, out, start[0], 5, len(tok))


def test_auto_needs_no_rule_and_keeps_the_fast_path(tok, fmt):
    assert output_rule(tok, fmt, ToolChoice(), has_tools=True, opens_in_reasoning=True) is None
    # Without tools nothing is banned or forced whatever the choice.
    none = ToolChoice("none")
    assert output_rule(tok, fmt, none, has_tools=False, opens_in_reasoning=False) is None


def test_required_opens_the_answer_with_the_marker(tok, fmt):
    sampler, out = sampler_for(tok, fmt, ToolChoice("required"))
    word = ids(tok, " hello")[0]
    got = run(sampler, out, word, 3, len(tok))
    assert got[0] == ids(tok, "<tool_call>")[0]
    assert got[1:] == [word, word]  # then the model writes the call itself


def test_required_waits_for_reasoning_to_close(tok, fmt):
    sampler, out = sampler_for(tok, fmt, ToolChoice("required"), opens_in_reasoning=True)
    word, end = ids(tok, " hello")[0], ids(tok, "</think>")
    got = run(sampler, out, word, 3, len(tok))
    assert got == [word] * 3  # still reasoning: nothing forced
    out.extend(end)
    got = run(sampler, out, word, 1, len(tok))
    assert got[-1] == ids(tok, "<tool_call>")[0]


def test_a_named_tool_forces_the_familys_call_header(tok, fmt):
    sampler, out = sampler_for(tok, fmt, ToolChoice("required", name="Bash"))
    opening = ids(tok, "<tool_call>") + ids(tok, '{"name": "Bash", "arguments": ')
    word = ids(tok, " hello")[0]
    assert run(sampler, out, word, len(opening) + 1, len(tok)) == [*opening, word]


def test_one_call_only_ends_the_turn_after_the_first_call(tok, fmt):
    sampler, out = sampler_for(tok, fmt, ToolChoice("auto", parallel=False))
    word = ids(tok, " hello")[0]
    assert run(sampler, out, word, 2, len(tok)) == [word, word]
    out.extend(ids(tok, "</tool_call>"))
    assert run(sampler, out, word, 1, len(tok))[-1] == tok.eos_token_id


def test_forced_text_is_taken_token_by_token_then_eos(tok, fmt):
    text = '<think>x</think><tool_call>{"name": "Bash", "arguments": {}}</tool_call>'
    rule = output_rule(
        tok, fmt, ToolChoice(), has_tools=True, opens_in_reasoning=False, forced_text=text
    )
    out: list[int] = []
    rule.out = out
    sampler = RowSampler(Sampling(temperature=0.7, top_p=0.9, seed=3), rule)
    n = len(ids(tok, text))
    got = run(sampler, out, ids(tok, " hello")[0], n + 1, len(tok))
    assert got == [*ids(tok, text), tok.eos_token_id]
    assert tok.decode(got[:-1]) == text
