"""The real agent CLIs, Claude Code and Codex, run a tool loop against the proxy.

Each test starts a proxy serving demo-hybrid with a forced output (the test-only hook
`MLX_PROMPT_CACHE_FORCE_OUTPUT`): on the CLI's first request the model writes some reasoning
and a tool call in Qwen3.6's own XML form; on the second, once the tool's output is in the
prompt, a final answer. So the whole path is the real one: the CLI's own request (its
~10-20k-token system prompt and tool schemas), the chat template, the sampler, the tool call
parser, the dialect's streaming events, the CLI running the command on this machine, the
tool result coming back, and the cache serving that second request from the first.

The CLIs are pinned in scripts/install-clients, which `.ci/run` calls; without them (no npm,
no registry) the tests skip. One test per client, each a cold prefill of that client's
system prompt plus a warm second turn: under a minute each on two CPU cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import QWEN36, Server, fresh_cache_dir, start_server
from tests.support import clients

pytestmark = pytest.mark.slow

# demo-hybrid, and our user's model shape (experts, the real Qwen3.6 vocabulary).
MODELS = ("demo-hybrid", QWEN36)
# The command's output, not its text, holds TOOL_RAN ('tool-%s' + 'ran'), so the final answer
# is forced only once the second request carries the tool's real output.
COMMAND = "touch marker.txt && printf 'tool-%s\\n' ran"
TOOL_RAN = "tool-ran"
RUN_TIMEOUT_S = 420

CLAUDE = clients.claude_code()
CODEX = clients.codex()


def serve_forced(
    demo_root: Path, tmp_path: Path, entries: list[tuple[str, str]], model: str
) -> Server:
    forced = clients.write_forced_outputs(tmp_path / "forced.json", entries)
    cache_dir = fresh_cache_dir(demo_root, tmp_path / "cache")
    return start_server(
        cache_dir,
        "--model",
        model,
        "--upstream",
        "http://127.0.0.1:9",
        env={clients.FORCE_OUTPUT_ENV: str(forced)},
    )


def requests_seen(server: Server, model: str) -> list[dict]:
    """The server's request log for the model, oldest first."""
    records = httpx.get(server.url + "/v1/cache/requests", timeout=10).json()["requests"]
    return sorted((r for r in records if r["model"] == model), key=lambda r: r["time"])


def assert_tool_loop_hit(server: Server, run: clients.Run, model: str) -> list[dict]:
    """Two requests, the second (carrying the tool's output) served from the first's cache."""
    seen = requests_seen(server, model)
    context = f"{run.describe()}\n--- requests\n{json.dumps(seen, indent=1)}"
    assert len(seen) >= 2, f"expected the CLI's two requests\n{context}"
    first, last = seen[0], seen[-1]
    assert first["hit_tokens"] == 0 and first["source"] == "none", context
    assert last["prompt_tokens"] > first["prompt_tokens"], context
    # Turn 2 restores at least all of turn 1's prompt (a hybrid model has a checkpoint there).
    assert last["hit_tokens"] >= first["prompt_tokens"], context
    assert last["source"] == "ram" and last["reason"] == "hit", context
    return seen


