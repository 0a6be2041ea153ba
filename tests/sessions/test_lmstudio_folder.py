"""Our user's model as LM Studio keeps it, through the real code paths.

demo-qwen36-4bit (Qwen3.6-35B-A3B's shape at toy size: qwen3_5_moe in a nested config,
experts, an MTP head, the real 248k vocabulary) is laid out as
`~/.lmstudio/models/lmstudio-community/Qwen3.6-35B-A3B-MLX-4bit/` under a temporary HOME:
its config and tokenizer files, and its weights in two shards with the
`model.safetensors.index.json` mlx-lm writes beside them. Then discovery, a real server
(`/v1/models`, `/api/v0/models`, the official `openai` SDK), `doctor --json`, the one-copy
unload of LM Studio's instance and the memory preflight each find it by its LM Studio key.
LM Studio itself is tests/support/fake_lmstudio.py, answering its documented REST shapes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import mlx.core as mx
import openai
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load as mlx_load

from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.kv import CacheKind
from engine_bridge.models import mtp_head as mtp
from engine_bridge.models.demo import ensure_demo_model
from engine_bridge.models.discovery import DEFAULT_LMSTUDIO_DIRS, scan
from engine_bridge.models.loading import ModelRef, resolve
from engine_bridge.models.preflight import Machine, RamReading
from engine_bridge.types import EngineError
from proxy.upstream.lmstudio_rest import LmStudioRest
from proxy.upstream.one_copy import held_copies
from tests.conftest import REPO, Server, start_server
from tests.support.fake_lmstudio import FakeLmStudio, FakeModel
from tests.support.prose import prose

GB = 1 << 30
KEY = "lmstudio-community/Qwen3.6-35B-A3B-MLX-4bit"  # our id: the folder under LM Studio's dir
LMS_KEY = "qwen3.6-35b-a3b-mlx-4bit"  # LM Studio's v1 key for it, beside its publisher
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"
# What an lmstudio-community MLX download holds besides its weights (README aside).
COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


@dataclass(frozen=True, slots=True)
class LmStudioHome:
    home: Path  # HOME for LM Studio's default folder, ~/.lmstudio/models
    models: Path
    folder: Path  # the model's folder, `models / KEY`
    built: Path  # demo-qwen36-4bit as built, one model.safetensors

    @property
    def shards_bytes(self) -> int:
        return sum((self.folder / s).stat().st_size for s in SHARDS)

    def ref(self) -> ModelRef:
        return resolve(KEY, self.home / "cache", [self.models])


def _write_shards(weights_file: Path, folder: Path) -> None:
    """The weights as mlx-lm's `save_model` writes a model past its shard size: tensors in
    order into `model-0000i-of-0000n.safetensors` while they fit under the cap (its
    `make_shards`, here with a cap in bytes where its own takes whole GB), and the index
    that names each tensor's shard."""
    weights = mx.load(str(weights_file))
    total = sum(v.nbytes for v in weights.values())
    cap = total // 2 + (2 << 20)  # two shards of the 20 MB
    shards: list[dict[str, mx.array]] = []
    size = 0
    for name, value in weights.items():
        if not shards or size + value.nbytes > cap:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    assert len(shards) == len(SHARDS), [len(s) for s in shards]
    weight_map = {}
    for shard, file in zip(shards, SHARDS, strict=True):
        mx.save_safetensors(str(folder / file), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX).write_text(json.dumps(index, indent=4))


@pytest.fixture(scope="module")
def lms(tmp_path_factory) -> LmStudioHome:
    built = ensure_demo_model("demo-qwen36-4bit", tmp_path_factory.mktemp("qwen36-build"))
    home = tmp_path_factory.mktemp("home")
    models = home / ".lmstudio" / "models"
    folder = models / KEY
    folder.mkdir(parents=True)
    for name in COPIED:
        shutil.copy2(built / name, folder / name)
    _write_shards(built / "model.safetensors", folder)
    return LmStudioHome(home, models, folder, built)


