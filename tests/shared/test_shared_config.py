"""[cache.shared]: off without a url, each key checked with an error naming it, the
password from the environment, and the engine's settings built from the section."""

from __future__ import annotations

import pytest

from engine_bridge.cache.shared.config import SharedWritePolicy
from proxy.config.loader import load_config
from proxy.config.model import Config
from proxy.config.schema import ConfigError
from proxy.config.shared import shared_settings


def load(tmp_path, text: str, env: dict | None = None) -> Config:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return load_config(path, env or {}, {})


def test_the_tier_is_off_without_a_url():
    assert Config().cache.shared.url is None
    assert shared_settings(Config().cache.shared) is None


def test_the_section_becomes_the_engines_settings_with_the_password_from_env(tmp_path):
    config = load(
        tmp_path,
        '[cache.shared]\nurl = "rediss://cache.lan:6380/1"\nnamespace = "team-a"\n'
        'timeout = 0.25\nwrite_policy = "first-n"\nfirst_n = 8\nttl = "12h"\n'
        'username = "mlx"\ntls_ca = "/etc/ca.pem"\nqueue_max = "64MB"\n',
        {"MLX_PROMPT_CACHE_CACHE_SHARED_PASSWORD": "from-env"},
    )
    s = shared_settings(config.cache.shared)
    assert (s.url, s.namespace, s.timeout_s, s.first_n, s.ttl_s) == (
        "rediss://cache.lan:6380/1", "team-a", 0.25, 8, 43200.0,
    )  # fmt: skip
    assert (s.write_policy, s.username, s.password) == (
        SharedWritePolicy.FIRST_N,
        "mlx",
        "from-env",
    )
    assert (s.tls_ca, s.tls_verify, s.queue_max_bytes) == ("/etc/ca.pem", True, 64_000_000)
    assert "from-env" not in repr(s)
    with_url = shared_settings(
        load(tmp_path, '[cache.shared]\nurl = "redis://:pw-in-url@h:6379/0"\n').cache.shared
    )
    assert "pw-in-url" not in repr(with_url) and "***" in repr(with_url)


@pytest.mark.parametrize(
    ("lines", "key", "says"),
    [
        ('url = "http://cache.lan:6379"', "cache.shared.url", "not redis://"),
        ('url = "redis://x"\nwrite_policy = "some"', "cache.shared.write_policy", "'second-use'"),
        ('url = "redis://x"\ntimeout = "0s"', "cache.shared.timeout", "more than 0"),
        ('url = "redis://x"\ntimeout = "soon"', "cache.shared.timeout", ""),
        ('url = "redis://x"\nfirst_n = 0', "cache.shared.first_n", "at least 1"),
        ('url = "redis://x"\nttl = "0.5s"', "cache.shared.ttl", "at least 1 second"),
        ('url = "redis://x"\ntls_ca = "/ca.pem"', "cache.shared.url", "rediss://"),
        ('url = "rediss://x"\ntls_key = "/k.pem"', "cache.shared.tls_key", "tls_cert"),
        ('url = "redis://x"\nnamespace = "a:b"', "cache.shared.namespace", "no ':'"),
        ('url = "redis://x"\nqueue_max = "lots"', "cache.shared.queue_max", ""),
    ],
)
def test_each_bad_value_is_refused_naming_its_key(tmp_path, lines, key, says):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, f"[cache.shared]\n{lines}\n")
    assert key in str(e.value) and says in str(e.value)