@pytest.mark.skipif(CLAUDE.path is None, reason=CLAUDE.why_missing or "-")
@pytest.mark.parametrize("model", MODELS)
def test_claude_code_runs_a_bash_call_and_turn_two_hits_the_cache(demo_root, tmp_path, model):
    prompt = "Create the marker file for this run with one Bash command, then say so."
    final = "Marker created. REAL-CLAUDE-CODE-DONE"
    server = serve_forced(
        demo_root,
        tmp_path,
        [
            (
                prompt,
                clients.forced_turn(
                    "I will create the marker file with one command.",
                    clients.qwen_tool_call(
                        "Bash", command=COMMAND, description="Create the marker file"
                    ),
                ),
            ),
            (TOOL_RAN, clients.forced_turn("The command ran.", final)),
        ],
        model,
    )
    cwd = tmp_path / "project"
    cwd.mkdir()
    try:
        run = clients.run_claude(
            CLAUDE,
            prompt,
            cwd=cwd,
            home=tmp_path / "home",
            base_url=server.url,
            model=model,
            timeout=RUN_TIMEOUT_S,
        )
        context = f"{run.describe()}\n--- server log (tail)\n{server.log()[-4000:]}"
        assert run.returncode == 0, context
        # The CLI itself ran the parsed call: the file is there, and its output went back.
        assert (cwd / "marker.txt").is_file(), context
        calls = [
            b
            for e in run.events
            if e.get("type") == "assistant"
            for b in e["message"]["content"]
            if b.get("type") == "tool_use"
        ]
        assert [c["name"] for c in calls] == ["Bash"], context
        assert calls[0]["input"]["command"] == COMMAND, context
        results = [
            b
            for e in run.events
            if e.get("type") == "user"
            for b in e["message"]["content"]
            if isinstance(b, dict) and b.get("type") == "tool_result"
        ]
        assert results and TOOL_RAN in json.dumps(results[0]["content"]), context
        result = [e for e in run.events if e.get("type") == "result"]
        assert result and not result[-1]["is_error"], context
        assert final in result[-1]["result"], context
        # The reasoning was parsed out, not shown as the answer.
        assert "</think>" not in result[-1]["result"], context
        # Claude Code saw the hit in the Messages API's own usage fields.
        usages = [e["message"]["usage"] for e in run.events if e.get("type") == "assistant"]
        assert usages[-1].get("cache_read_input_tokens", 0) > 0, context
        assert_tool_loop_hit(server, run, model)
    finally:
        server.stop()


def codex_items(run: clients.Run, kind: str) -> list[dict]:
    return [
        e["item"]
        for e in run.events
        if e.get("type") == "item.completed" and e.get("item", {}).get("type") == kind
    ]


@pytest.mark.skipif(CODEX.path is None, reason=CODEX.why_missing or "-")
@pytest.mark.parametrize("model", MODELS)
def test_codex_runs_an_exec_command_call_and_turn_two_hits_the_cache(demo_root, tmp_path, model):
    prompt = "Create the marker file for this run with one shell command, then say so."
    final = "Marker created. REAL-CODEX-DONE"
    server = serve_forced(
        demo_root,
        tmp_path,
        [
            (
                prompt,
                clients.forced_turn(
                    "I will create the marker file with one command.",
                    clients.qwen_tool_call("exec_command", cmd=COMMAND),
                ),
            ),
            (TOOL_RAN, clients.forced_turn("The command ran.", final)),
        ],
        model,
    )
    cwd = tmp_path / "project"
    cwd.mkdir()
    try:
        run = clients.run_codex(
            CODEX,
            prompt,
            cwd=cwd,
            home=tmp_path / "home",
            base_url=server.url,
            model=model,
            timeout=RUN_TIMEOUT_S,
        )
        context = f"{run.describe()}\n--- server log (tail)\n{server.log()[-4000:]}"
        assert run.returncode == 0, context
        assert (cwd / "marker.txt").is_file(), context
        commands = codex_items(run, "command_execution")
        assert len(commands) == 1 and commands[0]["exit_code"] == 0, context
        # Codex shows the command as it ran it: `/bin/bash -lc "..."`, quoted for the shell.
        assert "touch marker.txt" in commands[0]["command"], context
        assert TOOL_RAN in commands[0]["aggregated_output"], context
        messages = codex_items(run, "agent_message")
        assert messages and final in messages[-1]["text"], context
        assert "</think>" not in messages[-1]["text"], context
        errors = [e for e in run.events if e.get("type") in ("error", "turn.failed")]
        assert not errors, context
        done = [e for e in run.events if e.get("type") == "turn.completed"]
        assert done, context
        # Codex saw the hit in the Responses API's usage (input_tokens_details.cached_tokens).
        assert done[-1]["usage"].get("cached_input_tokens", 0) > 0, context
        assert_tool_loop_hit(server, run, model)
    finally:
        server.stop()
