"""[engine] and [cache.ram] keys that size the scheduler and guard memory reach EngineSettings."""

from __future__ import annotations

import psutil

from proxy.config.loader import load_config
from proxy.config.model import Config
from proxy.wiring import engine_settings
from tests.config.test_config import write


def test_engine_keys_from_file_env_and_flag_reach_engine_settings(tmp_path):
    path = write(tmp_path, "[engine]\nmax_batch = 2\nmax_queue = 5\nkv_memory = '4GB'\n")
    env = {"MLX_PROMPT_CACHE_ENGINE_MAX_QUEUE": "0", "MLX_PROMPT_CACHE_ENGINE_PREFILL_CHUNK": "64"}
    c = load_config(path, env, {"engine.max_batch": 3})
    assert (c.engine.max_batch, c.engine.max_queue, c.engine.prefill_chunk) == (3, 0, 64)
    s = engine_settings(c)
    assert (s.max_batch, s.max_queue, s.prefill_chunk) == (3, 0, 64)
    assert s.kv_memory_bytes == 4 * 10**9
    assert engine_settings(Config()).kv_memory_bytes is None  # the engine picks its own
    share = engine_settings(load_config(None, {"MLX_PROMPT_CACHE_ENGINE_KV_MEMORY": "25%"}, {}))
    assert share.kv_memory_bytes == psutil.virtual_memory().total // 4
    cleared = load_config(path, {"MLX_PROMPT_CACHE_ENGINE_KV_MEMORY": ""}, {})
    assert cleared.engine.kv_memory is None


def test_memory_pressure_floor_from_config_reaches_engine_settings(tmp_path):
    total = psutil.virtual_memory().total
    assert engine_settings(Config()).ram_min_available_bytes == total * 5 // 100
    path = write(tmp_path, "[cache.ram]\nmin_available = '2GB'\n")
    assert engine_settings(load_config(path, {}, {})).ram_min_available_bytes == 2 * 10**9
    off = load_config(path, {"MLX_PROMPT_CACHE_CACHE_RAM_MIN_AVAILABLE": "off"}, {})
    assert engine_settings(off).ram_min_available_bytes is None


def test_speculative_keys_reach_the_scheduler_and_bad_ones_name_the_key(tmp_path):
    from engine_bridge.scheduling.speculation.control import Mode
    from proxy.config.schema import ConfigError

    assert engine_settings(Config()).speculation.mode is Mode.AUTO
    path = write(tmp_path, "[engine]\nspeculative = 'off'\nspeculative_max_draft = 4\n"
                 "speculative_mtp_depth = 2\n")  # fmt: skip
    s = engine_settings(load_config(path, {}, {})).speculation
    assert (s.mode, s.min_draft, s.max_draft, s.mtp_depth) == (Mode.OFF, 1, 4, 2)
    assert engine_settings(Config()).speculation.mtp_depth == 1
    env = {"MLX_PROMPT_CACHE_ENGINE_SPECULATIVE": "prompt-lookup"}
    assert engine_settings(load_config(None, env, {})).speculation.mode is Mode.PROMPT_LOOKUP
    for text, key in [
        ("speculative = 'fast'", "engine.speculative"),
        ("speculative_min_draft = 9\nspeculative_max_draft = 4", "engine.speculative_min_draft"),
        ("speculative_mtp_depth = 0", "engine.speculative_mtp_depth"),
    ]:
        try:
            load_config(write(tmp_path, f"[engine]\n{text}\n"), {}, {})
        except ConfigError as e:
            assert key in str(e)
        else:
            raise AssertionError(f"{text!r} was accepted")


def test_the_memory_preflight_can_be_turned_off(tmp_path):
    assert engine_settings(Config()).memory_preflight is True
    off = load_config(None, {"MLX_PROMPT_CACHE_ENGINE_MEMORY_PREFLIGHT": "false"}, {})
    assert engine_settings(off).memory_preflight is False