def _header_bytes(shard: Path) -> int:
    """A safetensors file's 8-byte length and its JSON header."""
    with shard.open("rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


# -- the folder ---------------------------------------------------------------------------


def test_the_folder_holds_two_shards_and_an_index_that_mlx_lm_loads_as_the_model(lms):
    files = {f.name for f in lms.folder.iterdir()}
    assert files == {*COPIED, INDEX, *SHARDS}
    index = json.loads((lms.folder / INDEX).read_text())
    built = mx.load(str(lms.built / "model.safetensors"))
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in built.values())
    assert set(index["weight_map"]) == set(built)
    for shard in SHARDS:
        held = mx.load(str(lms.folder / shard))
        assert held and {k for k, f in index["weight_map"].items() if f == shard} == set(held)
    # The shards hold every tensor, the MTP head's among them, and nothing else.
    assert any(k.startswith("mtp.") for k in built)

    model, tokenizer, config = mlx_load(str(lms.folder), return_config=True)
    # The model mlx-lm builds from the shards is the built one's, tensor for tensor (the
    # MTP head aside, which mlx-lm's model does not hold).
    params = dict(tree_flatten(model.parameters()))
    assert set(params) == {k for k in built if not k.startswith("mtp.")}
    assert all(mx.array_equal(v, built[k]).item() for k, v in params.items())
    assert config["quantization"]["bits"] == 4 and config["model_type"] == "qwen3_5_moe"
    assert len(tokenizer.encode("Qwen3.6 in LM Studio")) > 0
    # Our MTP loader reads the head across both shards.
    head, _ = mtp.read_head_tensors(lms.folder)
    assert set(head) == set(mtp.read_head_tensors(lms.built)[0])
    assert mtp.has_head(lms.folder, config)


# -- discovery ----------------------------------------------------------------------------


def test_discovery_finds_it_in_lm_studios_default_folder_under_its_key(lms, monkeypatch):
    monkeypatch.setenv("HOME", str(lms.home))
    found = scan([Path(d) for d in DEFAULT_LMSTUDIO_DIRS])
    assert [(m.id, m.path, m.format) for m in found] == [(KEY, lms.folder, "mlx")]
    model = found[0]
    assert (model.architecture, model.cache_kind, model.vision) == (
        "qwen3_5_moe",
        CacheKind.HYBRID,
        "no",
    )
    assert model.size_bytes == lms.shards_bytes
    # The key, and the folder's path, both resolve to it under that key.
    root = [Path(DEFAULT_LMSTUDIO_DIRS[0])]
    for spec in (KEY, str(lms.folder)):
        ref = resolve(spec, lms.home / "cache", root)
        assert (ref.id, ref.path, ref.is_demo) == (KEY, lms.folder.resolve(), False)


# -- one copy: LM Studio's listing of it, in the shapes LM Studio uses ----------------------

# LM Studio's names for this folder, in its documented and observed shapes: its key is the
# folder's name in lower case beside its publisher (the model.yaml docs name the concrete
# `lmstudio-community/qwen3-8b-mlx-4bit` of `lmstudio-community/Qwen3-8B-MLX-4bit`); with
# the publisher in the key (`lms ls`: `lmstudio-community/meta-llama-3.1-8b-instruct`);
# with the quantization dropped (the v0 docs list `mlx-community/Qwen2-VL-7B-Instruct-4bit`
# as `"id": "qwen2-vl-7b-instruct"`, `"quantization": "4bit"`); and as the catalog model
# whose MLX files these are (model.yaml: `qwen/qwen3-8b` over lmstudio-community's folders).
OURS = (
    FakeModel(LMS_KEY, "lmstudio-community"),
    FakeModel(f"lmstudio-community/{LMS_KEY}", "lmstudio-community"),
    FakeModel("qwen3.6-35b-a3b-mlx", "lmstudio-community"),
    FakeModel("qwen/qwen3.6-35b-a3b", "qwen"),
)
# Other weights: another quantization, another publisher's conversion, LM Studio's GGUF of
# the same model (`lmstudio-community/Qwen3.6-35B-A3B-GGUF`, served by LM Studio itself),
# the catalog model loaded from its GGUF, and a model whose name merely begins like it.
NOT_OURS = (
    FakeModel("qwen3.6-35b-a3b-mlx-8bit", "lmstudio-community"),
    FakeModel(LMS_KEY, "mlx-community"),
    FakeModel("qwen3.6-35b-a3b", "lmstudio-community", format="gguf"),
    FakeModel("qwen/qwen3.6-35b-a3b", "qwen", format="gguf"),
    FakeModel("qwen/qwen3.6-35b-a3b-instruct", "qwen"),
)


