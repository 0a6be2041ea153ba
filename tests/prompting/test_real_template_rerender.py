"""Family models on the real templates: what mlx-lm infers from each, and whether a tool step
re-rendered from the parsed call gives back exactly the tokens the model wrote.

The cache reuses, on the next tool step, the longest token prefix shared by this step's
prompt plus what the model generated and the next step's prompt, which a client builds
from the *parsed* answer (content, reasoning, calls with JSON arguments). Where a template
renders that answer differently from how the model wrote it, everything past the first
differing token is prefilled again. Known differences are strict xfails naming the cause.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer_dir

from engine_bridge.models.demo import families, real_templates
from engine_bridge.prompting import reasoning_layout
from engine_bridge.prompting.output_format import OutputFormat
from engine_bridge.prompting.render import render_chat
from engine_bridge.types import Message

TEMPLATES = real_templates.templates_dir()
PAIRS = [(f, t) for f, names in real_templates.REAL_TEMPLATES.items() for t in names]
BASE = [Message("system", "You are a coding agent."), Message("user", "List and read.")]

# What each template renders right after the assistant turn the model wrote: its first
# token is the one the model stops on.
AFTER_TURN = {
    "qwen3_6.jinja": "<|im_end|>\n<|im_start|>user\n<tool_response>\n",
    "qwen3_5.jinja": "<|im_end|>\n<|im_start|>user\n<tool_response>\n",
    "qwen3_coder.jinja": "<|im_end|>\n<|im_start|>user\n<tool_response>\n",
    "glm_4_7_flash.jinja": "<|observation|><tool_response>",
    "glm_4_6.jinja": "<|observation|>\n<tool_response>\n",
    "kimi_k2_moonshotai.jinja": "<|im_end|><|im_system|>tool<|im_middle|>",
    "ministral3_14b_reasoning_2512.jinja": "</s>[TOOL_RESULTS]",
    "devstral_small_2507_unsloth.jinja": "</s>[TOOL_RESULTS]",
}

# Where the re-rendered turn is not what the model wrote, and why (measured; see each).
_GEMMA = (
    "mlx-lm's Gemma 4 think_start is '<|channel>thought' without the newline the model "
    "writes after it, so the parsed reasoning starts with '\\n' and the template, which "
    "writes '<|channel>thought\\n' + reasoning, renders '<|channel>thought\\n\\nThe user'"
)
_KIMI_APPEND = (
    "the template calls tool_response_queue.ids.append(...), which transformers' sandboxed "
    "jinja refuses ('access to attribute append of list object is unsafe'): any history "
    "with a tool call fails to render"
)
RERENDER_DIFFERS = {
    "gemma4_31b_it.jinja": _GEMMA,
    "gemma4_31b_it_interleaved.jinja": _GEMMA,
    "gpt_oss_harmony.jinja": (
        "the template writes the call header as '<|start|>assistant to=functions.Bash"
        "<|channel|>commentary json<|message|>' and the arguments with tojson's spaces; gpt-oss "
        "writes '<|start|>assistant<|channel|>commentary to=functions.Bash <|constrain|>json"
        "<|message|>' and compact JSON"
    ),
    "kimi_k2_instruct.jinja": _KIMI_APPEND,
    "kimi_k2_thinking.jinja": _KIMI_APPEND,
    "minimax_m2.jinja": (
        "the parsed reasoning keeps the newline the model writes before '\\n</think>' and the "
        "template does not trim it: it renders 'them.\\n\\n</think>' where the model wrote "
        "'them.\\n</think>'"
    ),
    "mistral_small_3_2_2506.jinja": (
        "mlx-lm's mistral parser names the call by its [CALL_ID] (the word before [ARGS]) and "
        "drops the id, and the template rejects the server's ids (not 9 alphanumerics)"
    ),
}


def _params(*, rerender: bool = False):
    for family, template in PAIRS:
        marks = []
        if rerender and template in RERENDER_DIFFERS:
            marks.append(pytest.mark.xfail(strict=True, reason=RERENDER_DIFFERS[template]))
        yield pytest.param(family, template, marks=marks, id=template.removesuffix(".jinja"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(family, template) -> (its Family, its model's tokenizer), each built once."""
    root = tmp_path_factory.mktemp("real-templates")
    seen = {}

    def get(family: str, template: str):
        if not (TEMPLATES / template).is_file():
            pytest.skip(f"{template} is not in {TEMPLATES}")
        if template not in seen:
            path = families.write_family_model(root / template, family, TEMPLATES / template)
            seen[template] = (
                families.real_family(family, TEMPLATES / template),
                load_tokenizer_dir(path),
            )
        return seen[template]

    return get


@pytest.mark.parametrize(("family", "template"), list(_params()))
def test_mlx_lm_infers_the_real_models_parser_and_reasoning_markers(built, family, template):
    fam, tok = built(family, template)
    fmt = OutputFormat.of(tok)
    if fam.parser is None:
        assert fmt.family == "harmony"
    else:
        module = importlib.import_module(f"mlx_lm.tool_parsers.{fam.parser}")
        assert tok.tool_parser is module.parse_tool_call
    assert ((tok.think_start, tok.think_end) if tok.has_thinking else None) == fam.think
    # Markers the real tokenizer has as single tokens are single tokens here too.
    for token in (*fam.renames.values(), *fam.control, *fam.markup, *fam.eos):
        assert len(tok.encode(token, add_special_tokens=False)) == 1, token
    assert len(tok) <= families.VOCAB_SIZE
    # The generation prompt opens the reasoning block exactly where the family says.
    prompt = render_chat(tok, BASE, families.TOOLS)
    assert fmt.opens_in_reasoning(prompt.text) is fam.opens_thinking


