"""Test models that speak other families' output formats, and answers in each one's markup.

A family model is demo-llama's architecture over the demo tokenizer, with the family's
chat template (mlx-lm infers the tool parser from it) or, for families we have no template
for, the Hermes template plus `tool_parser_type` in tokenizer_config.json (mlx-lm honours
that key). Markers the real tokenizer has as single tokens are single tokens here too:
appended after the demo's ids, or, where the demo's own markup would change what mlx-lm
infers (Gemma 4 and gpt-oss have no `<think>`), put in its place. Every family model has
the same vocabulary size and so the same weights.

A family model can also be built on a real model's template (real_templates.py): then mlx-lm
infers from that template and that model's markers what it infers for the real model.

Each family carries example answers in its real markup, reasoning first: one call and two
calls, as the model writes them right after the family's generation prompt. Forcing a model
to write one of them must give back `reasoning` and `calls` (tests/prompting/test_demo_templates.py
checks each text with the family's mlx-lm parser).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from . import markup, real_templates, specs, tokenizer

# Room for every family's extra tokens; the model's vocabulary covers the tokenizer's.
EXTRA_IDS = 32
VOCAB_SIZE = tokenizer.VOCAB_SIZE + EXTRA_IDS


def _tool(name: str, properties: dict[str, str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name} tool.",
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t} for k, t in properties.items()},
                "required": list(properties),
            },
        },
    }


# The tools the examples call; the integers come back typed only with this schema.
TOOLS = [
    _tool("Bash", {"command": "string", "timeout": "integer"}),
    _tool("Read", {"file_path": "string", "limit": "integer"}),
]
REASONING = "The user wants to see the files, so I list them."
# The same tools as the Anthropic dialect takes them.
TOOLS_ANTHROPIC = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
BASH = {"name": "Bash", "arguments": {"command": "ls -la", "timeout": 30}}
READ = {"name": "Read", "arguments": {"file_path": "README.md", "limit": 20}}


@dataclass(frozen=True, slots=True)
class Example:
    """An answer as the model writes it after the generation prompt, and what it means."""

    text: str
    # The reasoning in it, without its markers or the blank lines around it.
    reasoning: str
    # {"name": ..., "arguments": {...}}, arguments typed by TOOLS' schema.
    calls: tuple[dict[str, Any], ...]


@dataclass(frozen=True, slots=True)
class Family:
    """One output format: how its test model is built, and answers in its markup."""

    name: str
    # The mlx-lm tool_parsers module that reads its calls; None for harmony (no parser).
    parser: str | None
    # Its chat template under demo/data; None: the Hermes template and, when `parser` is
    # set, an explicit `tool_parser_type`.
    template: str | None
    # The reasoning markers mlx-lm infers from the vocabulary (think_start, think_end).
    think: tuple[str, str] | None
    # The generation prompt opens the reasoning block, so `text` starts inside it.
    opens_thinking: bool
    one_call: Example
    # None where the format cannot hold two calls in one generation (gpt-oss stops at
    # `<|call|>`, an end-of-sequence token).
    two_calls: Example | None
    # Demo tokens replaced in place (same id), control tokens and markup tokens appended.
    renames: dict[str, str] = field(default_factory=dict)
    control: tuple[str, ...] = ()
    markup: tuple[str, ...] = ()
    # End-of-sequence tokens, first one the tokenizer's eos_token.
    eos: tuple[str, ...] = (tokenizer.EOS_TOKEN,)
    # A real model's template (real_templates.py), which replaces `template`.
    template_file: Path | None = None

    @property
    def explicit(self) -> bool:
        """tokenizer_config.json names the parser (mlx-lm cannot infer it from a template)."""
        return self.parser is not None and self.template is None and self.template_file is None

    def chat_template(self) -> str:
        if self.template_file is not None:
            return self.template_file.read_text(encoding="utf-8")
        return tokenizer.chat_template(self.template or specs.HERMES_TEMPLATE)


# -- the example answers: reasoning, then calls written as markup.py writes them ----------


def _think(reasoning: str) -> str:
    # After a ChatML generation prompt that opens nothing: the demo vocabulary's markers.
    return f"<think>\n{reasoning}\n</think>\n\n"


def _example(
    reasoning: str, calls: tuple[dict[str, Any], ...], head: Callable[[str], str], body: str
) -> Example:
    return Example(head(reasoning) + body, reasoning, calls)


def _examples(
    head: Callable[[str], str],
    write: Callable[[tuple[dict[str, Any], ...]], str],
    two: bool = True,
    reasoning: str = REASONING,
) -> tuple[Example, Example | None]:
    one_call, two_calls = (BASH,), (BASH, READ)
    return (
        _example(reasoning, one_call, head, write(one_call)),
        _example(reasoning, two_calls, head, write(two_calls)) if two else None,
    )


def _family(name: str, write, head=_think, two: bool = True, **kwargs: Any) -> Family:
    one_call, two_calls = _examples(head, write, two)
    return Family(name=name, one_call=one_call, two_calls=two_calls, **kwargs)


_THINK = ("<think>", "</think>")
# GLM 4.5-4.7's argument tags, which Laguna's calls use too.
_GLM_ARGS = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        # demo-llama's and demo-swa's own format.
        _family(
            "json_tools",
            markup.hermes,
            parser="json_tools",
            template=specs.HERMES_TEMPLATE,
            think=_THINK,
            opens_thinking=False,
        ),
        # demo-hybrid's: Qwen3.5/3.6 XML calls, <think> opened by the generation prompt.
        _family(
            "qwen3_coder",
            markup.qwen3_xml,
            head=lambda r: f"{r}\n</think>\n\n",
            parser="qwen3_coder",
            template=specs.chat_template_file("demo-hybrid"),
            think=_THINK,
            opens_thinking=True,
        ),
        _family(
            "glm47",
            markup.glm47,
            head=lambda r: f"{r}</think>",
            parser="glm47",
            template="chat_template_glm4_7.jinja",
            think=_THINK,
            opens_thinking=True,
            control=(
                "[gMASK]",
                "<sop>",
                "<|system|>",
                "<|user|>",
                "<|assistant|>",
                "<|observation|>",
            ),
            markup=_GLM_ARGS,
            eos=("<|user|>", "<|observation|>", "<|endoftext|>"),
        ),
        _family(
            "gemma4",
            markup.gemma4,
            head=lambda r: f"<|channel>thought\n{r}<channel|>",
            parser="gemma4",
            template="chat_template_gemma4.jinja",
            think=("<|channel>thought", "<channel|>"),
            opens_thinking=False,
            # Gemma's vocabulary has none of the ChatML markup; mlx-lm would find <think>
            # before <|channel>.
            renames=real_templates.GEMMA_RENAMES,
            markup=('<|"|>', "<|think|>", "<|tool>", "<tool|>"),
            eos=("<turn|>", "<|tool_response>"),
        ),
        # gpt-oss: mlx-lm has no parser; engine_bridge/prompting/harmony.py reads the channels.
        _family(
            "harmony",
            markup.harmony,
            head=lambda r: f"<|channel|>analysis<|message|>{r}<|end|>",
            two=False,
            parser=None,
            template="chat_template_harmony.jinja",
            think=None,
            opens_thinking=False,
            renames=real_templates.HARMONY_RENAMES,
            markup=("<|call|>",),
            eos=("<|return|>", "<|call|>"),
        ),
        # No template of ours: the Hermes one, and tool_parser_type names the parser.
        _family(
            "kimi_k2",
            markup.kimi_k2,
            parser="kimi_k2",
            template=None,
            think=_THINK,
            opens_thinking=False,
            markup=(
                "<|tool_calls_section_begin|>",
                "<|tool_calls_section_end|>",
                "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>",
                "<|tool_call_end|>",
            ),
        ),
        _family(
            "minimax_m2",
            markup.minimax_m2,
            parser="minimax_m2",
            template=None,
            think=_THINK,
            opens_thinking=False,
            markup=("<minimax:tool_call>", "</minimax:tool_call>"),
        ),
        # Magistral writes [THINK]...[/THINK], which mlx-lm 0.32.2 does not infer: the
        # reasoning here uses the demo vocabulary's <think>.
        _family(
            "mistral",
            markup.mistral,
            parser="mistral",
            template=None,
            think=_THINK,
            opens_thinking=False,
            markup=("[TOOL_CALLS]", "[ARGS]"),
        ),
        _family(
            "pythonic",
            markup.pythonic,
            parser="pythonic",
            template=None,
            think=_THINK,
            opens_thinking=False,
            markup=("<|tool_call_start|>", "<|tool_call_end|>"),
        ),
        _family(
            "function_gemma",
            markup.function_gemma,
            parser="function_gemma",
            template=None,
            think=_THINK,
            opens_thinking=False,
            markup=("<start_function_call>", "<end_function_call>", "<escape>"),
        ),
        _family(
            "longcat",
            markup.longcat,
            head=lambda r: f"<longcat_think>\n{r}\n</longcat_think>\n\n",
            parser="longcat",
            template=None,
            think=("<longcat_think>", "</longcat_think>"),
            opens_thinking=False,
            renames={
                "<think>": "<longcat_think>",
                "</think>": "</longcat_think>",
                "<tool_call>": "<longcat_tool_call>",
                "</tool_call>": "</longcat_tool_call>",
            },
            markup=(
                "<longcat_arg_key>",
                "</longcat_arg_key>",
                "<longcat_arg_value>",
                "</longcat_arg_value>",
            ),
        ),
        # Kimi K3's XTML: every marker is spelled with the <|open|>/<|close|>/<|sep|> tokens,
        # so reasoning and the tools section are several tokens each; the reply's response
        # section (empty before a call here) and the message end are structural markers.
        _family(
            "kimi_k3",
            markup.kimi_k3,
            head=lambda r: (
                f"<|open|>think<|sep|>{r}<|close|>think<|sep|>"
                "<|open|>response<|sep|><|close|>response<|sep|>"
            ),
            parser="kimi_k3",
            template=None,
            think=("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
            opens_thinking=False,
            # mlx-lm reads an XTML vocabulary by these four; <think> would win over them.
            renames={"<think>": "<|open|>", "</think>": "<|close|>"},
            markup=("<|sep|>", "<|end_of_msg|>"),
        ),
        # Poolside Laguna writes GLM 4.7's calls; its checkpoints name the parser.
        _family(
            "laguna",
            markup.glm47,
            parser="laguna",
            template=None,
            think=_THINK,
            opens_thinking=False,
            markup=_GLM_ARGS,
        ),
        _family(
            "minicpm5",
            markup.minicpm5,
            parser="minicpm5",
            template=None,
            think=_THINK,
            opens_thinking=False,
        ),
    )
}


def real_family(name: str, template_file: Path) -> Family:
    """`name`'s family on a real template file (a REAL_TEMPLATES entry): its tokens, its
    reasoning markers and its example answers as that template's model writes them."""
    real = real_templates.REAL.get(Path(template_file).name)
    if real is None or real.family != name:
        valid = ", ".join(real_templates.REAL_TEMPLATES.get(name, ()))
        raise ValueError(f"{Path(template_file).name!r} is not a {name} template; valid: {valid}")
    # A model that does not reason writes its calls right after the generation prompt.
    head = real.head or (lambda _: "")
    one_call, two_calls = _examples(
        head, real.write, real.two_calls, REASONING if real.head else ""
    )
    return dataclasses.replace(
        FAMILIES[name],
        template=None,
        template_file=Path(template_file),
        think=real.think,
        opens_thinking=real.opens_thinking,
        one_call=one_call,
        two_calls=two_calls,
        renames=real.renames,
        control=real.control,
        markup=real.markup,
        eos=real.eos,
    )


