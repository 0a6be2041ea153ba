"""The real agent CLIs (Claude Code, Codex) for tests/dialects/test_real_clients.py.

`./scripts/install-clients` npm-installs both, pinned, into the ignored `.clients/`; the
helpers here find them there (or at `$CLAUDE_CODE_BIN` / `$CODEX_BIN`), give each run a
throwaway HOME (and CODEX_HOME) so nothing of the user's own setup or account is read, and
run them non-interactively against a local server with no real account:

- Claude Code: `claude -p PROMPT --model ID --allowedTools Bash --output-format stream-json
  --verbose`, with ANTHROPIC_BASE_URL at the server, a dummy ANTHROPIC_API_KEY, the small
  and fast model ids pointed at the same local model, and telemetry, error reports, the
  auto-updater and every other non-essential request turned off.
- Codex: `codex exec --json --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox`
  with CODEX_HOME holding a config.toml whose model provider is the server's `/v1`
  (`wire_api = "responses"`), and retries off so a failing server fails the run at once.

Also the forced-output file the server reads (`MLX_PROMPT_CACHE_FORCE_OUTPUT`) and the
Qwen3.6-form tool call text the tests make demo-hybrid write.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import required

REPO = Path(__file__).resolve().parents[2]
INSTALLER = REPO / "scripts" / "install-clients"
# Where scripts/install-clients put them ($CLIENTS_DIR there too; relative to the repo).
CLIENTS_DIR = REPO / os.environ.get("CLIENTS_DIR", ".clients")
FORCE_OUTPUT_ENV = "MLX_PROMPT_CACHE_FORCE_OUTPUT"


def pinned_version(name: str) -> str:
    """A version pinned in scripts/install-clients (`CLAUDE_CODE_VERSION`, `CODEX_VERSION`)."""
    m = re.search(rf'^{name}="([^"]+)"', INSTALLER.read_text(), re.M)
    if not m:
        raise LookupError(f"{name} is not set in {INSTALLER}")
    return m.group(1)


@dataclass(frozen=True)
class Cli:
    name: str
    path: Path | None
    why_missing: str = ""


def _version(path: Path) -> tuple[str, str]:
    """(what `path --version` prints, '') when it runs; else ('', why not)."""
    with tempfile.TemporaryDirectory(prefix="cli-version-") as tmp:
        home = Path(tmp)
        (home / ".codex").mkdir()  # codex insists that CODEX_HOME exists
        try:
            out = subprocess.run(
                [str(path), "--version"],
                env={**_base_env(home), "CODEX_HOME": str(home / ".codex")},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return "", f"{path} --version failed: {e}"
    if out.returncode != 0:
        return "", f"{path} --version exited {out.returncode}: {out.stderr.strip()[-300:]}"
    return out.stdout.strip(), ""


def find_cli(name: str, env_var: str, version_var: str) -> Cli:
    """The pinned CLI in .clients/, or the one at $env_var (any version that runs)."""
    want = pinned_version(version_var)
    explicit = os.environ.get(env_var)
    path = Path(explicit) if explicit else CLIENTS_DIR / "node_modules" / ".bin" / name
    fix = f"set ${env_var} to a working {name}" if explicit else "run ./scripts/install-clients"
    if not path.exists():
        why = f"{name} {want} is not installed ({path} is missing): {fix}"
        return Cli(name, None, required.reason(why))
    version, why = _version(path)
    if why:
        return Cli(name, None, required.reason(f"{why}: {fix}"))
    if want not in version and not explicit:
        why = f"{path} is {version!r}, not the pinned {want}: {fix}"
        return Cli(name, None, required.reason(why))
    return Cli(name, path)


def claude_code() -> Cli:
    return find_cli("claude", "CLAUDE_CODE_BIN", "CLAUDE_CODE_VERSION")


def codex() -> Cli:
    return find_cli("codex", "CODEX_BIN", "CODEX_VERSION")


def _base_env(home: Path) -> dict[str, str]:
    """A clean environment: PATH and locale from ours, HOME a throwaway, nothing else.

    Nothing of the developer's own shell leaks in (an ANTHROPIC_API_KEY, an OPENAI_BASE_URL,
    a proxy setting), and TMPDIR and the XDG dirs point inside HOME so the CLIs write
    nowhere else (Claude Code keeps /tmp/claude-UID and a socket dir, Codex /tmp/codex-*)."""
    tmp = home / "t"  # short: Claude Code puts a unix socket (at most 107 bytes) under it
    tmp.mkdir(parents=True, exist_ok=True)
    env = {
        "TMPDIR": str(tmp),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "TERM": "dumb",
        "NO_COLOR": "1",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    return env


@dataclass
class Run:
    """One finished CLI run: exit status, output, its JSON events, and how long it took."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    events: list[dict] = field(default_factory=list)

    def describe(self) -> str:
        return (
            f"$ {' '.join(self.argv[:6])} ...\nexit {self.returncode} after {self.seconds:.1f}s\n"
            f"--- stdout (tail)\n{self.stdout[-6000:]}\n--- stderr (tail)\n{self.stderr[-4000:]}"
        )


