"""The servers the distributed scenario compares, each a "world" of one or more ranks.

Ours on two ranks is `serve --ranks 2`: a front process that starts both ranks through
`mlx.launch` (in a process group of their own) and relays to rank 0. mlx_lm.server's own
distributed mode is `mlx.launch ... -- -m mlx_lm.server`, whose rank 0 answers HTTP, as its
users start it; and again through the launcher ours runs (`quiet_launch.py`: mlx.launch,
whose relay otherwise spins a core), to tell the launcher's share from the cache's. Each
world starts in a session of its own and is stopped as a tree: a rank left behind would
hold a CPU of a 2-core machine and every later number with it. A world can be restarted
whole (`restart`): stopped cleanly, then started again on the same cache dir.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from ... import servers
from ...harness import Harness
from ...prerequisites import MLX_LAUNCH
from ...servers import LABELS, Kind, ModelSpec, Server

HOST = "127.0.0.1"
# Seconds a world has to end after SIGTERM before its processes are killed.
STOP_TIMEOUT_S = 60.0
# mlx_lm's pipeline split finds each layer's file in this index (mlx_lm.utils.sharded_load).
INDEX = "model.safetensors.index.json"
# The launcher ours starts its ranks with (engine_bridge/distributed/quiet_launch.py).
QUIET_LAUNCH = [sys.executable, "-m", "engine_bridge.distributed.quiet_launch"]
# Our proxy's environment variable for the first of the ranks' ring ports.
RING_PORT_ENV = "MLX_PROMPT_CACHE_DISTRIBUTED_PORT"


@dataclass(frozen=True, slots=True)
class World:
    """One server of the comparison: whose it is, on how many ranks, split how."""

    key: str  # its samples' `server`, and its column in results.json
    kind: Kind  # "ours" or "mlx_lm"
    ranks: int
    mode: str  # "tensor" (every rank its heads) or "pipeline" (every rank its layers)
    # mlx_lm.server's launcher: mlx.launch as its users run it, or ours (QUIET_LAUNCH).
    quiet: bool = False

    @property
    def label(self) -> str:
        split = f", {self.ranks} ranks ({self.mode})" if self.ranks > 1 else ", 1 rank"
        return LABELS[self.kind] + split + (", quiet launcher" if self.quiet else "")


def worlds(mode: str, ranks: int = 2) -> tuple[World, ...]:
    """Ours split, ours whole, mlx_lm.server split (under mlx.launch, then under our
    launcher): in the order they run."""
    return (
        World("ours", "ours", ranks, mode),
        World("ours_1rank", "ours", 1, mode),
        World("mlx_lm", "mlx_lm", ranks, mode),
        World("mlx_lm_quiet", "mlx_lm", ranks, mode, quiet=True),
    )


@dataclass(slots=True)
class WorldServer(Server):
    """A started world: a `Server` whose label names its ranks and split."""

    world: World | None = None
    key: str = ""  # its entry in result.servers: world.key, or world.key + "-restarted"

    @property
    def label(self) -> str:
        return self.world.label if self.world is not None else LABELS[self.kind]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> float:
        """Stop every process of the world (stop_tree), not only the first; SIGKILL (a
        world that never got ready) gives it no time to end cleanly."""
        if self.stopped_rc is not None:  # stopped already: its ids may be another's now
            return 0.0
        took = stop_tree(self.proc, timeout if sig == signal.SIGTERM else 0.0)
        self.stopped_rc = self.proc.returncode
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        return took


def free_ports(n: int) -> int:
    """The first of `n` consecutive free ports (a ring of ranks listens on one each), so
    that a world's links stay apart from any other world on this machine."""
    while True:
        first = servers.free_port()
        try:
            for port in range(first, first + n):
                with socket.socket() as s:
                    s.bind((HOST, port))
            return first
        except OSError:
            continue


def command(
    world: World,
    model: ModelSpec,
    port: int,
    ring_port: int,
    cache_dir: Path | None = None,
    proxy_args: Sequence[str] = (),
) -> list[str]:
    """The command line that starts `world` with its HTTP answer on `port`."""
    if world.kind == "mlx_lm":
        launcher = QUIET_LAUNCH if world.quiet else [str(MLX_LAUNCH.where())]
        cmd = [
            *launcher, "--backend", "ring", "-n", str(world.ranks),
            "--hosts", HOST, "--starting-port", str(ring_port), "--python", sys.executable,
            "--", "-m", "mlx_lm.server", "--model", str(model.path),
            "--host", HOST, "--port", str(port),
        ]  # fmt: skip
        return cmd + (["--pipeline"] if world.mode == "pipeline" else [])
    assert cache_dir is not None, "ours needs a cache dir"
    cmd = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port)]
    cmd += ["--cache-dir", str(cache_dir), "--model", model.proxy_arg]
    cmd += ["--upstream", "http://127.0.0.1:9"]  # nothing upstream: fail fast
    if world.ranks > 1:
        cmd += ["--ranks", str(world.ranks), "--split", world.mode]
    return cmd + list(proxy_args)


