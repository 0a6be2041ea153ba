"""PNG plots of a run: TTFT per turn (chat) and per request (agent), hit ratio, restarts,
concurrency, the share from the cache per request of agent sessions on real templates, and
the RAM budget and protect_frequent the autotuner set over each trace.

matplotlib is an optional extra (`pip install 'mlx-prompt-cache[bench]'`); without it the
run still writes its JSON and Markdown and says that the plots were skipped.
"""

from __future__ import annotations

from pathlib import Path

from .prerequisites import MATPLOTLIB
from .results import ScenarioResult
from .servers import LABELS

STYLE = {
    "ours": ("C0", "o"),
    "nocache": ("C3", "s"),
    "mlx_lm": ("C2", "^"),
    "mlx_vlm": ("C4", "v"),
}


def plot_all(out: Path, results: list[ScenarioResult]) -> tuple[list[Path], str | None]:
    if not MATPLOTLIB.found():
        return [], f"Plots skipped: {MATPLOTLIB.reason}."
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    chats = [r for r in results if r.scenario.endswith("chat") and r.samples]
    agents = [r for r in results if r.scenario == "agent" and r.samples]
    restarts = [r for r in results if r.scenario.endswith("restart") and r.rows]
    concurrent = [r for r in results if r.scenario == "concurrency" and r.rows]
    templated = [r for r in results if r.scenario == "agent-templates" and r.samples]
    tuned = [r for r in results if r.scenario == "autotune" and r.samples]
    if chats:
        written.append(_ttft(plt, out / "chat_ttft.png", chats, "turn", new_only=True))
    if agents:
        written.append(_ttft(plt, out / "agent_ttft.png", agents, "request"))
    if chats or agents:
        written.append(_hits(plt, out / "hit_ratio.png", chats + agents))
    if restarts:
        written.append(_restart(plt, out / "restart_ttft.png", restarts))
    if concurrent:
        written.append(_concurrency(plt, out / "concurrency.png", concurrent))
    if templated:
        written.append(_agent_templates(plt, out / "agent_templates.png", templated))
    if tuned:
        written.append(_autotune(plt, out / "autotune.png", tuned))
    return written, None


def _grid(plt, n: int, height: float = 3.4):
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, height * rows), squeeze=False)
    flat = [ax for line in axes for ax in line]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat


