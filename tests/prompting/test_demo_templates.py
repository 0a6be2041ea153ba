"""The demo and family chat templates: history renders as each family's model expects it,
the project's render path agrees with the template, mlx-lm infers each family's parser,
and each family's example answers parse back to their calls."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer_dir
from mlx_lm.tool_parsers import qwen3_coder
from mlx_lm.utils import load

from engine_bridge.models.demo import build, specs, tokenizer
from engine_bridge.models.demo.families import FAMILIES, TOOLS, VOCAB_SIZE, write_family_model
from engine_bridge.prompting.render import render_chat
from engine_bridge.types import Message, ToolCall

R = FAMILIES["qwen3_coder"].one_call.reasoning
TEMPLATED = ("qwen3_coder", "glm47", "gemma4")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: write_family_model(root / name, name) for name in FAMILIES}


@pytest.fixture(scope="module")
def tokenizers(demo_root, family_dirs):
    """Family name -> tokenizer; qwen3_coder and json_tools are the demo models' own."""
    out = {name: load_tokenizer_dir(path) for name, path in family_dirs.items()}
    out["qwen3_coder"] = load_tokenizer_dir(demo_root / "models" / "demo-hybrid")
    out["json_tools"] = load_tokenizer_dir(demo_root / "models" / "demo-llama")
    return out


