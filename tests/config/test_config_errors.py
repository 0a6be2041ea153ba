"""Config errors that point at the key and where it was set: file and line, env var, flag."""

from __future__ import annotations

import pytest

from proxy.config.loader import load_config
from proxy.config.schema import ConfigError
from tests.config.test_config import (
    no_user_config,  # noqa: F401 (autouse: the user's own config file stays out)
    write,
)


def test_unknown_key_names_key_and_line(tmp_path):
    path = write(
        tmp_path,
        """
        # comment
        [server]
        host = "127.0.0.1"
        prot = 1235
        """,
    )
    with pytest.raises(ConfigError) as err:
        load_config(path, {}, {})
    message = str(err.value)
    assert "server.prot" in message
    assert "unknown key" in message
    assert f"{path} line 4" in message


def test_unknown_table_names_table_and_line(tmp_path):
    path = write(tmp_path, "[server]\nport = 1\n\n[cache.disk]\nsize = 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, {}, {})
    assert "cache.disk" in str(err.value)
    assert f"{path} line 4" in str(err.value)


def test_wrong_type_names_key_and_line(tmp_path):
    path = write(
        tmp_path,
        """
        [server]
        host = "127.0.0.1"

        [cache.ram]
        quantize_bits = 0
        checkpoint_interval = "1024"
        """,
    )
    with pytest.raises(ConfigError) as err:
        load_config(path, {}, {})
    message = str(err.value)
    assert "cache.ram.checkpoint_interval" in message
    assert "expected an integer, got string '1024'" in message
    assert f"{path} line 6" in message


def test_wrong_type_in_dotted_key_and_array_of_tables(tmp_path):
    path = write(
        tmp_path,
        """
        [cache]
        ssd.enabled = "yes"
        """,
    )
    with pytest.raises(ConfigError, match=r"cache\.ssd\.enabled: expected a boolean.*line 2"):
        load_config(path, {}, {})
    path = write(
        tmp_path,
        """
        [[normalization.rules]]
        name = "one"
        pattern = "a"

        [[normalization.rules]]
        name = "two"
        pattern = "b"
        roles = "system"
        """,
    )
    with pytest.raises(ConfigError) as err:
        load_config(path, {}, {})
    assert "normalization.rules[1].roles" in str(err.value)
    assert "expected an array of strings" in str(err.value)
    assert f"{path} line 8" in str(err.value)


def test_key_inside_multiline_string_is_not_mistaken_for_a_key(tmp_path):
    path = write(
        tmp_path,
        '''
        [[normalization.rules]]
        name = "strip"
        pattern = """
        port = 1
        """
        roles = [
          "system",
          "nobody",
        ]
        ''',
    )
    with pytest.raises(ConfigError) as err:
        load_config(path, {}, {})
    assert "normalization.rules[0].roles: unknown role 'nobody'" in str(err.value)
    assert f"{path} line 6" in str(err.value)


def test_bool_is_not_an_int_and_int_widens_to_float(tmp_path):
    path = write(tmp_path, "[server]\nport = true\n")
    with pytest.raises(ConfigError, match="expected an integer, got boolean True"):
        load_config(path, {}, {})
    path = write(tmp_path, "[upstream]\ntimeout_s = 30\n")
    assert load_config(path, {}, {}).upstream.timeout_s == 30.0


@pytest.mark.parametrize(
    ("toml", "key", "fragment"),
    [
        ("[server]\nport = 70000", "server.port", "not in 0..65535"),
        ("[server]\nlog_level = 'loud'", "server.log_level", "must be one of"),
        ("[server]\nstream_keepalive = 'soon'", "server.stream_keepalive", "invalid duration"),
        ("[upstream]\nurl = 'localhost:1234'", "upstream.url", "not an http"),
        ("[cache.ram]\nbudget = 'lots'", "cache.ram.budget", "invalid size"),
        ("[cache.ram]\nbudget = '150%'", "cache.ram.budget", "percent must be in"),
        ("[cache.ram]\nquantize_bits = 6", "cache.ram.quantize_bits", "must be 0, 4 or 8"),
        ("[cache.ram]\nmin_available = '101%'", "cache.ram.min_available", "percent must be"),
        ("[cache.ram]\nmin_available = 'x'", "cache.ram.min_available", "invalid size"),
        ("[engine]\nmax_batch = 0", "engine.max_batch", "must be at least 1, got 0"),
        ("[engine]\nmax_queue = -1", "engine.max_queue", "must be 0 or more, got -1"),
        ("[engine]\nprefill_chunk = 8", "engine.prefill_chunk", "at least 16 tokens, got 8"),
        ("[engine]\nkv_memory = 'lots'", "engine.kv_memory", "invalid size"),
        ("[engine]\nkv_memory = '0%'", "engine.kv_memory", "percent must be in"),
        ("[engine]\nkv_memory = 0", "engine.kv_memory", "more than 0 bytes"),
        ("[engine]\nmax_batch = '8'", "engine.max_batch", "expected an integer"),
        ("[cache.ssd]\nmax_size = '10 parsecs'", "cache.ssd.max_size", "invalid size"),
        ("[cache.ssd]\nttl = 'forever'", "cache.ssd.ttl", "invalid duration"),
        ("[[normalization.rules]]\nname='x'\npattern='('", "rules[0].pattern", "invalid regex"),
        ("[[normalization.rules]]\nname = 'x'", "rules[0].pattern", "missing required key"),
    ],
)
def test_bad_values_name_key_and_line(tmp_path, toml, key, fragment):
    path = write(tmp_path, toml + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, {}, {})
    assert key in str(err.value)
    assert fragment in str(err.value)
    assert f"{path} line " in str(err.value)


def test_bad_toml_reports_tomllib_position(tmp_path):
    path = write(tmp_path, "[server]\nport = = 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, {}, {})
    assert str(err.value).startswith(f"invalid TOML in {path}: ")
    assert "line 2" in str(err.value)


def test_env_under_a_non_table_in_the_file_still_reports_the_file_error(tmp_path):
    path = write(tmp_path, "[server]\nport = 1\n\ncache = 5\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, {"MLX_PROMPT_CACHE_CACHE_SSD_DIR": "/x"}, {})
    assert "config key server.cache: unknown key" in str(err.value)
    path = write(tmp_path, "cache = 5\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, {"MLX_PROMPT_CACHE_CACHE_SSD_DIR": "/x"}, {})
    assert "config key cache: expected a table, got integer 5" in str(err.value)
    assert f"{path} line 1" in str(err.value)