def _json_lines(text: str) -> list[dict]:
    events = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return events


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> Run:
    t0 = time.monotonic()
    try:
        p = subprocess.run(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,  # codex exec reads a prompt from a piped stdin
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        code, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        code = -9
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        err += f"\n[timed out after {timeout}s]"
    return Run(argv, code, out, err, time.monotonic() - t0, _json_lines(out))


# --- Claude Code ---------------------------------------------------------------------------


def claude_env(home: Path, base_url: str, model: str) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    return {
        **_base_env(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "dummy-local-key",
        # The background and "small, fast" requests (titles, summaries) go to the same model.
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        # No update checks, telemetry, error reports, feedback surveys or other traffic to
        # anthropic.com that could hang the run where the network is closed.
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_BUG_COMMAND": "1",
        "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
        "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
        "CLAUDE_CODE_IDE_SKIP_AUTO_INSTALL": "1",
        # A cold prefill of its ~20k-token system prompt on a CPU takes minutes, not seconds.
        "API_TIMEOUT_MS": "900000",
        # Should the forced output not match, the random model stops soon all the same.
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "1024",
        "BASH_DEFAULT_TIMEOUT_MS": "60000",
    }


def run_claude(
    cli: Cli,
    prompt: str,
    *,
    cwd: Path,
    home: Path,
    base_url: str,
    model: str,
    timeout: float = 600,
) -> Run:
    """`claude -p PROMPT` with Bash allowed, stream-json events on stdout."""
    assert cli.path is not None, cli.why_missing
    argv = [
        str(cli.path),
        "-p",
        prompt,
        "--model",
        model,
        "--allowedTools",
        "Bash",
        "--output-format",
        "stream-json",
        "--verbose",
        "--max-turns",
        "4",
    ]
    return _run(argv, claude_env(home, base_url, model), cwd, timeout)


# --- Codex ---------------------------------------------------------------------------------

CODEX_PROVIDER = "mlx-prompt-cache"
CODEX_KEY_ENV = "MLX_PROMPT_CACHE_API_KEY"


def codex_config(
    base_url: str,
    model: str,
    *,
    idle_timeout_ms: int = 900_000,
    instructions_file: Path | None = None,
) -> str:
    """config.toml for a Codex that talks only to `base_url` (the proxy's root); it gives up
    on a stream that dispatches no event for `idle_timeout_ms`. `instructions_file` replaces
    Codex's own instructions (about 5k tokens) with that file's."""
    instructions = f'model_instructions_file = "{instructions_file}"\n' if instructions_file else ""
    return f"""\
{instructions}model = "{model}"
model_provider = "{CODEX_PROVIDER}"
check_for_update_on_startup = false

[model_providers.{CODEX_PROVIDER}]
name = "mlx-prompt-cache"
base_url = "{base_url.rstrip("/")}/v1"
wire_api = "responses"
env_key = "{CODEX_KEY_ENV}"
# A failing server fails the run at once instead of after a round of retries.
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = {idle_timeout_ms}

[analytics]
enabled = false

[features]
# Its startup sync of the curated plugins from GitHub is traffic the test has no use for.
plugins = false

[feedback]
enabled = false
"""


def codex_env(home: Path, base_url: str, model: str, config: str | None = None) -> dict[str, str]:
    """`config`: the config.toml to run with, codex_config's defaults unless given."""
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(config or codex_config(base_url, model))
    return {
        **_base_env(home),
        "CODEX_HOME": str(codex_home),
        CODEX_KEY_ENV: "dummy-local-key",
        "RUST_LOG": "warn",
    }


def run_codex(
    cli: Cli,
    prompt: str,
    *,
    cwd: Path,
    home: Path,
    base_url: str,
    model: str,
    timeout: float = 600,
    config: str | None = None,
) -> Run:
    """`codex exec --json PROMPT`: no approvals, no sandbox, outside a git repo."""
    assert cli.path is not None, cli.why_missing
    argv = [
        str(cli.path),
        "exec",
        "--json",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        "--ephemeral",
        "--color",
        "never",
        "-C",
        str(cwd),
        "-m",
        model,
        prompt,
    ]
    return _run(argv, codex_env(home, base_url, model, config), cwd, timeout)


# --- What the model is made to write -------------------------------------------------------


def qwen_tool_call(name: str, **params: str) -> str:
    """A tool call in Qwen3.5/3.6's XML form, as its chat template renders one."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def forced_turn(reasoning: str, after: str) -> str:
    """What demo-hybrid writes in one turn: its generation prompt opens `<think>\\n`."""
    return f"{reasoning}\n</think>\n\n{after}"


def write_forced_outputs(path: Path, entries: list[tuple[str, str]]) -> Path:
    """The file `MLX_PROMPT_CACHE_FORCE_OUTPUT` names: (match, text) pairs, in order."""
    outputs = [{"match": m, "text": t} for m, t in entries]
    path.write_text(json.dumps({"outputs": outputs}, indent=2))
    return path
