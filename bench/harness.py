"""What every scenario needs: its settings, servers on fresh cache dirs, timed requests,
progress lines, and the in-process helper (engine_bridge.probes.shapes) as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import client, servers
from .client import Dialect
from .results import Sample, ScenarioResult
from .servers import Kind, ModelSpec, Server


@dataclass(slots=True)
class Settings:
    out: Path
    model: ModelSpec
    hybrid_models: list[ModelSpec]
    quick: bool = False
    seed: int = 0
    max_tokens: int = 8
    progress: Callable[[str], None] = field(default=lambda line: None)
    # Extra `serve` flags for our proxy (both kinds), e.g. an engine knob being compared.
    proxy_args: tuple[str, ...] = ()
    # Seconds a request may go without a byte before it counts as failed: a long prefill
    # sends nothing until its first token, so the default is generous; tests shorten it.
    request_timeout_s: float = 900.0

    def size(self, quick: Any, full: Any) -> Any:
        return quick if self.quick else full


class Harness:
    """One scenario run on one model: owns its servers and collects its samples."""

    def __init__(self, settings: Settings, result: ScenarioResult, model: ModelSpec):
        self.settings = settings
        self.result = result
        self.model = model
        self.fleet = servers.Fleet()
        self.work = settings.out / "work" / f"{result.scenario.replace('/', '-')}-{model.id}"
        self.logs = settings.out / "logs" / self.work.name

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc) -> None:
        self.fleet.__exit__(*exc)

    @contextmanager
    def serve(self, kind: Kind, env: dict[str, str] | None = None) -> Iterator[Server]:
        """One warmed-up server (ours on a fresh cache dir), stopped when the block ends.

        Scenarios run one server at a time: three copies of a large model would not fit
        in many machines' memory, and an idle server would still hold its threads.
        """
        cache_dir = (
            None
            if kind in servers.REFERENCE_SERVERS
            else servers.fresh_cache_dir(self.work, kind, self.model)
        )
        server = self.fleet.add(
            servers.start(kind, self.model, self.logs, cache_dir, "", self.settings.proxy_args, env)
        )
        try:
            self.warm(server)
            yield server
        finally:
            # A restart may have replaced it: stop whatever now runs in its place.
            for s in list(self.fleet.servers):
                if s.kind == kind:
                    s.stop()
                    self.fleet.servers.remove(s)

    def restart(self, server: Server) -> Server:
        """SIGTERM a server, start the same command again (same cache dir), warm it up."""
        stop_s = server.stop()
        new = servers.start(
            server.kind, server.model, self.logs, server.cache_dir, "restarted",
            self.settings.proxy_args,
        )  # fmt: skip
        self.fleet.replace(server, new)
        key = f"{server.kind}-restarted"
        self.record_server(new, key, stop_s=stop_s)
        self.warm(new, key)
        return new

    def warm(self, server: Server, key: str | None = None) -> float:
        """One tiny request that shares no block with any trace: ours loads the model here."""
        body = {"messages": [{"role": "user", "content": "Warm up."}], "max_tokens": 2}
        reply = client.stream(
            server.url, "openai", self._body(server, body), timeout=self.settings.request_timeout_s
        )
        if not reply.ok:
            self.result.errors.append(f"{server.label} warm-up failed: {reply.error}")
        self.record_server(server, key, first_request_s=reply.total_s)
        return reply.total_s

    def record_server(self, server: Server, key: str | None = None, **extra: Any) -> None:
        info = self.result.servers.setdefault(key or server.kind, {})
        info.update({"label": server.label, "ready_s": server.ready_s, "log": str(server.log_path)})
        info.update(extra)

    def send(
        self,
        server: Server,
        dialect: Dialect,
        body: dict[str, Any],
        step: int,
        label: str = "turn",
        session: int = 0,
        headers: dict[str, str] | None = None,
    ) -> Sample:
        reply = client.stream(
            server.url, dialect, self._body(server, body), headers, self.settings.request_timeout_s
        )
        sample = Sample(
            server=server.kind,
            step=step,
            ttft_s=reply.ttft_s,
            total_s=reply.total_s,
            prompt_tokens=reply.prompt_tokens,
            cached_tokens=reply.cached_tokens,
            completion_tokens=reply.completion_tokens,
            source=reply.cache_source,
            ok=reply.ok,
            error=reply.error,
            label=label,
            session=session,
            output=reply.text,
        )
        self.result.samples.append(sample)
        if not reply.ok:
            self.result.errors.append(f"{server.label} {label} {step}: {reply.error}")
        elif reply.ttft_is_end:
            self.result.notes.append(
                f"{server.label} {label} {step}: no output delta; TTFT is the end of the stream"
            )
        return sample

    def _body(self, server: Server, body: dict[str, Any]) -> dict[str, Any]:
        out = {"model": server.model_name, "temperature": 0.0, **body}
        out.setdefault("max_tokens", self.settings.max_tokens)
        if "system" not in out:  # OpenAI dialect: ask for usage in the stream
            out["stream_options"] = {"include_usage": True}
        return out

    def progress(self, step: str, server: Server | str, sample: Sample | None = None) -> None:
        name = server if isinstance(server, str) else server.kind
        line = f"[{self.result.scenario}] {self.model.id} {step} {name}"
        if sample is not None:
            ttft = f"{sample.ttft_s:.3f}s" if sample.ttft_s is not None else "-"
            line += f" ttft={ttft} prompt={sample.prompt_tokens} cached={sample.cached_tokens}"
            if not sample.ok:
                line += f" ERROR {sample.error}"
        self.settings.progress(line)


def stats(server: Server) -> dict[str, Any]:
    """/v1/cache/stats of our proxy, or {} when it cannot be read."""
    try:
        return client.get_json(server.url, "/v1/cache/stats")
    except (OSError, RuntimeError, ValueError):
        return {}


def probe(*args: str, timeout: float = 3600.0) -> dict[str, Any]:
    """Run `python -m engine_bridge.probes.shapes ARGS` and return its JSON answer."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "engine_bridge.probes.shapes", "--json-out", str(out), *args]
        proc = subprocess.run(
            cmd, cwd=servers.REPO, capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(
                f"{' '.join(cmd[2:])} failed ({proc.returncode}):\n{proc.stderr[-2000:]}"
            )
        return json.loads(out.read_text())


def chars_per_token(model: ModelSpec) -> float:
    """How many characters of this project's text one token of the model's tokenizer covers."""
    from . import corpus

    path = model.path / "tokenizer.json"
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
    except Exception:  # no tokenizer.json, or one `tokenizers` cannot read
        return 3.5
    text = corpus.GUIDE + corpus.readme() + corpus.source_files()[0].text
    return len(text) / max(1, len(tok.encode(text).ids))


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    return fn(), time.perf_counter() - start


def resolve_model(spec: str, models_dir: Path, shape: str | None = None):
    """A ModelSpec for a demo id, a shape to build, or an MLX model directory."""
    from engine_bridge.models.demo import is_demo_model

    if shape:
        built = probe("shape", shape, str(models_dir.parent))
        path = Path(built["path"])
        return ModelSpec(path.name, path, is_demo=False)
    if is_demo_model(spec):
        built = probe("demo", spec, str(models_dir.parent))
        return ModelSpec(spec, Path(built["path"]), is_demo=True)
    path = Path(spec).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {spec}: not a demo id and not an MLX model directory")
    return ModelSpec(path.name, path, is_demo=False)
