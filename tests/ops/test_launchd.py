"""LaunchAgent plist rendering and the scripts/launchd-agent wrapper (with a fake launchctl)."""

from __future__ import annotations

import asyncio
import os
import plistlib
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from proxy.launchd import LABEL, SYSTEM_PATH, render_plist

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "launchd-agent"
UID = os.getuid()


def test_render_plist_runs_the_installed_cli_with_the_config(tmp_path):
    cli = tmp_path / "repo" / ".venv" / "bin" / "mlx-prompt-cache"
    config = tmp_path / "config.toml"
    logs = tmp_path / "Logs" / "mlx-prompt-cache"
    plist = plistlib.loads(
        render_plist(cli, config, logs, {"MLX_PROMPT_CACHE_CACHE_SSD_DIR": "/Volumes/x"})
    )
    assert plist["Label"] == LABEL == "com.mlx-prompt-cache"
    assert plist["ProgramArguments"] == [str(cli), "serve", "--config", str(config)]
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["StandardOutPath"] == f"{logs}/mlx-prompt-cache.out.log"
    assert plist["StandardErrorPath"] == f"{logs}/mlx-prompt-cache.err.log"
    assert plist["WorkingDirectory"] == str(Path.home())
    assert plist["EnvironmentVariables"] == {
        "PATH": f"{cli.parent}:{SYSTEM_PATH}",
        "PYTHONUNBUFFERED": "1",
        "MLX_PROMPT_CACHE_CACHE_SSD_DIR": "/Volumes/x",
    }


def test_render_plist_expands_home_because_launchd_does_not(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    plist = plistlib.loads(
        render_plist("~/bin/mlx-prompt-cache", "~/c.toml", "~/Library/Logs/m", {})
    )
    assert plist["ProgramArguments"][0] == f"{tmp_path}/bin/mlx-prompt-cache"
    assert plist["ProgramArguments"][3] == f"{tmp_path}/c.toml"
    assert plist["StandardErrorPath"].startswith(f"{tmp_path}/Library/Logs/m/")


def test_render_module_cli_writes_the_file(tmp_path):
    out = tmp_path / "agent.plist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "proxy.launchd",
            "render",
            "--cli",
            "/opt/mpc/bin/mlx-prompt-cache",
            "--config",
            "/etc/mpc.toml",
            "--log-dir",
            str(tmp_path / "logs"),
            "--env",
            "A=1",
            "--output",
            str(out),
        ],
        cwd=REPO,
        check=True,
    )
    plist = plistlib.loads(out.read_bytes())
    assert plist["ProgramArguments"] == [
        "/opt/mpc/bin/mlx-prompt-cache",
        "serve",
        "--config",
        "/etc/mpc.toml",
    ]
    assert plist["EnvironmentVariables"]["A"] == "1"


# ---------------------------------------------------------------------------------------
# scripts/launchd-agent


