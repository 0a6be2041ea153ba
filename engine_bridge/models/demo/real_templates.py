"""The real chat templates a family model can be built on, and how each one's model writes.

Real models' templates live in `<repo root>/../shared/templates/` (third-party data, never
copied into the project). A family model on one of them (families.real_family) has that
model's markers as single tokens, so mlx-lm infers from the template and vocabulary what it
infers for the real model, and its example answers are written as the real model writes
them after that template's generation prompt: the reasoning head (or none, for a model that
does not reason), then the calls in the form the template renders them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import markup

# Family name -> the real template files (in templates_dir()) that speak it.
REAL_TEMPLATES: dict[str, tuple[str, ...]] = {
    "qwen3_coder": ("qwen3_6.jinja", "qwen3_5.jinja", "qwen3_coder.jinja"),
    "glm47": ("glm_4_7_flash.jinja", "glm_4_6.jinja"),
    "gemma4": ("gemma4_31b_it.jinja", "gemma4_31b_it_interleaved.jinja"),
    "harmony": ("gpt_oss_harmony.jinja",),
    "kimi_k2": ("kimi_k2_instruct.jinja", "kimi_k2_moonshotai.jinja", "kimi_k2_thinking.jinja"),
    "minimax_m2": ("minimax_m2.jinja",),
    "mistral": (
        "ministral3_14b_reasoning_2512.jinja",
        "devstral_small_2507_unsloth.jinja",
        "mistral_small_3_2_2506.jinja",
    ),
}


def templates_dir() -> Path:
    """`<repo root>/../shared/templates`: the real templates, absent outside the workplace."""
    return Path(__file__).resolve().parents[3] / ".." / "shared" / "templates"


def real_pairs(folder: Path | None = None) -> list[tuple[str, str]]:
    """(family, template file name) for every real template present in `folder`."""
    folder = templates_dir() if folder is None else folder
    return [(f, t) for f, names in REAL_TEMPLATES.items() for t in names if (folder / t).is_file()]


Write = Callable[[tuple[dict[str, Any], ...]], str]


@dataclass(frozen=True, slots=True)
class RealTemplate:
    """How a family model on one real template is tokenized and what its model writes."""

    family: str
    # Reasoning -> the text the model writes before its calls; None: it writes no reasoning.
    head: Callable[[str], str] | None
    write: Write
    # The reasoning markers mlx-lm infers from the real vocabulary (None: it infers none).
    think: tuple[str, str] | None
    opens_thinking: bool
    # As in families.Family: demo tokens renamed, control and markup tokens appended, the
    # end-of-sequence tokens (first one the tokenizer's eos_token).
    renames: dict[str, str]
    control: tuple[str, ...]
    markup: tuple[str, ...]
    eos: tuple[str, ...]
    two_calls: bool = True


_THINK = ("<think>", "</think>")
_CHATML_EOS = ("<|im_end|>",)
_QWEN_VISION = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_GLM_CONTROL = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
_GLM_ARGS = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
# The demo tokens Gemma 4's and gpt-oss's vocabularies have in other spellings (families.py
# builds its written-here templates' models with them too).
GEMMA_RENAMES = {
    "<|im_start|>": "<|turn>",
    "<|im_end|>": "<turn|>",
    "<think>": "<|channel>",
    "</think>": "<channel|>",
    "<tool_call>": "<|tool_call>",
    "</tool_call>": "<tool_call|>",
    "<tool_response>": "<|tool_response>",
    "</tool_response>": "<tool_response|>",
}
HARMONY_RENAMES = {
    "<think>": "<|start|>",
    "</think>": "<|end|>",
    "<tool_call>": "<|message|>",
    "</tool_call>": "<|channel|>",
    "<tool_response>": "<|constrain|>",
    "</tool_response>": "<|return|>",
}
_KIMI_CONTROL = (
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|media_start|>",
    "<|media_content|>",
    "<|media_pad|>",
    "<|media_end|>",
)
_KIMI_MARKUP = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
# Mistral's tekken vocabulary has no <think>: [THINK] takes its id, so mlx-lm 0.32.2 infers
# no reasoning markers for any of these models, as for the real ones.
_MISTRAL_RENAMES = {
    "<|im_start|>": "<s>",
    "<|im_end|>": "</s>",
    "<think>": "[THINK]",
    "</think>": "[/THINK]",
}
_MISTRAL_CONTROL = (
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CONTENT]",
    "[IMG]",
)


def _minimax_calls(calls: tuple[dict[str, Any], ...]) -> str:
    # The template opens the calls block with a newline of its own after the reasoning's.
    return "\n" + markup.minimax_m2(calls)


def _qwen(head: Callable[[str], str] | None, opens: bool) -> dict[str, Any]:
    return dict(
        family="qwen3_coder",
        head=head,
        write=markup.qwen3_xml,
        think=_THINK,
        opens_thinking=opens,
        renames={},
        control=_QWEN_VISION,
        markup=(),
        eos=_CHATML_EOS,
    )


def _glm(head: Callable[[str], str], write: Write, opens: bool) -> dict[str, Any]:
    return dict(
        family="glm47",
        head=head,
        write=write,
        think=_THINK,
        opens_thinking=opens,
        renames={},
        control=_GLM_CONTROL,
        markup=_GLM_ARGS,
        eos=("<|user|>", "<|observation|>", "<|endoftext|>"),
    )


def _gemma(head: Callable[[str], str]) -> dict[str, Any]:
    return dict(
        family="gemma4",
        head=head,
        write=markup.gemma4,
        think=("<|channel>thought", "<channel|>"),
        opens_thinking=False,
        renames=GEMMA_RENAMES,
        control=("<|image|>", "<|audio|>", "<|video|>"),
        markup=('<|"|>', "<|think|>", "<|tool>", "<tool|>"),
        eos=("<turn|>", "<|tool_response>"),
    )


def _kimi(head: Callable[[str], str] | None) -> dict[str, Any]:
    return dict(
        family="kimi_k2",
        head=head,
        write=markup.kimi_k2,
        think=_THINK,
        opens_thinking=False,
        renames={},
        control=_KIMI_CONTROL,
        markup=_KIMI_MARKUP,
        eos=_CHATML_EOS,
    )


def _mistral(head: Callable[[str], str] | None, write: Write, ids: bool = False) -> dict[str, Any]:
    return dict(
        family="mistral",
        head=head,
        write=write,
        think=None,
        opens_thinking=False,
        renames=_MISTRAL_RENAMES,
        control=_MISTRAL_CONTROL,
        markup=("[TOOL_CALLS]", "[ARGS]", *(("[CALL_ID]",) if ids else ())),
        eos=("</s>",),
    )


# Template file name -> how its model writes. Heads and call layouts are the template's own
# rendering of a tool-call turn, which is what the real model was trained to write.
REAL: dict[str, RealTemplate] = {
    name: RealTemplate(**spec)
    for name, spec in {
        # Qwen3.5/3.6: the generation prompt opens <think>.
        "qwen3_6.jinja": _qwen(lambda r: f"{r}\n</think>\n\n", True),
        "qwen3_5.jinja": _qwen(lambda r: f"{r}\n</think>\n\n", True),
        # Qwen3-Coder does not reason; its Qwen3 vocabulary still has <think>.
        "qwen3_coder.jinja": _qwen(None, False),
        # GLM-4.7 opens <think> in the prompt; GLM-4.6 writes it, and puts its calls and
        # arguments on lines of their own.
        "glm_4_7_flash.jinja": _glm(lambda r: f"{r}</think>", markup.glm47, True),
        "glm_4_6.jinja": _glm(lambda r: f"\n<think>{r}</think>", markup.glm46, False),
        # Gemma 4 writes a thought channel; the interleaved variant keeps no newline before
        # its end.
        "gemma4_31b_it.jinja": _gemma(lambda r: f"<|channel>thought\n{r}\n<channel|>"),
        "gemma4_31b_it_interleaved.jinja": _gemma(lambda r: f"<|channel>thought\n{r}<channel|>"),
        "gpt_oss_harmony.jinja": dict(
            family="harmony",
            head=lambda r: f"<|channel|>analysis<|message|>{r}<|end|>",
            write=markup.harmony,
            think=None,
            opens_thinking=False,
            renames=HARMONY_RENAMES,
            control=(),
            markup=("<|call|>",),
            eos=("<|return|>", "<|call|>"),
            two_calls=False,
        ),
        "kimi_k2_instruct.jinja": _kimi(None),
        "kimi_k2_moonshotai.jinja": _kimi(None),
        "kimi_k2_thinking.jinja": _kimi(lambda r: f"<think>{r}</think>"),
        # The generation prompt opens <think>.
        "minimax_m2.jinja": dict(
            family="minimax_m2",
            head=lambda r: f"{r}\n</think>\n\n",
            write=_minimax_calls,
            think=_THINK,
            opens_thinking=True,
            renames={},
            control=("]~!b[", "]~b]", "[e~["),
            markup=("<minimax:tool_call>", "</minimax:tool_call>"),
            eos=("[e~[",),
        ),
        # Ministral 3 Reasoning writes [THINK]...[/THINK], which mlx-lm 0.32.2 does not read
        # as reasoning; the other two do not reason. Mistral Small 3.2 writes a call id.
        "ministral3_14b_reasoning_2512.jinja": _mistral(
            lambda r: f"[THINK]{r}[/THINK]", markup.mistral
        ),
        "devstral_small_2507_unsloth.jinja": _mistral(None, markup.mistral),
        "mistral_small_3_2_2506.jinja": _mistral(None, markup.mistral_call_ids, ids=True),
    }.items()
}
assert {n for names in REAL_TEMPLATES.values() for n in names} == set(REAL), set(REAL)
