"""Family test models on real chat templates, for the agent-session tests and the bench.

A real template (Qwen3.5/3.6, MiniMax M2, gpt-oss, …) rewrites earlier turns in ways the
demo templates never did, and that is what decides where a prompt leaves the cache. The
templates are third-party files read from `<repo>/../shared/templates/`
(models/demo/real_templates.py); nothing here copies their text into the project. The
bench runs this as a child process (`python -m engine_bridge.probes.shapes families …`):
writing weights needs mlx.
"""

from __future__ import annotations

from pathlib import Path

from ..models.demo import families, real_templates


def write_models(root: Path, templates: tuple[str, ...]) -> list[dict[str, str | None]]:
    """A model per real template in `templates` that is present, under `root/<stem>`;
    [] when the templates folder is absent."""
    folder = real_templates.templates_dir()
    out: list[dict[str, str | None]] = []
    for family, name in real_templates.real_pairs(folder):
        if name not in templates:
            continue
        case = Path(name).stem
        path = families.write_family_model(root / case, family, template_file=folder / name)
        source = (folder / name).read_text(encoding="utf-8")
        out.append({"case": case, "family": family, "template": name, "path": str(path),
                    "flag": keeps_reasoning_flag(source)})  # fmt: skip
    return out


def keeps_reasoning_flag(source: str) -> str | None:
    """The template kwarg that keeps earlier turns' reasoning and that the engine turns on
    by default (Qwen3.6's `preserve_thinking`); None for a template without one."""
    from ..prompting.template_flags import default_kwargs

    return next(iter(default_kwargs(source)), None)
