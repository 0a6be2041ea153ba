"""Each module logs under its own dotted name (issue 33): a filter, a level or a log line's
logger then names the module that wrote it. The SSD tier's writer, wear meter, health and
maintenance, the shared tier's faults and the tiers' writes used to log as other modules."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def logger_names(top: str) -> dict[str, str]:
    """What each module of `top` passes to a module-level `logging.getLogger(...)`, by
    module name: the string, or "__name__"."""
    found = {}
    for path in sorted((REPO / top).rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Call):
                continue
            call = node.value
            if ast.unparse(call.func) != "logging.getLogger" or len(call.args) != 1:
                continue
            arg = call.args[0]
            found[module] = arg.value if isinstance(arg, ast.Constant) else ast.unparse(arg)
    return found


def test_every_module_logs_under_its_own_name():
    names = logger_names("engine_bridge")
    assert "engine_bridge.cache.ssd.writer" in names  # the reader finds them
    wrong = {m: name for m, name in names.items() if name not in ("__name__", m)}
    assert wrong == {}