def _as_the_client_sends_it_back(tok, prompt_text: str, text: str) -> Message:
    """The answer the server parses out of `text`, as an OpenAI client sends it back."""
    parser = OutputFormat.of(tok).parser(prompt_text=prompt_text, tools=families.TOOLS)
    parts = parser.feed(text) + parser.finish("stop")
    reasoning = "".join(p.text for p in parts if p.kind == "reasoning")
    calls = tuple(p.call for p in parts if p.kind == "tool_call")
    content = "".join(p.text for p in parts if p.kind == "text")
    return Message("assistant", content, reasoning or None, calls)


def _first_difference(a: str, b: str) -> str:
    at = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    return f"at {at}: wrote {a[at - 30 : at + 40]!r}, re-rendered {b[at - 30 : at + 40]!r}"


@pytest.mark.parametrize("which", ["one_call", "two_calls"])
@pytest.mark.parametrize(("family", "template"), list(_params(rerender=True)))
def test_a_tool_step_rerendered_from_the_parsed_calls_reuses_all_the_model_wrote(
    built, family, template, which
):
    fam, tok = built(family, template)
    example = getattr(fam, which)
    if example is None:
        pytest.skip(f"{template}'s model writes one call a generation")
    prompt = render_chat(tok, BASE, families.TOOLS)
    answer = _as_the_client_sends_it_back(tok, prompt.text, example.text)
    assert [(c.name, c.arguments) for c in answer.tool_calls] == [
        (c["name"], c["arguments"]) for c in example.calls
    ]
    results = [
        Message("tool", f"result {i}", tool_call_id=c.id) for i, c in enumerate(answer.tool_calls)
    ]
    following = render_chat(tok, [*BASE, answer, *results], families.TOOLS)

    wrote = prompt.text + example.text
    assert following.text.startswith(wrote), _first_difference(wrote, following.text)
    generated = prompt.tokens + tok.encode(example.text, add_special_tokens=False)
    assert following.tokens[: len(generated)] == generated
    # ...and the token the model stopped on: the template's own end of the turn.
    after = AFTER_TURN[template]
    assert following.text[len(wrote) :].startswith(after)
    stop = following.tokens[len(generated)]
    assert stop in {tok.convert_tokens_to_ids(t) for t in fam.eos}
    assert after.startswith(tok.convert_ids_to_tokens(stop))


# What learning the reasoning's layout (engine_bridge/prompting/reasoning_layout.py) fixes:
# the newline differences; the rest are in the templates, mlx-lm or transformers.
LAYOUT_FIXES = ("gemma4_31b_it.jinja", "gemma4_31b_it_interleaved.jinja", "minimax_m2.jinja")


@pytest.mark.parametrize(
    ("family", "template"),
    [
        pytest.param(
            f,
            t,
            id=t.removesuffix(".jinja"),
            marks=[pytest.mark.xfail(strict=True, reason=RERENDER_DIFFERS[t])]
            if t in RERENDER_DIFFERS and t not in LAYOUT_FIXES
            else [],
        )
        for f, t in PAIRS
    ],
)
def test_with_the_learned_reasoning_layout_a_tool_step_reuses_all_the_model_wrote(
    built, family, template
):
    """As the engine does after a turn: it finds which layout of the reasoning renders the
    generated tokens, and sends every later turn of the model to its template that way."""
    fam, tok = built(family, template)
    prompt = render_chat(tok, BASE, families.TOOLS)
    answer = _as_the_client_sends_it_back(tok, prompt.text, fam.one_call.text)
    generated = prompt.tokens + tok.encode(fam.one_call.text, add_special_tokens=False)
    edge = "as_sent"
    if reasoning_layout.has_edges(answer.reasoning):
        edge = reasoning_layout.learn(tok, BASE, answer, generated, families.TOOLS, {})
        assert edge is not None
    assert (edge != "as_sent") is (template in LAYOUT_FIXES)
    results = [Message("tool", "result", tool_call_id=c.id) for c in answer.tool_calls]
    sent = reasoning_layout.send_back(edge, [*BASE, answer, *results])
    following = render_chat(tok, sent, families.TOOLS)
    assert following.tokens[: len(generated)] == generated


def test_the_templates_folder_is_the_shared_one_beside_the_repository():
    repo = Path(__file__).resolve().parents[2]
    assert TEMPLATES.resolve() == (repo / ".." / "shared" / "templates").resolve()
    if not TEMPLATES.is_dir():
        pytest.skip(f"no real chat templates in {TEMPLATES}")
    assert real_templates.real_pairs() == PAIRS


def test_a_family_model_refuses_another_familys_template(tmp_path):
    with pytest.raises(ValueError, match="'minimax_m2.jinja' is not a glm47 template; valid: "):
        families.write_family_model(tmp_path / "x", "glm47", TEMPLATES / "minimax_m2.jinja")