def _render(tok, messages, **kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


# -- demo-hybrid speaks Qwen3.6 ------------------------------------------------------------


def test_demo_hybrid_infers_qwen3_coder_calls_and_think_markers(demo_root):
    _, tok = load(str(demo_root / "models" / "demo-hybrid"))
    assert tok.tool_parser is qwen3_coder.parse_tool_call
    assert (tok.tool_call_start, tok.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert tok.has_thinking
    assert (tok.think_start, tok.think_end) == ("<think>", "</think>")
    assert "<tool_call>\\n<function=" in tok.chat_template


@pytest.mark.parametrize("name", ["demo-llama", "demo-swa"])
def test_other_text_demos_keep_the_hermes_template(demo_root, name):
    tok = load_tokenizer_dir(demo_root / "models" / name)
    assert tok.tool_parser.__module__ == "mlx_lm.tool_parsers.json_tools"
    assert tok.chat_template == tokenizer.chat_template(specs.HERMES_TEMPLATE)


def test_qwen3_6_call_turn_renders_the_xml_form_exactly(tokenizers):
    tok = tokenizers["qwen3_coder"]
    messages = [
        {"role": "user", "content": "List the files."},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": R,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "Bash", "arguments": {"command": "ls -la", "timeout": 30}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "README.md\nsetup.py"},
    ]
    assert _render(tok, messages, add_generation_prompt=True) == (
        "<|im_start|>user\nList the files.<|im_end|>\n"
        f"<|im_start|>assistant\n<think>\n{R}\n</think>\n\n"
        "<tool_call>\n<function=Bash>\n"
        "<parameter=command>\nls -la\n</parameter>\n"
        "<parameter=timeout>\n30\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nREADME.md\nsetup.py\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_qwen3_6_lists_tools_first_in_the_system_turn(tokenizers):
    tok = tokenizers["qwen3_coder"]
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = _render(tok, system, tools=TOOLS)
    tools = "\n".join(json.dumps(t) for t in TOOLS)
    assert rendered.startswith("<|im_start|>system\n# Tools\n\n")
    assert f"<tools>\n{tools}\n</tools>" in rendered
    assert "<tool_call>\n<function=function_name>\n<parameter=parameter_name>\nvalue\n" in rendered
    assert rendered.endswith("\n\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_qwen3_6_arguments_as_a_string_and_non_string_values(tokenizers):
    call = {
        "name": "Edit",
        "arguments": {"flags": ["-n", "-v"], "force": True, "opts": {"a": 1}, "empty": None},
    }
    raw = {"name": "Bash", "arguments": '{"command": "ls"}'}
    messages = [
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": "Sure.", "tool_calls": [{"function": call}, raw]},
    ]
    rendered = _render(tokenizers["qwen3_coder"], messages)
    assert rendered.split("<|im_start|>assistant\n")[1] == (
        "<think>\n\n</think>\n\nSure.\n\n<tool_call>\n<function=Edit>\n"
        '<parameter=flags>\n["-n", "-v"]\n</parameter>\n'
        "<parameter=force>\ntrue\n</parameter>\n"
        '<parameter=opts>\n{"a": 1}\n</parameter>\n'
        "<parameter=empty>\nnull\n</parameter>\n"
        "</function>\n</tool_call>\n"
        '<tool_call>\n<function=Bash>\n{"command": "ls"}\n</function>\n</tool_call><|im_end|>\n'
    )


def test_qwen3_6_drops_reasoning_before_the_last_real_user_query(tokenizers):
    tok = tokenizers["qwen3_coder"]
    turn = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
    ]
    assert "<|im_start|>assistant\n<think>\nGreet back.\n</think>\n\nHello.<|im_end|>" in (
        _render(tok, turn)
    )
    later = _render(tok, [*turn, {"role": "user", "content": "Bye"}])
    assert "<|im_start|>assistant\nHello.<|im_end|>\n" in later
    # Tool results passed back as a user turn are not a query: reasoning stays.
    passed_back = {"role": "user", "content": "<tool_response>\nok\n</tool_response>"}
    assert "Greet back." in _render(tok, [*turn, passed_back])


@pytest.mark.parametrize(
    ("name", "thinking", "suffix"),
    [
        ("qwen3_coder", None, "<|im_start|>assistant\n<think>\n"),
        ("qwen3_coder", True, "<|im_start|>assistant\n<think>\n"),
        ("qwen3_coder", False, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        ("glm47", None, "<|assistant|><think>"),
        ("glm47", False, "<|assistant|></think>"),
        ("gemma4", None, "<|turn>model\n"),
        ("gemma4", False, "<|turn>model\n"),
    ],
)
def test_generation_prompt_opens_or_closes_thinking(tokenizers, name, thinking, suffix):
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    rendered = _render(
        tokenizers[name], [{"role": "user", "content": "Hi"}], add_generation_prompt=True, **kwargs
    )
    assert rendered.endswith(suffix)
    if name == "qwen3_coder":
        assert rendered == "<|im_start|>user\nHi<|im_end|>\n" + suffix


def test_gemma4_asks_for_thinking_in_the_system_turn(tokenizers):
    # mlx-lm passes enable_thinking=has_thinking when the caller does not say.
    chat = [{"role": "user", "content": "Hi"}]
    thinking = "<|turn>system\n<|think|>\n<turn|>\n<|turn>user\nHi<turn|>\n"
    assert _render(tokenizers["gemma4"], chat, enable_thinking=True) == thinking
    assert _render(tokenizers["gemma4"], chat) == thinking
    assert _render(tokenizers["gemma4"], chat, enable_thinking=False) == (
        "<|turn>user\nHi<turn|>\n"
    )


# -- the project's render path agrees with each template -----------------------------------

CALLS = (
    ToolCall("Bash", {"command": "ls -la", "timeout": 30}, "call_1"),
    ToolCall("Read", {"file_path": "README.md"}, "call_2"),
)
CONVERSATION = [
    Message("system", "You are a coding agent."),
    Message("user", "What is in this folder?"),
    Message("assistant", "", "List it, then read the README.", CALLS),
    Message("tool", "README.md\nsetup.py", tool_call_id="call_1"),
    Message("tool", "# Demo\nA demo project.", tool_call_id="call_2"),
    Message("assistant", "A README and a setup script.", "Summarize."),
    Message("user", "Thanks. Now run the tests."),
]
# The same conversation as a client would hand a template directly.
CONVERSATION_DICTS = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "What is in this folder?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "List it, then read the README.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "Bash", "arguments": {"command": "ls -la", "timeout": 30}},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "Read", "arguments": {"file_path": "README.md"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "README.md\nsetup.py"},
    {"role": "tool", "tool_call_id": "call_2", "content": "# Demo\nA demo project."},
    {
        "role": "assistant",
        "content": "A README and a setup script.",
        "reasoning_content": "Summarize.",
    },
    {"role": "user", "content": "Thanks. Now run the tests."},
]


@pytest.mark.parametrize("name", TEMPLATED)
@pytest.mark.parametrize("cut", [len(CONVERSATION), 5, 4])
def test_messages_render_through_the_project_as_the_template_renders_dicts(tokenizers, name, cut):
    # cut 5 and 4: ending on the answer, and on the tool results (reasoning still shown).
    tok = tokenizers[name]
    rendered = render_chat(tok, CONVERSATION[:cut], TOOLS)
    direct = _render(tok, CONVERSATION_DICTS[:cut], tools=TOOLS, add_generation_prompt=True)
    assert rendered.text == direct
    assert rendered.tokens == tok.encode(direct, add_special_tokens=False)
    assert [m.to_template() for m in CONVERSATION] == CONVERSATION_DICTS


QWEN_HISTORY = (
    "<|im_start|>user\nWhat is in this folder?<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n<function=Bash>\n"
    "<parameter=command>\nls -la\n</parameter>\n<parameter=timeout>\n30\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=Read>\n"
    "<parameter=file_path>\nREADME.md\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\nREADME.md\nsetup.py\n</tool_response>\n"
    "<tool_response>\n# Demo\nA demo project.\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nA README and a setup script.<|im_end|>\n"
    "<|im_start|>user\nThanks. Now run the tests.<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n"
)
GLM_HISTORY = (
    "<|user|>What is in this folder?"
    "<|assistant|></think><tool_call>Bash<arg_key>command</arg_key><arg_value>ls -la</arg_value>"
    "<arg_key>timeout</arg_key><arg_value>30</arg_value></tool_call>"
    "<tool_call>Read<arg_key>file_path</arg_key><arg_value>README.md</arg_value></tool_call>"
    "<|observation|><tool_response>README.md\nsetup.py</tool_response>"
    "<tool_response># Demo\nA demo project.</tool_response>"
    "<|assistant|></think>A README and a setup script."
    "<|user|>Thanks. Now run the tests.<|assistant|><think>"
)
GEMMA_HISTORY = (
    "<|turn>user\nWhat is in this folder?<turn|>\n"
    '<|turn>model\n<|tool_call>call:Bash{command:<|"|>ls -la<|"|>,timeout:30}<tool_call|>'
    '<|tool_call>call:Read{file_path:<|"|>README.md<|"|>}<tool_call|>'
    '<|tool_response>response:Bash{value:<|"|>README.md\nsetup.py<|"|>}<tool_response|>'
    '<|tool_response>response:Read{value:<|"|># Demo\nA demo project.<|"|>}<tool_response|>'
    "A README and a setup script.<turn|>\n"
    "<|turn>user\nThanks. Now run the tests.<turn|>\n<|turn>model\n"
)


@pytest.mark.parametrize(
    ("name", "system", "history"),
    [
        ("qwen3_coder", "<|im_start|>system\nYou are a coding agent.<|im_end|>\n", QWEN_HISTORY),
        ("glm47", "[gMASK]<sop><|system|>You are a coding agent.", GLM_HISTORY),
        ("gemma4", "<|turn>system\n<|think|>\nYou are a coding agent.<turn|>\n", GEMMA_HISTORY),
    ],
)
def test_history_renders_in_each_familys_markup(tokenizers, name, system, history):
    # Reasoning before the last user query is dropped (GLM keeps the closing </think>).
    # Gemma asks for thinking because mlx-lm passes enable_thinking=has_thinking.
    assert render_chat(tokenizers[name], CONVERSATION).text == system + history


def test_glm_keeps_all_reasoning_with_clear_thinking_false(tokenizers):
    text = render_chat(tokenizers["glm47"], CONVERSATION, None, {"clear_thinking": False}).text
    assert "<|assistant|><think>List it, then read the README.</think><tool_call>Bash" in text
    assert "<|assistant|><think>Summarize.</think>A README" in text


# -- the cache keeps hitting across tool turns ----------------------------------------------


def _answer(example, ids: tuple[str, ...]) -> Message:
    calls = tuple(
        ToolCall(c["name"], c["arguments"], i) for c, i in zip(example.calls, ids, strict=True)
    )
    return Message("assistant", "", example.reasoning, calls)


@pytest.mark.parametrize("name", [*TEMPLATED, "json_tools", "harmony"])
def test_each_tool_step_prompt_is_a_token_prefix_of_the_next(tokenizers, name):
    # Turn N's prompt plus the tokens the model wrote (the family's own answer) must open
    # turn N+1's prompt, tool step after tool step: that is what the cache reuses.
    tok, family = tokenizers[name], FAMILIES[name]
    kwargs = {"enable_thinking": True}
    steps = [[Message("system", "You are a coding agent."), Message("user", "List and read.")]]
    answers = [family.one_call, family.two_calls or family.one_call]
    for k, example in enumerate(answers):
        ids = tuple(f"call_{k}_{i}" for i in range(len(example.calls)))
        results = [Message("tool", f"result {i}", tool_call_id=j) for i, j in enumerate(ids)]
        steps.append([*steps[-1], _answer(example, ids), *results])
    prompts = [render_chat(tok, s, TOOLS, kwargs) for s in steps]
    for k, example in enumerate(answers):
        before, after = prompts[k], prompts[k + 1]
        written = tok.encode(example.text, add_special_tokens=False)
        assert after.text.startswith(before.text + example.text)
        assert after.tokens[: len(before.tokens) + len(written)] == before.tokens + written


@pytest.mark.parametrize("name", ["qwen3_coder", "glm47"])
def test_without_thinking_the_closed_empty_block_stays_a_prefix(tokenizers, name):
    tok = tokenizers[name]
    kwargs = {"enable_thinking": False}
    turn = [Message("user", "List the files.")]
    call = ToolCall("Bash", {"command": "ls -la", "timeout": 30}, "call_1")
    nxt = [*turn, Message("assistant", "", None, (call,)), Message("tool", "a", tool_call_id="c")]
    before, after = render_chat(tok, turn, TOOLS, kwargs), render_chat(tok, nxt, TOOLS, kwargs)
    assert after.tokens[: len(before.tokens)] == before.tokens


# -- every family: parser inference, tokens, and the example answers ------------------------


def _spans(text: str, start: str, end: str) -> list[str]:
    """What mlx-lm's state machine hands the parser: the text between the markers (to the
    end of the output for a family with no end marker)."""
    spans, rest = [], text
    while start in rest:
        rest = rest.split(start, 1)[1]
        body, _, rest = rest.partition(end) if end else (rest, "", "")
        spans.append(body)
    return spans


def _parse(parser: str, text: str) -> list[dict]:
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    calls = []
    for body in _spans(text, module.tool_call_start, module.tool_call_end):
        parsed = module.parse_tool_call(body, TOOLS)
        calls += parsed if isinstance(parsed, list) else [parsed]
    return [{"name": c["name"], "arguments": c["arguments"]} for c in calls]


def _reasoning(family, text: str) -> str:
    if family.think is None:  # harmony: the analysis channel
        return re.match(r"<\|channel\|>analysis<\|message\|>(.*?)<\|end\|>", text, re.S)[1]
    start, end = family.think
    inside = text if family.opens_thinking else text.split(start, 1)[1]
    return inside.split(end, 1)[0].strip()


def test_families_cover_the_parsers_asked_for():
    assert set(FAMILIES) == {
        "json_tools",
        "qwen3_coder",
        "glm47",
        "gemma4",
        "harmony",
        "kimi_k2",
        "minimax_m2",
        "mistral",
        "pythonic",
        "function_gemma",
        "longcat",
        "kimi_k3",
        "laguna",
        "minicpm5",
    }
    assert [n for n, f in FAMILIES.items() if f.explicit] == [
        "kimi_k2",
        "minimax_m2",
        "mistral",
        "pythonic",
        "function_gemma",
        "longcat",
        "kimi_k3",
        "laguna",
        "minicpm5",
    ]


@pytest.mark.parametrize("name", FAMILIES)
def test_mlx_lm_infers_each_familys_parser_and_reasoning_markers(family_dirs, name):
    family, path = FAMILIES[name], family_dirs[name]
    tok = load_tokenizer_dir(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    assert config.get("tool_parser_type") == (family.parser if family.explicit else None)
    if family.parser is None:
        assert tok.tool_parser is None
        assert {"<|start|>", "<|channel|>", "<|message|>", "<|call|>", "<|return|>"} <= set(
            tok.get_vocab()
        )
    else:
        module = importlib.import_module(f"mlx_lm.tool_parsers.{family.parser}")
        assert tok.tool_parser is module.parse_tool_call
        assert (tok.tool_call_start, tok.tool_call_end) == (
            module.tool_call_start,
            module.tool_call_end,
        )
    assert ((tok.think_start, tok.think_end) if tok.has_thinking else None) == family.think
    # Markers the real tokenizer has as single tokens are single tokens here too.
    for token in (*family.renames.values(), *family.control, *family.markup):
        assert len(tok.encode(token, add_special_tokens=False)) == 1, token
    assert len(tok) <= VOCAB_SIZE == json.loads((path / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("which", ["one_call", "two_calls"])
def test_example_answers_parse_back_to_their_reasoning_and_typed_calls(tokenizers, name, which):
    family = FAMILIES[name]
    example = getattr(family, which)
    if example is None:
        assert (name, which) == ("harmony", "two_calls")
        return
    assert example.calls[0] == {"name": "Bash", "arguments": {"command": "ls -la", "timeout": 30}}
    assert len(example.calls) == (1 if which == "one_call" else 2)
    tok = tokenizers[name]
    assert tok.decode(tok.encode(example.text, add_special_tokens=False)) == example.text
    assert _reasoning(family, example.text) == example.reasoning
    if family.parser is None:
        args = re.findall(
            r"to=functions\.(\w+) <\|constrain\|>json<\|message\|>(.*?)<\|call\|>", example.text
        )
        assert [{"name": n, "arguments": json.loads(a)} for n, a in args] == list(example.calls)
    else:
        assert _parse(family.parser, example.text) == list(example.calls)


@pytest.mark.parametrize("name", ["glm47", "gemma4"])
def test_family_model_loads_with_its_end_tokens_and_generates(family_dirs, name):
    from mlx_lm import generate

    model, tok = load(str(family_dirs[name]))
    assert tok.eos_token_ids == {tok.convert_tokens_to_ids(t) for t in FAMILIES[name].eos}
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True
    )
    assert len(generate(model, tok, prompt, max_tokens=4)) > 0


def test_unknown_family_is_refused_naming_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="json_tools, qwen3_coder, glm47"):
        write_family_model(tmp_path / "x", "llama4")


# -- builds ---------------------------------------------------------------------------------


def test_build_recipe_includes_the_template_each_demo_ships(monkeypatch):
    before = {name: build.recipe_digest(name) for name in specs.DEMO_MODEL_IDS}
    original = tokenizer._data

    def edited(filename: str) -> bytes:
        data = original(filename)
        return data + b"{#- edited -#}" if filename == "chat_template_qwen3_6.jinja" else data

    monkeypatch.setattr(tokenizer, "_data", edited)
    after = {name: build.recipe_digest(name) for name in specs.DEMO_MODEL_IDS}
    assert [n for n in specs.DEMO_MODEL_IDS if before[n] != after[n]] == ["demo-hybrid"]
