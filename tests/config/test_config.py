"""Config: defaults, file < env < flags precedence, print-config, the example file, exposure.

Errors that name the key and its line are test_config_errors.py's; sizes and durations
(proxy/config/units.py) are test_units.py's.
"""

from __future__ import annotations

import re
import textwrap
import tomllib
from pathlib import Path

import pytest

from proxy.config import loader as config_module
from proxy.config.loader import config_to_toml, env_var_names, load_config
from proxy.config.model import Config, Rule
from proxy.config.model_settings import ModelSettings
from proxy.config.schema import ConfigError
from proxy.config.tomltext import key_lines

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


@pytest.fixture(autouse=True)
def no_user_config(tmp_path, monkeypatch):
    # The developer's own ~/.config/mlx-prompt-cache/config.toml must not leak into tests.
    monkeypatch.setattr(config_module, "DEFAULT_CONFIG_PATH", tmp_path / "absent" / "c.toml")


def test_defaults():
    c = load_config(None, {}, {})
    assert c == Config()
    assert (c.server.host, c.server.port) == ("127.0.0.1", 1235)
    assert c.server.max_body_bytes == 32 * 1024 * 1024
    assert (c.server.log_level, c.server.log_json) == ("info", False)
    assert c.upstream.url == "http://127.0.0.1:1234"
    assert (c.upstream.enabled, c.upstream.timeout_s, c.upstream.connect_timeout_s) == (
        True,
        600.0,
        2.0,
    )
    assert c.models.serve == []
    assert c.models.serve_all_mlx is False
    assert c.models.lmstudio_dirs == ["~/.lmstudio/models", "~/.cache/lm-studio/models"]
    assert c.models.idle_unload_s is None
    e = c.engine
    assert (e.max_batch, e.max_queue, e.prefill_chunk, e.kv_memory) == (8, 64, 512, None)
    assert (c.cache.enabled, c.cache.block_size) == (True, 64)
    assert (c.cache.ram.budget, c.cache.ram.quantize_bits, c.cache.ram.checkpoint_interval) == (
        "20%",
        0,
        1024,
    )
    ssd = c.cache.ssd
    assert (ssd.enabled, ssd.dir, ssd.max_size, ssd.ttl) == (
        True,
        "~/.cache/mlx-prompt-cache",
        "10GB",
        None,
    )
    assert (ssd.write_policy, ssd.write_through, ssd.queue_size) == (None, None, 256)
    assert ssd.path == Path.home() / ".cache" / "mlx-prompt-cache"
    assert (c.tenants.header, c.tenants.api_keys, c.tenants.default) == ("x-tenant", {}, "local")
    n = c.normalization
    assert (n.claude_code_billing_header, n.rules, n.log_divergence) == (True, [], True)


def test_dataclasses_have_slots():
    with pytest.raises(AttributeError):
        Config().server.prot = 1  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------
# Precedence


def test_file_overrides_defaults(tmp_path):
    path = write(
        tmp_path,
        """
        [server]
        port = 2000
        [upstream]
        url = "http://10.0.0.2:1234"
        [models]
        serve = ["demo-llama", "demo-hybrid"]
        [cache.ram]
        budget = "8GB"
        [cache.ssd]
        dir = "/tmp/pc"
        max_size = "1GiB"
        ttl = "7d"
        [tenants.api_keys]
        "sk-alice" = "alice"
        [[normalization.rules]]
        name = "date"
        pattern = "Today is \\\\d+"
        """,
    )
    c = load_config(path, {}, {})
    assert c.server.port == 2000
    assert c.server.host == "127.0.0.1"  # untouched keys keep their defaults
    assert c.upstream.url == "http://10.0.0.2:1234"
    assert c.models.serve == ["demo-llama", "demo-hybrid"]
    assert c.cache.ram.budget == "8GB"
    assert (c.cache.ssd.dir, c.cache.ssd.max_size, c.cache.ssd.ttl) == ("/tmp/pc", "1GiB", "7d")
    assert c.tenants.api_keys == {"sk-alice": "alice"}
    assert c.normalization.rules == [Rule(name="date", pattern="Today is \\d+")]
    assert c.normalization.rules[0].roles == ["system"]