def _ttft(plt, path: Path, results: list[ScenarioResult], unit: str, new_only: bool = False):
    from matplotlib.ticker import MaxNLocator

    fig, axes = _grid(plt, len(results))
    for ax, r in zip(axes, results, strict=False):
        for kind, (color, marker) in STYLE.items():
            pts = [(s.step + 1, s.ttft_s) for s in r.of(kind) if s.ttft_s is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), color=color, marker=marker, label=LABELS[kind])
        if new_only:
            pts = [(s.step + 1, s.ttft_s) for s in r.of("nocache", "new-only") if s.ttft_s]
            if pts:
                ax.plot(
                    *zip(*pts, strict=True), "k--", lw=1, label="prefill of the new tokens only"
                )
        starts = sorted({s.step for s in r.of("ours") if s.session > 0})
        if starts:
            ax.axvline(starts[0] + 0.5, color="grey", lw=0.8, ls=":")
            ax.text(starts[0] + 0.6, ax.get_ylim()[1] * 0.9, "session 2", color="grey", fontsize=8)
        ax.set_title(f"{r.scenario} — {r.model}")
        ax.set_xlabel(unit)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("TTFT (s)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _hits(plt, path: Path, results: list[ScenarioResult]):
    from matplotlib.ticker import MaxNLocator

    fig, axes = _grid(plt, len(results), height=3.0)
    for ax, r in zip(axes, results, strict=False):
        for kind, line in (("ours", "-"), ("mlx_lm", "--")):
            color, marker = STYLE[kind]
            pts = [(s.step + 1, s.hit_ratio) for s in r.of(kind) if s.hit_ratio is not None]
            if pts:
                # Dashed on top: where both servers hit the same, both lines stay visible.
                ax.plot(
                    *zip(*pts, strict=True), line, color=color, marker=marker, label=LABELS[kind]
                )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"hit ratio — {r.scenario}, {r.model}")
        ax.set_xlabel("turn" if r.scenario.endswith("chat") else "request")
        ax.set_ylabel("cached / prompt tokens")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _restart(plt, path: Path, results: list[ScenarioResult]):
    fig, axes = _grid(plt, len(results), height=3.0)
    for ax, r in zip(axes, results, strict=False):
        _bars(ax, r.rows[0].values, "TTFT (s)", f"next turn after restart — {r.model}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bars(ax, values: dict, ylabel: str, title: str) -> None:
    kinds = [k for k in STYLE if values.get(k) is not None]
    ax.bar(
        [LABELS[k].replace(" --", "\n--") for k in kinds],
        [values[k] for k in kinds],
        color=[STYLE[k][0] for k in kinds],
    )
    ax.set_title(title, fontsize=9)
    ax.set_ylabel(ylabel)
    ax.tick_params(axis="x", labelsize=7)


def _concurrency(plt, path: Path, results: list[ScenarioResult]):
    from .scenarios.concurrency import HOL_ROW, SESSIONS, SESSIONS_ROW, SHORTS, STREAMS, STREAMS_ROW

    panels = (
        (HOL_ROW, "TTFT (s)", f"{SHORTS} short requests behind a long prompt"),
        (STREAMS_ROW, "output tok/s", f"{STREAMS} concurrent streams"),
        (SESSIONS_ROW, "wall time (s)", f"{SESSIONS} concurrent agent sessions"),
    )
    fig, axes = _grid(plt, len(panels) * len(results), height=3.0)
    for i, r in enumerate(results):
        rows = {row.metric: row.values for row in r.rows}
        for ax, (metric, ylabel, title) in zip(axes[3 * i :], panels, strict=False):
            _bars(ax, rows.get(metric, {}), ylabel, f"{title} — {r.model}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _agent_templates(plt, path: Path, results: list[ScenarioResult]):
    """Share of each request's prompt from the cache along one session, per template."""
    from matplotlib.ticker import MaxNLocator

    lines = (
        ("ours", "", "-", "no pause"),
        ("ours", "-paused", "-.", "pause = cold prefill"),
        ("mlx_lm", "", "--", "same prompts"),
    )
    fig, axes = _grid(plt, len(results), height=3.2)
    for ax, r in zip(axes, results, strict=False):
        for kind, suffix, style, what in lines:
            samples = sorted(r.of(kind, "question" + suffix) + r.of(kind, "tool" + suffix),
                             key=lambda s: s.step)  # fmt: skip
            # From request 2: the first question has nothing before it but the system prompt.
            pts = [(s.step + 1, s.hit_ratio) for s in samples[1:] if s.hit_ratio is not None]
            if pts:
                color, marker = STYLE[kind]
                ax.plot(*zip(*pts, strict=True), style, color=color, marker=marker,
                        label=f"{LABELS[kind]}, {what}")  # fmt: skip
        for s in r.of("ours", "question"):
            ax.axvline(s.step + 1, color="grey", lw=0.8, ls=":")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"agent session — {r.model} (dotted: new questions)", fontsize=9)
        ax.set_xlabel("request")
        ax.set_ylabel("cached / prompt tokens")
        ax.set_ylim(top=1.005)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _autotune(plt, path: Path, results: list[ScenarioResult]):
    """The tuned run's RAM budget (MB, left) and protect_frequent (right) after each request,
    per trace, with the burst shaded and the shift marked."""
    from matplotlib.ticker import MaxNLocator

    from .scenarios.autotune.scenario import BUDGETS, PROTECT

    fig, axes = _grid(plt, len(results), height=3.2)
    for ax, r in zip(axes, results, strict=False):
        m = r.metrics
        budget = [(i + 1, b / 1e6) for i, b in enumerate(m.get(BUDGETS) or []) if b is not None]
        protect = [(i + 1, p) for i, p in enumerate(m.get(PROTECT) or []) if p is not None]
        if budget:
            ax.step(*zip(*budget, strict=True), where="post", color="C0", label="RAM budget")
        if m.get("budget_bytes"):
            ax.axhline(m["budget_bytes"] / 1e6, color="C0", lw=0.8, ls=":", label="configured")
        right = ax.twinx()
        if protect:
            right.step(*zip(*protect, strict=True), where="post", color="C1",
                       label="protect_frequent")  # fmt: skip
        right.set_ylim(-0.02, 1.0)
        right.set_ylabel("protect_frequent")
        if m.get("burst_first") is not None:
            ax.axvspan(m["burst_first"] + 0.5, m["burst_last"] + 1.5, color="grey", alpha=0.15)
        elif m.get("pivot") is not None:
            ax.axvline(m["pivot"] + 0.5, color="grey", lw=0.8, ls=":")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"autotune — {r.model}", fontsize=9)
        ax.set_xlabel("request")
        ax.set_ylabel("RAM budget (MB)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        lines = ax.get_legend_handles_labels()
        more = right.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
