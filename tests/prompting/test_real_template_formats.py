"""Every family's tool calls on every real template that speaks it, through the whole server.

test_tool_formats.py runs the families on templates written here; this runs them on the
real models' templates in `../shared/templates/` (engine_bridge/models/demo/real_templates.py),
where mlx-lm infers what it infers for the real model. One server serves every such model;
the forced-output hook makes each write its model's markup, and the official SDKs read it.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from engine_bridge.models.demo import families, real_templates
from tests.conftest import fresh_cache_dir, start_server
from tests.prompting import test_tool_formats as tf

TEMPLATES = real_templates.templates_dir()
PAIRS = [(f, t) for f, names in real_templates.REAL_TEMPLATES.items() for t in names]
SCENARIOS = ("one", "two", "cut")

# mlx-lm 0.32.2's Mistral parser takes the last word before [ARGS] as the name, and Mistral
# Small 3.2 writes `name[CALL_ID]id[ARGS]`: its calls come back named by their ids.
KNOWN_BROKEN = {
    "mistral_small_3_2_2506.jinja": "mlx-lm's mistral parser reads `Bash[CALL_ID]a1B2c3D4e"
    "[ARGS]{...}` as a call named 'a1B2c3D4e' (its regex takes the word before [ARGS])",
}


def _stem(template: str) -> str:
    return Path(template).stem


def _pair_params():
    for family, template in PAIRS:
        marks = []
        if template in KNOWN_BROKEN:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_BROKEN[template]))
        yield pytest.param(family, template, marks=marks, id=_stem(template))


@pytest.fixture(scope="module")
def real_server(demo_root, tmp_path_factory):
    """One server with a family model per real template present, each forced to its answers."""
    present = real_templates.real_pairs()
    if not present:
        pytest.skip(f"no real chat templates in {TEMPLATES}")
    root = tmp_path_factory.mktemp("real-families")
    cache_dir = fresh_cache_dir(demo_root, root / "cache")
    models, specs, cuts, outputs = {}, {}, {}, []
    for family, template in present:
        stem = _stem(template)
        fam = families.real_family(family, TEMPLATES / template)
        path = families.write_family_model(root / "models" / stem, family, TEMPLATES / template)
        models[template], specs[template] = path, fam
        for scenario in SCENARIOS:
            example = fam.two_calls if scenario == "two" else fam.one_call
            if example is not None:
                outputs.append({"match": f"[case={stem}-{scenario}]", "text": example.text})
        cuts[template] = tf._tokens_into_the_call(path, fam)
    forced = root / "forced.json"
    forced.write_text(json.dumps({"outputs": outputs}))
    args = ["--upstream", "http://127.0.0.1:9"]
    for path in models.values():
        args += ["--model", str(path)]
    server = start_server(cache_dir, *args, env={"MLX_PROMPT_CACHE_FORCE_OUTPUT": str(forced)})
    ids = tf._model_ids(server.url)
    yield server, {t: ids[p.name] for t, p in models.items()}, specs, cuts
    server.stop()


def _expected(fam: families.Family, example: families.Example) -> tuple[str, str]:
    """(reasoning, text) a client reads: where mlx-lm infers no reasoning markers for a model
    that reasons (Ministral 3's [THINK]), its reasoning arrives as answer text, markers kept."""
    if fam.think is None and fam.parser is not None and example.reasoning:
        start = importlib.import_module(f"mlx_lm.tool_parsers.{fam.parser}").tool_call_start
        return "", example.text[: example.text.index(start)]
    return example.reasoning, ""


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
@pytest.mark.parametrize(("family", "template"), list(_pair_params()))
def test_calls_on_a_real_template_come_back_structured_with_typed_arguments(
    real_server, family, template, dialect, stream
):
    if not (TEMPLATES / template).is_file():
        pytest.skip(f"{template} is not in {TEMPLATES}")
    server, ids, specs, cuts = real_server
    fam, stem, ask = specs[template], _stem(template), tf.ASK[dialect]

    for scenario, example in (("one", fam.one_call), ("two", fam.two_calls)):
        if example is None:
            continue
        answer = ask(server.url, ids[template], f"[case={stem}-{scenario}]", stream, 300)
        reasoning, text = _expected(fam, example)
        assert answer.calls == [(c["name"], c["arguments"]) for c in example.calls], answer
        assert len(set(answer.call_ids)) == len(example.calls) and all(answer.call_ids)
        assert answer.stop == tf.CALL_STOP[dialect]
        assert (answer.reasoning.strip(), answer.text.strip()) == (reasoning, text), answer
        tf._no_markup(answer)

    # Cut off by max_tokens inside the call: visible as text, never a 500 or a call.
    cut = ask(server.url, ids[template], f"[case={stem}-cut]", stream, cuts[template])
    assert cut.calls == [] and cut.stop == tf.LENGTH_STOP[dialect], cut
    assert cut.text.strip(), cut