def test_env_overrides_file(tmp_path):
    path = write(tmp_path, "[server]\nport = 2000\nhost = '0.0.0.0'\n")
    env = {
        "MLX_PROMPT_CACHE_SERVER_PORT": "3000",
        "MLX_PROMPT_CACHE_UPSTREAM_URL": "http://lmstudio.local:1234",
        "MLX_PROMPT_CACHE_CACHE_SSD_DIR": "/Volumes/fast/cache",
        "MLX_PROMPT_CACHE_MODELS_SERVE": "demo-llama, demo-swa",
        "PATH": "/usr/bin",  # no prefix: not ours
    }
    c = load_config(path, env, {})
    assert c.server.port == 3000
    assert c.server.host == "0.0.0.0"  # env did not set it: the file wins over the default
    assert c.upstream.url == "http://lmstudio.local:1234"
    assert c.cache.ssd.dir == "/Volumes/fast/cache"
    assert c.models.serve == ["demo-llama", "demo-swa"]


def test_flags_override_env_and_file(tmp_path):
    path = write(tmp_path, "[server]\nport = 2000\n[cache]\nenabled = true\n")
    env = {"MLX_PROMPT_CACHE_SERVER_PORT": "3000", "MLX_PROMPT_CACHE_CACHE_SSD_DIR": "/env"}
    overrides = {
        "server.port": 4000,
        "cache.ssd.dir": "/flag",
        "models.serve": ["/models/qwen"],
        "cache.enabled": False,
        "upstream.url": None,  # an argparse flag that was not given changes nothing
    }
    c = load_config(path, env, overrides)
    assert c.server.port == 4000
    assert c.cache.ssd.dir == "/flag"
    assert c.models.serve == ["/models/qwen"]
    assert c.cache.enabled is False
    assert c.upstream.url == "http://127.0.0.1:1234"


def test_serve_max_batch_flag_sets_engine_max_batch():
    from proxy.cli import _overrides, build_parser

    args = build_parser().parse_args(["serve", "--max-batch", "3"])
    assert load_config(None, {}, _overrides(args)).engine.max_batch == 3
    args = build_parser().parse_args(["serve", "--max-batch", "0"])
    with pytest.raises(ConfigError, match="engine.max_batch: must be at least 1"):
        load_config(None, {}, _overrides(args))


def test_override_paths_become_strings():
    c = load_config(None, {}, {"cache.ssd.dir": Path("/tmp/cache-dir")})
    assert c.cache.ssd.dir == "/tmp/cache-dir"


def test_override_strings_are_parsed_to_the_field_type():
    c = load_config(None, {}, {"server.port": "4001", "server.log_json": "true"})
    assert (c.server.port, c.server.log_json) == (4001, True)


def test_unknown_override_key_is_an_error():
    with pytest.raises(ConfigError, match="server.prot"):
        load_config(None, {}, {"server.prot": 1})


def test_default_file_is_used_when_present(tmp_path, monkeypatch):
    default = write(tmp_path, "[server]\nport = 1999\n")
    monkeypatch.setattr(config_module, "DEFAULT_CONFIG_PATH", default)
    assert load_config(None, {}, {}).server.port == 1999


def test_missing_default_file_means_defaults():
    assert load_config(None, {}, {}) == Config()


def test_explicit_missing_file_is_an_error(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=f"config file {missing} does not exist"):
        load_config(missing, {}, {})


# ---------------------------------------------------------------------------------------
# Environment parsing


def test_env_parsing_of_every_kind():
    env = {
        "MLX_PROMPT_CACHE_SERVER_LOG_JSON": "yes",
        "MLX_PROMPT_CACHE_UPSTREAM_ENABLED": "0",
        "MLX_PROMPT_CACHE_UPSTREAM_TIMEOUT_S": "30",
        "MLX_PROMPT_CACHE_MODELS_IDLE_UNLOAD_S": "900.5",
        "MLX_PROMPT_CACHE_MODELS_LMSTUDIO_DIRS": "/a,/b,",
        "MLX_PROMPT_CACHE_CACHE_RAM_BUDGET": "512MiB",
        "MLX_PROMPT_CACHE_CACHE_RAM_QUANTIZE_BITS": "8",
        "MLX_PROMPT_CACHE_CACHE_SSD_TTL": "12h",
        "MLX_PROMPT_CACHE_TENANTS_API_KEYS": "sk-a=alice, sk-b=bob",
    }
    c = load_config(None, env, {})
    assert c.server.log_json is True
    assert c.upstream.enabled is False
    assert c.upstream.timeout_s == 30.0
    assert c.models.idle_unload_s == 900.5
    assert c.models.lmstudio_dirs == ["/a", "/b"]
    assert c.cache.ram.budget == "512MiB"
    assert c.cache.ram.quantize_bits == 8
    assert c.cache.ssd.ttl == "12h"
    assert c.tenants.api_keys == {"sk-a": "alice", "sk-b": "bob"}