def _held(ref: ModelRef, models: tuple[FakeModel, ...], v0_only: bool) -> list[tuple]:
    """What held_copies picks from LM Studio's listing of `models`, each loaded once."""
    loaded = [FakeModel(m.key, m.publisher, instances=[m.key], format=m.format) for m in models]

    async def listing():
        async with LmStudioRest(fake.url) as rest:
            return await rest.models()

    with FakeLmStudio(loaded, v0_only=v0_only) as fake:
        got = asyncio.run(listing())
    assert len(got.loaded) == len(models)
    return [(m.key, m.publisher) for m in held_copies(ref, got)]


@pytest.mark.parametrize("api", ["v1", "v0"])
def test_lm_studio_lists_it_in_any_of_its_shapes_and_one_copy_matches_only_those(lms, api):
    ref = lms.ref()
    ours = [(m.key, m.publisher) for m in OURS]
    assert _held(ref, OURS, v0_only=api == "v0") == ours
    assert _held(ref, NOT_OURS, v0_only=api == "v0") == []


# -- served: /v1/models, /api/v0/models, the openai SDK, doctor, the unload ---------------


@dataclass(slots=True)
class Served:
    server: Server
    fake: FakeLmStudio
    config: Path
    env: dict[str, str]


@pytest.fixture(scope="module")
def served(lms, tmp_path_factory) -> Iterator[Served]:
    """A server with `[models] serve_all_mlx` and LM Studio's default folders, HOME being
    the temporary home; LM Studio holds our model, and a GGUF model of its own."""
    work = tmp_path_factory.mktemp("served")
    held = [
        FakeModel(LMS_KEY, "lmstudio-community", lms.shards_bytes, [LMS_KEY]),
        FakeModel("qwen/qwen3-8b", "qwen", 5 * GB, ["qwen/qwen3-8b"], format="gguf"),
    ]
    with FakeLmStudio(held) as fake:
        config = work / "config.toml"
        config.write_text(f'[upstream]\nurl = "{fake.url}"\n[models]\nserve_all_mlx = true\n')
        env = {"HOME": str(lms.home)}
        (cache := work / "cache").mkdir()
        server = start_server(cache, "--config", str(config), env=env)
        try:
            yield Served(server, fake, config, env)
        finally:
            server.stop()


def test_the_server_lists_it_by_its_lm_studio_key(served):
    url = served.server.url
    listed = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in listed if m["owned_by"] == "mlx-prompt-cache"] == [KEY]
    # LM Studio's own models follow, by LM Studio's keys.
    assert {m["id"] for m in listed} == {KEY, LMS_KEY, "qwen/qwen3-8b"}
    v0 = httpx.get(url + "/api/v0/models", timeout=30).json()["data"]
    ours = v0[0]
    assert (ours["id"], ours["publisher"], ours["compatibility_type"], ours["type"]) == (
        KEY,
        "lmstudio-community",
        "mlx",
        "llm",
    )
    assert [m["id"] for m in v0[1:]] == [LMS_KEY, "qwen/qwen3-8b"]