def with_weight_index(model: ModelSpec, work: Path) -> ModelSpec:
    """The model as mlx_lm.server's split load reads it.

    Its pipeline split looks up each layer's file in model.safetensors.index.json, which
    mlx_lm.convert writes for every model but a one-file model (the demo models) lacks:
    then a folder of links to the model's files, plus that index, stands in for it.
    """
    if (model.path / INDEX).is_file():
        return model
    dest = work / f"{model.path.name}-indexed"
    if not (dest / INDEX).is_file():
        dest.mkdir(parents=True, exist_ok=True)
        for f in model.path.iterdir():
            link = dest / f.name
            if not link.exists():
                link.symlink_to(f.resolve())
        files = sorted(model.path.glob("*.safetensors"))
        weight_map = {key: f.name for f in files for key in safetensors_keys(f)}
        (dest / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return ModelSpec(model.id, dest, is_demo=False)


def with_real_template(model: ModelSpec, work: Path, template: Path) -> ModelSpec:
    """The model as a user's download ships it: its files linked into a folder of its own
    (named as the model is), its tokenizer_config.json carrying `template`, the real chat
    template (../shared/templates) in place of the demo's."""
    dest = work / f"{model.path.name}-real-template" / model.id
    config_path = dest / "tokenizer_config.json"
    if not config_path.is_file():
        dest.mkdir(parents=True, exist_ok=True)
        for f in model.path.iterdir():
            link = dest / f.name
            if f.name not in ("tokenizer_config.json", "demo_build.json") and not link.exists():
                link.symlink_to(f.resolve())
        config = json.loads((model.path / "tokenizer_config.json").read_text(encoding="utf-8"))
        config["chat_template"] = template.read_text(encoding="utf-8")
        config_path.write_text(json.dumps(config), encoding="utf-8")
    return ModelSpec(model.id, dest, is_demo=False)


def safetensors_keys(path: Path) -> list[str]:
    """The tensor names in a .safetensors file's header (8 bytes of length, then JSON)."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return [k for k in header if k != "__metadata__"]


@contextmanager
def serving(h: Harness, world: World, model: ModelSpec) -> Iterator[WorldServer]:
    """`world` started, ready and warmed up, and stopped as a whole when the block ends
    (or the world `restart` started in its place)."""
    cache_dir = None
    if world.kind == "ours":
        cache_dir = servers.fresh_cache_dir(h.work, f"{world.key}-{world.mode}", model)
    else:
        model = with_weight_index(model, h.work)
    server = h.fleet.add(launch(h, world, model, cache_dir, world.key))
    try:
        _ready(h, server)
        yield server
    finally:
        for s in [s for s in h.fleet.servers if isinstance(s, WorldServer) and s.world == world]:
            h.record_server(s, s.key, stop_s=s.stop())
            h.fleet.servers.remove(s)


def restart(h: Harness, server: WorldServer) -> WorldServer:
    """Stop every process of the world cleanly (our front stops its ranks, each draining
    its SSD writes, before it exits), then start the same command again: ours on the same
    cache dir, mlx_lm.server with the same arguments; both on fresh ports, since a port
    just closed may still be held. Returns the new world, ready and warmed up (the model
    load is paid there, not by the next turn); `serving` stops it."""
    assert server.world is not None
    h.record_server(server, server.key, stop_s=server.stop())
    new = launch(h, server.world, server.model, server.cache_dir, f"{server.key}-restarted")
    h.fleet.replace(server, new)
    _ready(h, new)
    return new


def launch(
    h: Harness, world: World, model: ModelSpec, cache_dir: Path | None, key: str
) -> WorldServer:
    """Start `world` (not yet ready) with its HTTP answer and its ranks' links on free ports."""
    port, ring_port = servers.free_port(), free_ports(world.ranks)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if world.kind == "ours":
        env[RING_PORT_ENV] = str(ring_port)
    cmd = command(world, model, port, ring_port, cache_dir, h.settings.proxy_args)
    h.logs.mkdir(parents=True, exist_ok=True)
    log_path = h.logs / f"{key}-{world.mode}-{port}.log"
    with log_path.open("w") as log:
        # A session of its own, so one signal reaches every process of the world; a stdin
        # pipe that stays open, since mlx.launch polls stdin and spins on /dev/null.
        proc = subprocess.Popen(
            cmd, cwd=servers.REPO, env=env, stdin=subprocess.PIPE,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    return WorldServer(
        world.kind, f"http://{HOST}:{port}", port, proc, log_path, cmd, cache_dir, model,
        time.perf_counter(), world=world, key=key,
    )  # fmt: skip


def _ready(h: Harness, server: WorldServer) -> None:
    servers.wait_ready(server)
    h.warm(server, server.key)


def stop_tree(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> float:
    """SIGTERM the world's process group, SIGKILL it after `timeout`, then SIGKILL whatever
    it started that still runs (our front starts its ranks in a group of their own, which
    it stops itself unless it was killed). Returns the seconds the stop took."""
    import psutil

    start = time.perf_counter()
    try:
        started = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        started = []
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
    _, alive = psutil.wait_procs(started, timeout=max(1.0, timeout / 6))
    for p in alive:
        with suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=10)
    return time.perf_counter() - start


def _signal_group(pgid: int, sig: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