def test_env_empty_clears_an_optional_value(tmp_path):
    path = write(tmp_path, "[models]\nidle_unload_s = 60\n")
    c = load_config(path, {"MLX_PROMPT_CACHE_MODELS_IDLE_UNLOAD_S": ""}, {})
    assert c.models.idle_unload_s is None


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("MLX_PROMPT_CACHE_SERVER_PORT", "12x", "expected an integer, got '12x'"),
        ("MLX_PROMPT_CACHE_SERVER_LOG_JSON", "maybe", "expected a boolean"),
        ("MLX_PROMPT_CACHE_UPSTREAM_TIMEOUT_S", "soon", "expected a number"),
        ("MLX_PROMPT_CACHE_TENANTS_API_KEYS", "sk-a", "expected key=value pairs"),
    ],
)
def test_env_bad_value_names_the_variable(name, value, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, {name: value}, {})
    assert str(err.value).startswith(f"environment variable {name} (")
    assert expected in str(err.value)


def test_env_value_failing_validation_names_the_variable():
    with pytest.raises(ConfigError) as err:
        load_config(None, {"MLX_PROMPT_CACHE_SERVER_PORT": "70000"}, {})
    assert "server.port" in str(err.value)
    assert "environment variable MLX_PROMPT_CACHE_SERVER_PORT" in str(err.value)


def test_env_var_names_cover_fixed_design_keys():
    names = env_var_names()
    assert names["MLX_PROMPT_CACHE_SERVER_HOST"] == "server.host"
    assert names["MLX_PROMPT_CACHE_SERVER_PORT"] == "server.port"
    assert names["MLX_PROMPT_CACHE_UPSTREAM_URL"] == "upstream.url"
    assert names["MLX_PROMPT_CACHE_MODELS_SERVE"] == "models.serve"
    assert names["MLX_PROMPT_CACHE_CACHE_RAM_BUDGET"] == "cache.ram.budget"
    assert names["MLX_PROMPT_CACHE_CACHE_SSD_DIR"] == "cache.ssd.dir"
    assert names["MLX_PROMPT_CACHE_CACHE_SSD_MAX_SIZE"] == "cache.ssd.max_size"
    assert names["MLX_PROMPT_CACHE_ENGINE_MAX_BATCH"] == "engine.max_batch"
    assert names["MLX_PROMPT_CACHE_ENGINE_MAX_QUEUE"] == "engine.max_queue"
    assert names["MLX_PROMPT_CACHE_ENGINE_PREFILL_CHUNK"] == "engine.prefill_chunk"
    assert names["MLX_PROMPT_CACHE_ENGINE_KV_MEMORY"] == "engine.kv_memory"
    assert "normalization.rules" not in names.values()


def test_unknown_prefixed_env_var_is_ignored_with_a_warning(caplog):
    c = load_config(None, {"MLX_PROMPT_CACHE_SERVER_PROT": "1", "MLX_PROMPT_CACHE_URL": "x"}, {})
    assert c == Config()
    warned = [r.getMessage() for r in caplog.records]
    assert any("MLX_PROMPT_CACHE_SERVER_PROT" in m for m in warned)
    assert not any("MLX_PROMPT_CACHE_URL" in m for m in warned)  # the menu bar plugin's


# ---------------------------------------------------------------------------------------
# print-config round trip and the example file


def test_print_config_round_trips_defaults(tmp_path):
    text = config_to_toml(Config())
    tomllib.loads(text)
    assert load_config(write(tmp_path, text), {}, {}) == Config()