@pytest.fixture
def agent_env(tmp_path: Path) -> dict[str, str]:
    """Everything the script touches redirected into tmp_path, launchctl faked."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    launchctl = bin_dir / "launchctl"
    launchctl.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> "{tmp_path}/launchctl.log"\n'
        f'if [ "$1" = print ]; then\n'
        f'  [ -e "{tmp_path}/loaded" ] || exit 113\n'
        '  printf "%s\\n" "gui/501/com.mlx-prompt-cache = {" "\tstate = running" '
        '"\tprogram = /x/mlx-prompt-cache" "\tpid = 4242" "\tlast exit code = (never exited)" "}"\n'
        "fi\n"
    )
    launchctl.chmod(0o755)
    cli = bin_dir / "mlx-prompt-cache"
    cli.write_text("#!/usr/bin/env bash\n")
    cli.chmod(0o755)
    return {
        "HOME": str(tmp_path),
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "PLIST_DIR": str(tmp_path / "LaunchAgents"),
        "LAUNCHD_LOG_DIR": str(tmp_path / "Logs"),
        "LAUNCHD_CONFIG": str(tmp_path / "config" / "config.toml"),
        "LAUNCHD_CLI": str(cli),
        "MLX_PROMPT_CACHE_URL": "http://127.0.0.1:9",  # nothing listens on discard
    }


def agent(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, check=check
    )


def launchctl_calls(env: dict[str, str]) -> list[str]:
    log = Path(env["HOME"]) / "launchctl.log"
    return log.read_text().splitlines() if log.exists() else []


def test_dry_run_install_renders_plist_without_launchctl(agent_env):
    env = {**agent_env, "PATH": "/usr/bin:/bin"}  # no launchctl at all, as on Linux
    result = agent(env, "--dry-run", "install")
    plist_path = Path(env["PLIST_DIR"]) / "com.mlx-prompt-cache.plist"
    plist = plistlib.loads(plist_path.read_bytes())
    assert plist["ProgramArguments"] == [
        env["LAUNCHD_CLI"],
        "serve",
        "--config",
        env["LAUNCHD_CONFIG"],
    ]
    assert plist["StandardOutPath"] == f"{env['LAUNCHD_LOG_DIR']}/mlx-prompt-cache.out.log"
    assert f"would run: launchctl bootstrap gui/{UID} {plist_path}" in result.stdout.splitlines()
    assert not Path(env["LAUNCHD_CONFIG"]).exists()  # dry run: only the plist is written


def test_dry_run_defaults_to_the_repo_venv_cli(agent_env):
    env = dict(agent_env)
    del env["LAUNCHD_CLI"]
    agent(env, "--dry-run", "install")
    plist = plistlib.loads((Path(env["PLIST_DIR"]) / "com.mlx-prompt-cache.plist").read_bytes())
    assert plist["ProgramArguments"][0] == str(REPO / ".venv" / "bin" / "mlx-prompt-cache")


def test_install_bootstraps_and_creates_config_from_example(agent_env):
    result = agent(agent_env, "install")
    plist_path = Path(agent_env["PLIST_DIR"]) / "com.mlx-prompt-cache.plist"
    assert plist_path.exists()
    assert Path(agent_env["LAUNCHD_LOG_DIR"]).is_dir()
    config = Path(agent_env["LAUNCHD_CONFIG"])
    assert config.read_text() == (REPO / "config.example.toml").read_text()
    assert launchctl_calls(agent_env) == [
        f"print gui/{UID}/com.mlx-prompt-cache",
        f"bootstrap gui/{UID} {plist_path}",
    ]
    assert f"wrote {plist_path}" in result.stdout


def test_install_over_a_loaded_agent_reloads_it(agent_env):
    (Path(agent_env["HOME"]) / "loaded").touch()
    agent(agent_env, "install")
    plist_path = Path(agent_env["PLIST_DIR"]) / "com.mlx-prompt-cache.plist"
    assert launchctl_calls(agent_env)[-2:] == [
        f"bootout gui/{UID}/com.mlx-prompt-cache",
        f"bootstrap gui/{UID} {plist_path}",
    ]


def test_restart_stop_uninstall_when_loaded(agent_env):
    agent(agent_env, "install")
    (Path(agent_env["HOME"]) / "loaded").touch()
    service = f"gui/{UID}/com.mlx-prompt-cache"
    agent(agent_env, "restart")
    assert launchctl_calls(agent_env)[-1] == f"kickstart -k {service}"
    agent(agent_env, "start")
    assert launchctl_calls(agent_env)[-1] == f"kickstart {service}"
    agent(agent_env, "stop")
    assert launchctl_calls(agent_env)[-1] == f"bootout {service}"
    agent(agent_env, "uninstall")
    assert launchctl_calls(agent_env)[-1] == f"bootout {service}"
    assert not (Path(agent_env["PLIST_DIR"]) / "com.mlx-prompt-cache.plist").exists()


def test_start_without_install_explains(agent_env):
    result = agent(agent_env, "start", check=False)
    assert result.returncode == 1
    assert "not installed: run scripts/launchd-agent install" in result.stderr


def test_unknown_command_is_usage_error(agent_env):
    result = agent(agent_env, "reload", check=False)
    assert result.returncode == 1
    assert "unknown argument: reload" in result.stderr


async def test_status_summarises_launchd_and_probes_health(agent_env, aiohttp_server):
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    (Path(agent_env["HOME"]) / "loaded").touch()
    env = {**agent_env, "MLX_PROMPT_CACHE_URL": url}
    proc = await asyncio.create_subprocess_exec(
        "bash", str(SCRIPT), "status", env=env, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    assert out.decode().splitlines() == [
        f"launchd: com.mlx-prompt-cache is loaded ({env['PLIST_DIR']}/com.mlx-prompt-cache.plist)",
        "  state = running",
        "  program = /x/mlx-prompt-cache",
        "  pid = 4242",
        "  last exit code = (never exited)",
        f'health: {url}/health → {{"status": "ok"}}',
    ]


def test_status_when_not_loaded_and_not_answering(agent_env):
    result = agent(agent_env, "status", check=False)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0] == "launchd: com.mlx-prompt-cache is not loaded"
    assert lines[1].startswith("health: http://127.0.0.1:9/health not answering")
