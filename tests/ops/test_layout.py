"""The layout's rules (docs/architecture.md), read from the source: no import circles, wings
that import only what they may, no crowded package and no overlong module.

Every import counts, wherever it sits: at the top, inside a function, or under
`TYPE_CHECKING`, since a circle drawn only for the type checker is still a circle a reader
has to follow.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("engine_bridge", "proxy", "bench")
MAX_MODULES = 12  # per package, at one level (docs/architecture.md)
MAX_LINES = 500


@cache
def modules() -> dict[str, Path]:
    out = {}
    for top in SOURCES:
        for path in (REPO / top).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imported(name: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def imports() -> dict[str, frozenset[str]]:
    """Module -> every module it imports (internal ones by module, others by top name)."""
    mods = modules()

    def internal(target: str) -> str:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        return target

    graph = {}
    for name, path in mods.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _imported(name, path, node)
                targets = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = targets or [base]
            else:
                continue
            for t in targets:
                found.add(internal(t) or t.split(".")[0])
        found.discard(name)
        graph[name] = frozenset(found)
    return graph


def circles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root] & graph.keys())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w] & graph.keys()))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle():
    graph = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": frozenset({"b"}), "b": frozenset()}) == []


def test_no_import_circles():
    assert circles(imports()) == []


def test_no_package_is_crowded_and_no_module_is_long():
    crowded = {}
    for top in SOURCES:
        for folder in [REPO / top, *(p for p in (REPO / top).rglob("*") if p.is_dir())]:
            n = sum(1 for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
            if n > MAX_MODULES:
                crowded[str(folder.relative_to(REPO))] = n
    assert crowded == {}
    long = {
        str(p.relative_to(REPO)): n
        for p in [*modules().values(), *(REPO / "tests").rglob("*.py")]
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}


def _reaching(prefix: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    return {
        m: sorted(t for t in targets if t.split(".")[0] in forbidden or t.startswith(forbidden))
        for m, targets in imports().items()
        if m == prefix or m.startswith(prefix + ".")
        if any(t.split(".")[0] in forbidden or t.startswith(forbidden) for t in targets)
    }


def test_each_wing_imports_only_what_it_may():
    # Only engine_bridge/ touches mlx; proxy/ and bench/ reach it through the engine.
    assert _reaching("proxy", ("mlx", "mlx_lm", "mlx_vlm")) == {}
    assert _reaching("bench", ("mlx", "mlx_lm", "mlx_vlm")) == {}
    # The engine knows nothing of HTTP or of who measures it.
    assert _reaching("engine_bridge", ("proxy", "bench", "aiohttp")) == {}
    # The cache knows nothing of the scheduler, the facade or the sessions built on it.
    upward = ("engine_bridge.scheduling", "engine_bridge.engine", "engine_bridge.sessions",
              "engine_bridge.prompt_cache", "engine_bridge.vision", "engine_bridge.models")  # fmt: skip
    assert _reaching("engine_bridge.cache", upward) == {}
    # The shared tier's package imports no redis until a store is made.
    shared = modules()["engine_bridge.cache.shared"]
    assert "redis" not in imports()["engine_bridge.cache.shared"], shared


# What proxy/ may import of engine_bridge/ (docs/architecture.md): the facade, the neutral
# types, a started generation, the settings, the log context, and the offline tools.
PUBLIC = frozenset(
    f"engine_bridge.{m}"
    for m in ("engine", "types", "stream", "engine_settings", "logctx", "offline")
)


def test_the_proxy_reaches_the_engine_only_through_its_public_modules():
    reached = {
        m: sorted(t for t in targets if t.startswith("engine_bridge") and t not in PUBLIC)
        for m, targets in imports().items()
        if m.startswith("proxy")
    }
    assert {m: t for m, t in reached.items() if t} == {}
    # Each public module exists (a rename must update this list and the document).
    assert PUBLIC <= modules().keys()


def test_the_settings_and_offline_tools_load_no_mlx():
    """The proxy builds and checks `EngineSettings` before any model loads, the offline
    `cache` commands read the SSD index, and a split model's front relays to rank 0 and
    starts the ranks; none may pull in MLX."""
    import subprocess
    import sys

    code = (
        "import sys, engine_bridge.engine_settings as s, engine_bridge.offline as o; "
        "import proxy.ranks.front; o.Ranks, o.command, o.first_host_is_here; "
        "o.offline_stats; s.CachePolicy, s.SpeculativeSettings, s.VisionLimits; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_import_reader_sees_every_kind_of_import():
    """The rules above pass trivially on a graph with edges missing: the reader must see
    relative imports (most internal ones), `from package import module`, and imports
    inside functions."""
    graph = imports()
    # `from .generation import shown_settings` in proxy/app.py
    assert "proxy.generation" in graph["proxy.app"]
    # `from .scheduler import ...` two levels down; `from ..models.loading import ...`
    assert "engine_bridge.scheduling.scheduler" in graph["engine_bridge.scheduling.runner"]
    assert "engine_bridge.models.loading" in graph["engine_bridge.scheduling.runner"]
    # `from . import mtp` in scheduling/speculation/control.py
    control = graph["engine_bridge.scheduling.speculation.control"]
    assert "engine_bridge.scheduling.speculation.mtp" in control
    # `from .. import mtp_head as mtp` inside a function of models/demo/weights.py
    assert "engine_bridge.models.mtp_head" in graph["engine_bridge.models.demo.weights"]
    # Absolute imports, of this repo and of others.
    assert "engine_bridge.engine" in graph["proxy.app"] and "aiohttp" in graph["proxy.app"]


def test_the_engine_wings_keep_their_arrows():
    # The cache holds no mlx: payloads cross through the Codec that kv/ implements.
    assert _reaching("engine_bridge.cache", ("mlx", "mlx_lm", "engine_bridge.kv")) == {}
    # Nothing imports the facade but the proxy, and the probes and bench scenarios that
    # drive it in a process of their own, as the proxy does.
    users = {m for m, targets in imports().items() if "engine_bridge.engine" in targets}
    drivers = ("proxy", "engine_bridge.probes", "bench.scenarios")
    assert {m for m in users if not m.startswith(drivers)} == set()
    # The loaded model and its memory check sit below the scheduler that runs them.
    assert _reaching("engine_bridge.models", ("engine_bridge.scheduling",)) == {}
    # The operators' tools (memory guard, request log) read the scheduler, never import it.
    assert _reaching("engine_bridge.ops", ("engine_bridge.scheduling",)) == {}


# Inside engine_bridge/, what each wing may import besides itself (docs/architecture.md):
# the neutral leaves any wing may use, then each layer's lower ones.
LEAVES = {"types", "engine_settings", "logctx"}
BELOW = {
    "types": set(),
    "logctx": set(),
    "engine_settings": {"cache"},  # the cache's own settings types (shared tier, policy)
    "cache": set(),
    "kv": {"cache"},
    "prompting": set(),
    "vision": {"prompting", "kv", "cache"},
    "distributed": set(),  # mx.distributed and mlx-lm's sharding, nothing of ours
    "models": {"prompting", "vision", "kv", "cache", "distributed"},
    "scheduling": {"prompting", "models", "kv", "cache", "distributed"},
    # Below the model lifecycle (served.py), which hands the session routes its table.
    "sessions": {"scheduling", "prompting", "models", "vision", "kv", "cache"},
}


def test_the_wings_inside_the_engine_import_only_downward():
    def wing(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if parts[0] == "engine_bridge" and len(parts) > 1 else None

    upward = {}
    for m, targets in imports().items():
        w = wing(m)
        if w not in BELOW:
            continue
        allowed = BELOW[w] | {w} | (LEAVES if w not in LEAVES else set())
        bad = sorted(t for t in targets if wing(t) is not None and wing(t) not in allowed)
        if bad:
            upward[m] = bad
    assert upward == {}


def test_only_kv_imports_mlx_lms_cache_classes():
    """mlx-lm's cache classes change shape between releases: a new version is a change in
    kv/, which re-exports what the rest uses. The probes measure bare mlx-lm, as it is."""
    cache_module = "mlx_lm.models.cache"
    users = set()
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                named = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            else:
                continue
            if any(n == cache_module or n.startswith(cache_module + ".") for n in named):
                users.add(name)
    assert "engine_bridge.kv" in users  # the door itself: the reader sees the import
    outside = {m for m in users if not m.startswith(("engine_bridge.kv", "engine_bridge.probes"))}
    assert outside == set()


def test_validating_the_config_imports_no_mlx():
    """`serve --print-config`, `doctor` and config errors answer without loading MLX."""
    import subprocess
    import sys

    code = "import sys, proxy.config.loader, proxy.config.validate; print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))"  # noqa: E501
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