# -- building a family model ----------------------------------------------------------------


def family_tokenizer(family: Family) -> Tokenizer:
    """The demo tokenizer with `family`'s tokens renamed in place and appended."""
    data = json.loads(tokenizer.train_tokenizer().to_str())
    names = {t["content"] for t in data["added_tokens"]}
    assert set(family.renames) <= names, (family.name, set(family.renames) - names)
    for added in data["added_tokens"]:
        added["content"] = family.renames.get(added["content"], added["content"])
    tok = Tokenizer.from_str(json.dumps(data))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.markup])
    size = tok.get_vocab_size(with_added_tokens=True)
    assert size == tokenizer.VOCAB_SIZE + len(family.control) + len(family.markup) <= VOCAB_SIZE, (
        family.name,
        size,
    )
    return tok


def write_family_model(out_dir: Path, family: str, template_file: Path | None = None) -> Path:
    """Write a loadable model directory speaking `family` (a FAMILIES key) into `out_dir`,
    on `template_file` (a real template of that family) when given."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; valid: {', '.join(FAMILIES)}")
    spec = FAMILIES[family] if template_file is None else real_family(family, template_file)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = family_tokenizer(spec)
    eos_ids = [tok.token_to_id(t) for t in spec.eos]
    assert None not in eos_ids, (family, spec.eos, eos_ids)
    config = {
        **specs.model_config("demo-llama", VOCAB_SIZE, eos_ids[0]),
        "eos_token_id": eos_ids if len(eos_ids) > 1 else eos_ids[0],
    }
    from . import weights  # imports mlx: only when a model is written

    weights.save_weights(_weights(), out / "model.safetensors")
    extra = {"tool_parser_type": spec.parser} if spec.explicit else {}
    tokenizer.write_tokenizer_files(
        tok, out, spec.chat_template(), eos_token=spec.eos[0], extra=extra
    )
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


@functools.cache
def _weights() -> dict[str, Any]:
    # One set for every family: the same vocabulary size, and every id from the demo's
    # first special token on muted (controls, markup, family tokens and the unused rest).
    from . import weights

    config = specs.model_config("demo-llama", VOCAB_SIZE, 0)
    first = tokenizer.VOCAB_SIZE - len(tokenizer.SPECIAL_TOKENS)
    return weights.random_weights(config, list(range(first, VOCAB_SIZE)))
