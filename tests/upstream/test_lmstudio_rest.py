"""The LM Studio REST client against a fake LM Studio speaking the documented shapes, and
how a model served here is matched to LM Studio's models."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from engine_bridge.models.loading import ModelRef
from proxy.upstream.lmstudio_rest import LmsModel, LmStudioError, LmStudioRest, UnloadRefused
from proxy.upstream.one_copy import same_model
from tests.support.fake_lmstudio import FakeLmStudio, FakeModel

TOKEN = "lms-test-token"


def _models() -> list[FakeModel]:
    return [
        FakeModel(
            "qwen/qwen3.6-35b-a3b",
            "qwen",
            20 << 30,
            ["qwen/qwen3.6-35b-a3b", "qwen/qwen3.6-35b-a3b:2"],
        ),
        FakeModel("gemma-3-270m-it-qat", "lmstudio-community", 241410208, format="gguf"),
        FakeModel(
            "text-embedding-nomic",
            "nomic-ai",
            274290560,
            ["text-embedding-nomic"],
            format="gguf",
            type="embedding",
        ),
    ]


async def _with(url: str, fn, token: str | None = TOKEN, **kw):
    async with LmStudioRest(url, token, **kw) as lms:
        return await fn(lms)


def test_v1_listing_reads_keys_loaded_instances_and_sizes_with_the_token():
    with FakeLmStudio(_models(), token=TOKEN) as fake:
        listing = asyncio.run(_with(fake.url, lambda lms: lms.models()))
    assert listing.api == "v1" and listing.can_unload
    assert listing.models[0] == LmsModel(
        key="qwen/qwen3.6-35b-a3b",
        publisher="qwen",
        type="llm",
        format="mlx",
        size_bytes=20 << 30,
        instances=("qwen/qwen3.6-35b-a3b", "qwen/qwen3.6-35b-a3b:2"),
    )
    assert listing.models[1].instances == () and listing.models[1].format == "gguf"
    assert [m.key for m in listing.loaded] == ["qwen/qwen3.6-35b-a3b", "text-embedding-nomic"]
    assert [(c.method, c.path, c.authorization) for c in fake.calls] == [
        ("GET", "/api/v1/models", f"Bearer {TOKEN}")
    ]


def test_unload_posts_the_instance_id_and_lm_studio_lets_it_go():
    with FakeLmStudio(_models(), token=TOKEN) as fake:
        asyncio.run(_with(fake.url, lambda lms: lms.unload("qwen/qwen3.6-35b-a3b:2")))
        assert fake.loaded_instances("qwen/qwen3.6-35b-a3b") == ["qwen/qwen3.6-35b-a3b"]
    call = fake.calls[-1]
    assert (call.method, call.path, call.body) == (
        "POST",
        "/api/v1/models/unload",
        {"instance_id": "qwen/qwen3.6-35b-a3b:2"},
    )
    assert call.authorization == f"Bearer {TOKEN}"


def test_a_refused_unload_raises_with_lm_studios_status_and_message():
    with FakeLmStudio(_models(), refuse_unload=True) as fake:
        with pytest.raises(UnloadRefused) as refused:
            asyncio.run(_with(fake.url, lambda lms: lms.unload("qwen/qwen3.6-35b-a3b")))
        assert fake.loaded_instances("qwen/qwen3.6-35b-a3b") == [
            "qwen/qwen3.6-35b-a3b",
            "qwen/qwen3.6-35b-a3b:2",
        ]
    assert refused.value.status == 403
    assert "unloading is not allowed right now" in str(refused.value)


def test_a_missing_token_is_refused_naming_the_setting():
    with FakeLmStudio(_models(), token=TOKEN) as fake:
        with pytest.raises(LmStudioError) as refused:
            asyncio.run(_with(fake.url, lambda lms: lms.models(), token=None))
    assert "HTTP 401" in str(refused.value)
    assert "[upstream] api_token" in str(refused.value)
    assert fake.calls[0].authorization is None


def test_an_lm_studio_without_v1_is_listed_through_v0_which_cannot_unload():
    with FakeLmStudio(_models(), v0_only=True) as fake:
        listing = asyncio.run(_with(fake.url, lambda lms: lms.models()))
    assert listing.api == "v0" and not listing.can_unload
    assert [c.path for c in fake.calls] == ["/api/v1/models", "/api/v0/models"]
    assert [(m.key, m.publisher, m.format, m.size_bytes, m.instances) for m in listing.models] == [
        ("qwen/qwen3.6-35b-a3b", "qwen", "mlx", None, ("qwen/qwen3.6-35b-a3b",)),
        ("gemma-3-270m-it-qat", "lmstudio-community", "gguf", None, ()),
        ("text-embedding-nomic", "nomic-ai", "gguf", None, ("text-embedding-nomic",)),
    ]


def test_an_unreachable_lm_studio_is_an_error_naming_the_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, never listening
        with pytest.raises(LmStudioError) as failed:
            asyncio.run(_with(url, lambda lms: lms.models()))
    assert str(failed.value).startswith(f"unreachable at {url} (")


def test_an_lm_studio_that_never_answers_times_out_within_the_bound():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)  # the kernel accepts the connection; nothing ever answers it
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        loop = asyncio.new_event_loop()
        try:
            started = loop.time()
            with pytest.raises(LmStudioError) as failed:
                loop.run_until_complete(_with(url, lambda lms: lms.models(), timeout_s=0.5))
            elapsed = loop.time() - started
        finally:
            loop.close()
    assert str(failed.value) == f"unreachable at {url} (timed out)"
    assert elapsed < 3.0


def _ref(path: str, model_id: str, is_demo: bool = False) -> ModelRef:
    return ModelRef(model_id, Path(path), is_demo)


def _lms(key: str, publisher: str | None) -> LmsModel:
    return LmsModel(key, publisher, "llm", "mlx", None, (key,))


def test_a_model_in_lm_studios_folder_matches_its_key_and_publisher_ignoring_case():
    ref = _ref("/u/.lmstudio/models/acme/Tiny-Llama-MLX", "acme/Tiny-Llama-MLX")
    assert same_model(ref, _lms("tiny-llama-mlx", "acme"))  # key without its publisher
    assert same_model(ref, _lms("ACME/tiny-llama-mlx", "acme"))  # key with it
    assert not same_model(ref, _lms("tiny-llama-mlx", "other-publisher"))
    assert not same_model(ref, _lms("acme/tiny-llama-mlx-8bit", "acme"))


def test_a_model_served_from_another_folder_matches_by_its_last_two_path_parts():
    ref = _ref("/Volumes/fast/models/qwen/qwen3.6-35b-a3b", "qwen3.6-35b-a3b")
    assert same_model(ref, _lms("qwen/qwen3.6-35b-a3b", "qwen"))
    # The same model directory name from another publisher is other weights.
    other = _ref("/srv/mlx-community/Qwen3-4B-4bit", "mlx-community/Qwen3-4B-4bit")
    assert not same_model(other, _lms("lmstudio-community/qwen3-4b-4bit", "lmstudio-community"))


def test_a_model_id_equal_to_an_lm_studio_key_matches():
    ref = _ref("/opt/weights/snapshot-1234", "qwen/qwen3.6-35b-a3b")
    assert same_model(ref, _lms("qwen/qwen3.6-35b-a3b", "qwen"))


def test_demo_models_never_match():
    ref = _ref("/cache/models/demo-llama", "demo-llama", is_demo=True)
    assert not same_model(ref, _lms("demo-llama", "models"))
    assert not same_model(ref, _lms("models/demo-llama", None))


def test_upstream_settings_are_checked_and_turn_the_hook_off():
    from proxy.config.loader import load_config
    from proxy.config.schema import ConfigError
    from proxy.upstream.one_copy import UnloadDuplicates
    from proxy.wiring import before_load_hook

    env = "MLX_PROMPT_CACHE_UPSTREAM_"
    config = load_config(None, {env + "API_TOKEN": "sk-lm-abc"}, {})
    assert config.upstream.api_token == "sk-lm-abc" and config.upstream.unload_duplicates
    assert isinstance(before_load_hook(config), UnloadDuplicates)
    off = load_config(None, {env + "UNLOAD_DUPLICATES": "false"}, {})
    assert before_load_hook(off) is None
    assert before_load_hook(load_config(None, {env + "ENABLED": "0"}, {})) is None
    with pytest.raises(ConfigError, match="upstream.unload_duplicates.*expected a boolean"):
        load_config(None, {env + "UNLOAD_DUPLICATES": "maybe"}, {})
    with pytest.raises(ConfigError, match="upstream.api_token: must be printable ASCII"):
        load_config(None, {env + "API_TOKEN": "two words"}, {})
