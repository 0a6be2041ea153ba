"""`[model."<pattern>"]`: which sections apply to a model, which key wins, and the errors
that stop the config load (proxy/config/model_settings.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.config.loader import config_to_toml, env_var_names, load_config
from proxy.config.model_settings import (
    ModelSettings,
    ModelSettingsTable,
    lmstudio_key,
    resolve,
)
from proxy.config.schema import ConfigError
from tests.config.test_config import (
    no_user_config,  # noqa: F401 (autouse: the user's own config file stays out)
    write,
)

QWEN = "lmstudio-community/Qwen3.6-35B-A3B-MLX-4bit"


def test_an_exact_name_beats_any_glob_and_a_longer_glob_a_shorter_one_key_by_key():
    sections = {
        QWEN: ModelSettings(temperature=0.6),  # exact, written first: still the most specific
        "*": ModelSettings(temperature=1.0, top_p=0.8, top_k=40, max_tokens=100),
        "lmstudio-community/*": ModelSettings(top_p=0.95, top_k=20),
        "*qwen3.6*": ModelSettings(top_k=30),  # longer than "*", shorter than the publisher's
    }
    assert resolve(sections, [QWEN]) == ModelSettings(
        temperature=0.6, top_p=0.95, top_k=20, max_tokens=100
    )
    assert resolve(sections, ["demo-llama"]) == ModelSettings(
        temperature=1.0, top_p=0.8, top_k=40, max_tokens=100
    )


def test_equal_globs_the_later_one_wins_and_no_match_gives_nothing_set():
    sections = {"demo-?????": ModelSettings(top_k=1), "demo-*swa": ModelSettings(top_k=2)}
    assert resolve(sections, ["demo-swa"]).top_k == 2
    assert resolve(sections, ["demo-llama"]).top_k == 1
    assert resolve(sections, ["other"]) == ModelSettings()
    # A pattern without glob characters names one model only.
    assert resolve({"demo": ModelSettings(top_k=3)}, ["demo-llama"]) == ModelSettings()


def test_matching_ignores_case_and_reads_the_lm_studio_key_too():
    sections = {"LMSTUDIO-COMMUNITY/qwen3.6-*": ModelSettings(min_p=0.05)}
    assert resolve(sections, [QWEN]).min_p == 0.05
    # A folder outside LM Studio's is served under its name; its key is publisher/name.
    table = ModelSettingsTable(sections, {"Qwen3.6-35B-A3B-MLX-4bit": QWEN})
    assert table.resolve("Qwen3.6-35B-A3B-MLX-4bit").min_p == 0.05
    assert ModelSettingsTable(sections).resolve("Qwen3.6-35B-A3B-MLX-4bit").min_p is None
    assert lmstudio_key(Path("/Users/me/models/lmstudio-community/Q")) == "lmstudio-community/Q"


def test_the_folder_name_alone_names_a_model_as_lm_studios_rest_key_does():
    # LM Studio's REST API lists `"key": "qwen3.6-35b-a3b-mlx-4bit"` beside its publisher.
    table = ModelSettingsTable({"qwen3.6-35b-a3b-mlx-4bit": ModelSettings(top_k=20)})
    assert table.resolve(QWEN).top_k == 20
    assert table.resolve("Qwen3.6-35B-A3B-MLX-4bit", QWEN).top_k == 20
    # Only the whole folder name: a part of it names nothing.
    assert ModelSettingsTable({"qwen3.6": ModelSettings(top_k=20)}).resolve(QWEN).top_k is None
    # The publisher alone is no model's name either.
    assert ModelSettingsTable({"lmstudio-community": ModelSettings(top_k=1)}).resolve(QWEN) == (
        ModelSettings()
    )


def test_template_kwargs_merge_kwarg_by_kwarg_and_show_over_the_engines_defaults():
    sections = {
        "*": ModelSettings(chat_template_kwargs={"enable_thinking": False, "x": 1}),
        "demo-hybrid": ModelSettings(temperature=0.0, chat_template_kwargs={"x": 2}),
    }
    settings = resolve(sections, ["demo-hybrid"])
    assert settings.chat_template_kwargs == {"enable_thinking": False, "x": 2}
    defaults = {"preserve_thinking": True, "x": 0}
    assert settings.effective(defaults) == {
        "temperature": 0.0,
        "chat_template_kwargs": {"preserve_thinking": True, "x": 2, "enable_thinking": False},
    }
    assert ModelSettings().effective({}) == {}


def test_sections_load_from_the_file_and_print_config_reads_them_back(tmp_path):
    path = write(
        tmp_path,
        f"""
        [model."{QWEN}"]
        temperature = 0.6
        top_p = 0.95
        top_k = 20
        min_p = 0
        repetition_penalty = 1
        max_tokens = 8192
        chat_template_kwargs = {{ preserve_thinking = true, extra = {{ a = [1, "b"] }} }}

        [model."demo-*"]
        temperature = 0
        """,
    )
    config = load_config(path, {}, {})
    assert config.model == {
        QWEN: ModelSettings(0.6, 0.95, 20, 0.0, 1.0, 8192, {"preserve_thinking": True,
                                                            "extra": {"a": [1, "b"]}}),
        "demo-*": ModelSettings(temperature=0.0),
    }  # fmt: skip
    text = config_to_toml(config)
    assert '\n[model."demo-*"]\ntemperature = 0.0\n' in text  # only the keys set
    assert load_config(write(tmp_path, text), {}, {}) == config


def test_sections_are_file_only_no_environment_variable_sets_them(caplog):
    assert not [key for key in env_var_names().values() if key.split(".")[0] == "model"]
    assert load_config(None, {"MLX_PROMPT_CACHE_MODEL": "temperature=0"}, {}).model == {}
    assert any("MLX_PROMPT_CACHE_MODEL" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "line,key,fragment",
    [
        ("temprature = 0.6", "temprature", "unknown key (known keys here: temperature, top_p"),
        ("temperature = -0.1", "temperature", "must be 0 or more, got -0.1"),
        ("temperature = nan", "temperature", "must be 0 or more, got nan"),
        ("top_p = 0", "top_p", "must be more than 0 and at most 1, got 0.0"),
        ("top_p = 1.5", "top_p", "must be more than 0 and at most 1, got 1.5"),
        ("top_k = -1", "top_k", "must be 0 (off) or more, got -1"),
        ("top_k = 2.5", "top_k", "expected an integer, got number 2.5"),
        ("min_p = 1.01", "min_p", "must be from 0 to 1, got 1.01"),
        ("repetition_penalty = 0", "repetition_penalty", "must be more than 0, got 0.0"),
        ("max_tokens = 0", "max_tokens", "must be at least 1, got 0"),
        ("temperature = 'low'", "temperature", "expected a number, got string 'low'"),
        ("chat_template_kwargs = 1", "chat_template_kwargs", "expected a table, got integer 1"),
    ],
)
def test_a_bad_key_or_value_stops_the_load_naming_the_key_and_its_line(
    tmp_path, line, key, fragment
):
    path = write(tmp_path, f'[server]\nport = 1235\n\n[model."demo-*"]\n# sampling\n{line}\n')
    with pytest.raises(ConfigError) as err:
        load_config(path, {}, {})
    message = str(err.value)
    assert message.startswith(f'config key model."demo-*".{key}: ')
    assert fragment in message
    assert message.endswith(f"(at {path} line 6)")


def test_a_section_that_is_not_a_table_names_its_line(tmp_path):
    path = write(tmp_path, '[server]\nport = 1235\n[model]\n"demo-llama" = 0.5\n')
    with pytest.raises(ConfigError) as err:
        load_config(path, {}, {})
    assert str(err.value) == (
        f"config key model.demo-llama: expected a table, got number 0.5 (at {path} line 4)"
    )