def test_print_config_round_trips_everything_set(tmp_path):
    path = write(
        tmp_path,
        r"""
        [server]
        host = "0.0.0.0"
        port = 8080
        log_json = true
        [upstream]
        timeout_s = 1e3
        [models]
        serve = ["demo-llama", "/Users/me/models/qwen \"quoted\""]
        idle_unload_s = 600
        [engine]
        max_batch = 2
        max_queue = 0
        kv_memory = "30%"
        [cache.ram]
        budget = 8000000000
        quantize_bits = 4
        [cache.ssd]
        ttl = 3600
        max_size = "512MiB"
        [tenants.api_keys]
        "sk-a" = "alice"
        "key with spaces.and.dots" = "bob"
        [[normalization.rules]]
        name = "date"
        pattern = '\d{4}-\d{2}-\d{2}'
        replacement = "<date>\t\u00e9"
        roles = ["system", "user"]
        [[normalization.rules]]
        name = "cwd"
        pattern = "cwd: .*"
        """,
    )
    config = load_config(path, {"MLX_PROMPT_CACHE_CACHE_SSD_DIR": "/env/dir"}, {})
    text = config_to_toml(config)
    again = load_config(write(tmp_path, text), {}, {})
    assert again == config
    assert again.cache.ssd.dir == "/env/dir"  # the effective config, not just the file
    assert again.cache.ram.budget == 8000000000
    assert (again.engine.max_batch, again.engine.max_queue, again.engine.kv_memory) == (2, 0, "30%")
    assert again.tenants.api_keys["key with spaces.and.dots"] == "bob"
    assert again.normalization.rules[0].replacement == "<date>\té"


def uncomment_settings(text: str) -> str:
    """The example with its commented-out optional settings ("# key = ...") switched on."""
    setting = re.compile(r"^# (\[|[A-Za-z_\"][\w\-\" ]*= )")
    return "\n".join(line[2:] if setting.match(line) else line for line in text.splitlines())


def test_example_file_equals_defaults_and_covers_every_key():
    example = REPO / "config.example.toml"
    assert load_config(example, {}, {}) == Config()
    keys = key_lines(uncomment_settings(example.read_text()))
    expected = [tuple(dotted.split(".")) for dotted in env_var_names().values()]
    expected += [("normalization", "rules", 0, name) for name in Rule.__dataclass_fields__]
    qwen = "lmstudio-community/Qwen3.6-35B-A3B-MLX-4bit"
    expected += [("model", qwen, name) for name in ModelSettings.__dataclass_fields__]
    missing = [path for path in expected if path not in keys]
    assert missing == []


def test_example_file_optional_settings_are_valid_when_uncommented(tmp_path):
    text = (REPO / "config.example.toml").read_text()
    setting = re.compile(r"^# (\[|[A-Za-z_\"][\w\-\" ]*= )")
    uncommented = "\n".join(line[2:] if setting.match(line) else line for line in text.splitlines())
    config = load_config(write(tmp_path, uncommented), {}, {})
    assert config.models.idle_unload_s == 1800.0
    assert config.cache.ssd.ttl == "7d"
    assert config.tenants.api_keys == {"sk-local-alice": "alice", "sk-local-bob": "bob"}
    assert config.normalization.rules == [
        Rule(
            name="session-date",
            pattern=r"Today's date is \d{4}-\d{2}-\d{2}\.",
            replacement="Today's date is <date>.",
            roles=["system"],
        )
    ]
    rule = re.compile(config.normalization.rules[0].pattern)
    assert rule.sub("X", "Today's date is 2026-11-29.") == "X"
    assert config.model["demo-*"] == ModelSettings(temperature=0.0)


# ---------------------------------------------------------------------------------------
# Browser safety keys and exposure