def _doctor(served: Served) -> dict:
    env = {
        **os.environ,
        **served.env,
        "MLX_PROMPT_CACHE_SERVER_PORT": str(served.server.port),
    }
    cmd = [sys.executable, "-m", "proxy.cli", "doctor", "--config", str(served.config), "--json"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _lines(log: str, text: str) -> list[int]:
    return [i for i, line in enumerate(log.splitlines()) if text in line]


def test_its_first_request_unloads_lm_studios_copy_and_the_repeat_hits_the_cache(lms, served):
    fake, url = served.fake, served.server.url
    # Before the first request: doctor sees it by its key, its size, and LM Studio's copy.
    report = _doctor(served)
    (row,) = report["models"]
    assert (row["id"], row["path"], row["demo"], row["loaded"]) == (
        KEY,
        str(lms.folder.resolve()),
        False,
        False,
    )
    assert row["weights_bytes"] == lms.shards_bytes
    assert {m["key"]: m["also_served_here"] for m in report["lmstudio"]["loaded"]} == {
        LMS_KEY: [KEY],
        "qwen/qwen3-8b": [],
    }

    client = openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0, timeout=120)
    messages = [
        {"role": "system", "content": prose(12)},
        {"role": "user", "content": "Which queue makes new jobs wait?"},
    ]

    def ask():
        return client.chat.completions.create(
            model=KEY, messages=messages, max_tokens=4, temperature=0
        )

    first = ask()
    assert first.model == KEY and first.usage.completion_tokens == 4
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # LM Studio let go of its copy before ours loaded; its own GGUF model stays.
    assert fake.unload_requests() == [LMS_KEY]
    assert fake.loaded_instances(LMS_KEY) == []
    assert fake.loaded_instances("qwen/qwen3-8b") == ["qwen/qwen3-8b"]
    log = served.server.log()
    (unloaded,) = _lines(log, f"LM Studio held {LMS_KEY} (0.0 GB); unloaded instance {LMS_KEY}")
    (loaded,) = _lines(log, f"loaded model {KEY} from {lms.folder.resolve()}")
    assert unloaded < loaded

    second = ask()
    hit = second.usage.prompt_tokens_details.cached_tokens
    # All but Qwen3.6's generation prompt, `<think>\n`: the hit ends after
    # `<|im_start|>assistant\n`, where a hybrid model's checkpoint was taken.
    assert second.usage.prompt_tokens == first.usage.prompt_tokens > 200
    assert hit == second.usage.prompt_tokens - 2
    assert second.choices[0].message == first.choices[0].message
    # The preflight before the load sized the model as its two shards on disk.
    memory = httpx.get(url + "/v1/cache/stats", timeout=30).json()["memory"]
    assert memory["last_load_weights_bytes"] == lms.shards_bytes


# -- the memory preflight -----------------------------------------------------------------


def test_the_preflight_sizes_it_as_its_shards_each_counted_once(lms):
    # What MLX maps: each shard's tensors and header; not the index, not the tokenizer.
    index = json.loads((lms.folder / INDEX).read_text())
    headers = sum(_header_bytes(lms.folder / s) for s in SHARDS)
    assert Machine().weights(lms.ref()) == lms.shards_bytes
    assert lms.shards_bytes == index["metadata"]["total_size"] + headers


class TightMac(Machine):
    """8 GB of RAM with 10 MB free beyond what the system keeps (5%): less than the model's
    20 MB of weights, read from its folder as the preflight reads them."""

    def __init__(self):
        self.sized: list[tuple[str, int]] = []

    def ram(self) -> RamReading:
        return RamReading(8 * GB, 8 * GB // 20 + (10 << 20))

    def weights(self, ref: ModelRef) -> int:
        size = super().weights(ref)
        self.sized.append((ref.id, size))
        return size


def test_a_machine_without_room_refuses_it_naming_its_lm_studio_key(lms, tmp_path):
    async def scenario():
        engine = Engine(
            EngineSettings(
                cache_dir=tmp_path / "cache",
                model_specs=[KEY],
                lmstudio_dirs=[lms.models],
                ssd_enabled=False,
                ram_budget_share=0.2,
            )
        )
        machine = engine.models.preflight.machine = TightMac()
        try:
            with pytest.raises(EngineError) as refused:
                await engine.load(KEY)
            return refused.value, machine.sized, engine.models.loaded(KEY)
        finally:
            await engine.close()

    error, sized, loaded = asyncio.run(scenario())
    assert sized == [(KEY, lms.shards_bytes)] and loaded is None
    assert error.status == 503 and error.field == "model"
    assert error.message.startswith(f"not enough memory to load {KEY}: it needs ")
    assert "its weights do not fit in the memory free now" in error.message
