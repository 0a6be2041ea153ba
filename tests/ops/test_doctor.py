"""`mlx-prompt-cache doctor`, run as the CLI runs, against a fake LM Studio (its documented
REST shapes) and with no server of ours at the configured port; and against a running
server, whose lost tokens it lists by cause with their fixes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai

from engine_bridge.models.preflight import weights_bytes
from engine_bridge.ops.blas import cpu_blas
from proxy.config.tomltext import inline
from proxy.doctor import EXTRAS, LOST_SHOWN, PROGRAMS
from tests.conftest import REPO, free_port, fresh_cache_dir, start_server
from tests.support.fake_lmstudio import FakeLmStudio, FakeModel, lmstudio_model_folder

GB = 1 << 30


def _config(tmp_path: Path, upstream: str, serve: list[str], lmstudio_dir: Path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        f'[upstream]\nurl = "{upstream}"\n'
        f"[models]\nserve = {json.dumps(serve)}\nlmstudio_dirs = {json.dumps([str(lmstudio_dir)])}\n"
        f'[engine]\nkv_memory = "4GB"\n'
        f'[cache.ram]\nbudget = "8GB"\n'
        f'[cache.ssd]\ndir = "{tmp_path / "cache"}"\n'
    )
    return path


def _doctor(config: Path, *flags: str, port: int | None = None) -> subprocess.CompletedProcess:
    # By default a port nothing listens on: no server of ours is running.
    env = {**os.environ, "MLX_PROMPT_CACHE_SERVER_PORT": str(port or free_port())}
    cmd = [sys.executable, "-m", "proxy.cli", "doctor", "--config", str(config), *flags]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_doctor_reports_what_lm_studio_holds_the_memory_figures_and_the_extras(demo_root, tmp_path):
    root, folder = lmstudio_model_folder(demo_root, tmp_path)
    models = [
        FakeModel("tiny-llama-mlx", "acme", 20 * GB, ["tiny-llama-mlx"]),
        FakeModel("qwen/qwen3-8b", "qwen", 5 * GB, [], format="gguf"),
    ]
    with FakeLmStudio(models) as fake:
        config = _config(tmp_path, fake.url, [str(folder), "demo-llama"], root)
        text = _doctor(config)
        as_json = _doctor(config, "--json")
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "Served in-process (server at http://127.0.0.1:" in out and ": not running)" in out
    assert "  acme/tiny-llama-mlx  configured" in out
    assert "  demo-llama           configured" in out
    assert f"LM Studio at {fake.url} (REST API v1)" in out
    assert (
        "  tiny-llama-mlx  loaded as tiny-llama-mlx  20.0 GB"
        "  also served here as acme/tiny-llama-mlx: two copies"
    ) in out
    assert "qwen/qwen3-8b" not in out  # known to LM Studio, not loaded
    assert " GB total, " in out and " GB available" in out
    assert "  RAM tier budget  8GB\n" in out
    assert "  K/V memory       4GB\n" in out
    assert "  kept free        5% (" in out and " GB of all RAM)\n" in out
    for name in EXTRAS:
        assert f"\n  {name:11} " in out
    for name in PROGRAMS:
        assert f"\n  {name:17} " in out

    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    assert report["server"]["running"] is False
    ours = report["models"][0]
    assert (ours["id"], ours["path"], ours["loaded"]) == ("acme/tiny-llama-mlx", str(folder), None)
    assert ours["weights_bytes"] == weights_bytes(folder) > 0
    assert report["lmstudio"]["reachable"] and report["lmstudio"]["api"] == "v1"
    assert report["lmstudio"]["loaded"] == [
        {
            "key": "tiny-llama-mlx",
            "instances": ["tiny-llama-mlx"],
            "size_bytes": 20 * GB,
            "format": "mlx",
            "type": "llm",
            "also_served_here": ["acme/tiny-llama-mlx"],
        }
    ]
    memory = report["memory"]
    assert memory["ram_budget_bytes"] == 8 * 1000**3 and memory["kv_memory_bytes"] == 4 * 1000**3
    assert 0 < memory["available_bytes"] <= memory["total_bytes"]
    assert set(report["extras"]) == set(EXTRAS)
    assert all(isinstance(v, bool) for v in report["extras"].values())
    assert set(report["programs"]) == set(PROGRAMS)
    blas = cpu_blas()  # the doctor ran in this environment
    assert report["cpu_blas"] == {"name": blas.name, "advice": blas.advice()}
    assert f"\nMLX's CPU BLAS: {blas.name}\n" in out + "\n"


def test_doctor_says_lm_studio_is_unreachable_and_still_exits_0(demo_root, tmp_path):
    root, folder = lmstudio_model_folder(demo_root, tmp_path)
    done = _doctor(_config(tmp_path, "http://127.0.0.1:9", [str(folder)], root))
    assert done.returncode == 0, done.stderr
    assert "LM Studio: unreachable at http://127.0.0.1:9 (" in done.stdout
    assert "Memory\n" in done.stdout and "Optional extras" in done.stdout


def _lost_tokens(url: str) -> None:
    """Three causes besides new content: a client that rewrites the time in its system
    prompt, a second tenant sending a prompt the first had computed, and a bypass."""

    def client(tenant: str = "local") -> openai.OpenAI:
        return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60,
                             default_headers={"x-tenant": tenant})  # fmt: skip

    def ask(c: openai.OpenAI, messages: list[dict], session: str, **headers: str) -> str:
        reply = c.chat.completions.create(
            model="demo-llama", messages=messages, max_tokens=1, temperature=0,
            extra_headers={"x-session-id": session, **headers},
        )  # fmt: skip
        return reply.choices[0].message.content or "."

    history = [{"role": "user", "content": "Which report needs the region and the month?"}]
    for turn in range(3):
        system = (f"You are the ledger assistant.\nCurrent time: 2026-12-05 0{turn}:1{turn}:"
                  f"{turn}7\n" + "Answer in one short sentence. " * 30)  # fmt: skip
        reply = ask(client(), [{"role": "system", "content": system}, *history], "stamped")
        history += [{"role": "assistant", "content": reply},
                    {"role": "user", "content": f"And the currency? ({turn})"}]  # fmt: skip
    shared = [{"role": "system", "content": "You file expense reports. " * 40},
              {"role": "user", "content": "What is due on Friday?"}]  # fmt: skip
    ask(client("alice"), shared, "alice")
    ask(client("bob"), shared, "bob")
    ask(client(), [{"role": "user", "content": "No cache for this one. " * 20}], "skip",
        **{"x-prompt-cache": "bypass"})  # fmt: skip


def test_doctor_lists_a_running_servers_top_causes_of_lost_tokens_with_their_fixes(
    demo_root, tmp_path
):
    server = start_server(fresh_cache_dir(demo_root, tmp_path / "cache"), "--model",
                          "demo-llama", "--upstream", "http://127.0.0.1:9")  # fmt: skip
    config = tmp_path / "config.toml"
    config.write_text(f'[upstream]\nenabled = false\n[cache.ssd]\ndir = "{server.cache_dir}"\n')
    try:
        _lost_tokens(server.url)
        text = _doctor(config, port=server.port)
        as_json = _doctor(config, "--json", port=server.port)
        answer = httpx.get(server.url + "/v1/cache/diagnosis?window=1h", timeout=30).json()
    finally:
        server.stop()
    assert text.returncode == 0, text.stderr
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["server"]["diagnosis"] == answer
    lost = [c for c in answer["causes"] if c["cause"] != "new_content"]
    assert {"client_rewrote", "other_tenant_or_model", "bypass"} <= {c["cause"] for c in lost}
    fresh = answer["computed_tokens"] - sum(c["tokens"] for c in lost)
    expected = [
        "Lost tokens (last hour)",
        f"  {answer['computed_tokens'] - fresh:,} of {answer['prompt_tokens']:,} prompt tokens "
        f"computed again, {fresh:,} new, in {answer['requests']} requests",
    ]
    width = max(len(c["cause"]) for c in lost[:LOST_SHOWN])
    for c in lost[:LOST_SHOWN]:
        fix = c["fix"]
        expected.append(f"  {c['cause']:{width}}  {c['tokens']:,} tokens ({c['share']:.0%}): "
                        f"{fix['text']}")  # fmt: skip
        if fix["key"]:
            expected.append(f"  {'':{width}}  {fix['key']} = {inline(fix['value'])}")
    section = text.stdout.split("\nLost tokens (last hour)\n", 1)[1].split("\n\n", 1)[0]
    assert ["Lost tokens (last hour)", *section.splitlines()] == expected
    # The stamp is named with the rule that keeps the prefix, as TOML to paste.
    rewrote = next(c for c in lost if c["cause"] == "client_rewrote")
    assert rewrote["fix"]["key"] == "normalization.rules"
    assert f"  normalization.rules = {inline(rewrote['fix']['value'])}\n" in section + "\n"
    assert "new_content" not in section