def test_browser_safety_keys_default_off_and_read_from_file_and_env(tmp_path):
    c = load_config(None, {}, {})
    assert (c.server.allowed_hosts, c.server.cors_origins, c.server.insecure) == ([], [], False)
    path = write(
        tmp_path,
        """
        [server]
        allowed_hosts = ["mymac.local", "[fe80::1]:1235", "*"]
        cors_origins = ["http://localhost:3000", "*"]
        """,
    )
    c = load_config(path, {}, {})
    assert c.server.allowed_hosts == ["mymac.local", "[fe80::1]:1235", "*"]
    assert c.server.cors_origins == ["http://localhost:3000", "*"]
    env = {
        "MLX_PROMPT_CACHE_SERVER_ALLOWED_HOSTS": "box.lan, 10.0.0.2:8080",
        "MLX_PROMPT_CACHE_SERVER_CORS_ORIGINS": "https://app.example",
        "MLX_PROMPT_CACHE_SERVER_INSECURE": "yes",
    }
    c = load_config(None, env, {})
    assert c.server.allowed_hosts == ["box.lan", "10.0.0.2:8080"]
    assert (c.server.cors_origins, c.server.insecure) == (["https://app.example"], True)


@pytest.mark.parametrize(
    "toml,key,fragment",
    [
        ("allowed_hosts = ['ok', 'bad host']", "server.allowed_hosts[1]", "'bad host'"),
        ("allowed_hosts = ['box:99999']", "server.allowed_hosts[0]", "1..65535"),
        ("allowed_hosts = ['http://box']", "server.allowed_hosts[0]", "not a host name"),
        ("cors_origins = ['localhost:3000']", "server.cors_origins[0]", "scheme://host"),
        ("cors_origins = ['http://a.example/app']", "server.cors_origins[0]", "no path"),
        ("cors_origins = ['null']", "server.cors_origins[0]", "is not an origin"),
        ("allowed_hosts = 'box'", "server.allowed_hosts", "expected an array of strings"),
    ],
)
def test_bad_browser_safety_entries_name_key_and_entry(tmp_path, toml, key, fragment):
    path = write(tmp_path, "[server]\n" + toml + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, {}, {})
    assert key in str(err.value)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "host,keys,insecure,refused",
    [
        ("127.0.0.1", {}, False, False),
        ("localhost", {}, False, False),
        ("::1", {}, False, False),
        ("0.0.0.0", {}, False, True),
        ("::", {}, False, True),
        ("192.168.1.20", {}, False, True),
        ("mymac.local", {}, False, True),
        ("0.0.0.0", {"sk-a": "alice"}, False, False),
        ("0.0.0.0", {}, True, False),
    ],
)
def test_non_loopback_host_needs_api_keys_or_insecure(host, keys, insecure, refused):
    from proxy.config.loader import check_exposure

    config = Config()
    config.server.host = host
    config.server.insecure = insecure
    config.tenants.api_keys = keys
    if not refused:
        check_exposure(config)
        return
    with pytest.raises(ConfigError) as err:
        check_exposure(config)
    assert f"server.host {host!r} is not a loopback address" in str(err.value)
    assert "[tenants] api_keys" in str(err.value) and "--insecure" in str(err.value)


def test_serve_insecure_flag_sets_server_insecure():
    from proxy.cli import _overrides, build_parser

    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--insecure"])
    c = load_config(None, {}, _overrides(args))
    assert (c.server.host, c.server.insecure) == ("0.0.0.0", True)
    args = build_parser().parse_args(["serve"])
    assert load_config(None, {}, _overrides(args)).server.insecure is False


@pytest.mark.parametrize(
    ("toml", "env", "expected"),
    [
        ("", {}, 0.5),  # "auto" with [autotune] on, the default: the middle, as ARC starts
        ("[autotune]\nenabled = false\n", {}, 0.0),  # "auto" with it off: plain LRU
        ("[cache.ram]\nprotect_frequent = 0.2\n", {}, 0.2),
        ("", {"MLX_PROMPT_CACHE_CACHE_RAM_PROTECT_FREQUENT": "0.3"}, 0.3),
    ],
)
def test_protect_frequent_auto_starts_tuning_in_the_middle_and_is_lru_without_it(
    tmp_path, toml, env, expected
):
    from proxy.wiring import engine_settings

    c = load_config(write(tmp_path, toml), env, {})
    assert engine_settings(c).ram_protect_frequent == expected


@pytest.mark.parametrize("value", ['"often"', "0.95", "-0.1"])
def test_a_bad_protect_frequent_names_the_key(tmp_path, value):
    with pytest.raises(ConfigError, match=r"cache\.ram\.protect_frequent.*must be \"auto\" or 0"):
        load_config(write(tmp_path, f"[cache.ram]\nprotect_frequent = {value}\n"), {}, {})
