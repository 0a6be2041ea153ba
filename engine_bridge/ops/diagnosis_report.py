"""GET /v1/cache/diagnosis's answer: a window's tokens computed again, ranked by cause,
each with its fix, in total and by model, tenant and session."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from .diagnosis import ACTIONABLE, Diagnosis, Loss, rank
from .fixes import Context, fix

TOP_SESSIONS = 10  # sessions listed, those that computed the most first


def report(
    diagnosis: Diagnosis,
    ctx: Context,
    window_s: float | None = None,
    *,
    model: str | None = None,
    tenant: str | None = None,
    session: str | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    losses = diagnosis.losses(window_s, model=model, tenant=tenant, session=session, now=now)
    ranked, prompt, computed = rank(losses)
    causes = []
    for r in ranked:
        entry = r.to_json(computed) | {"actionable": r.cause in ACTIONABLE, "fix": fix(r, ctx)}
        causes.append(entry)
    return {
        "window_s": diagnosis.window_s if window_s is None else window_s,
        "filter": {"model": model, "tenant": tenant, "session": session},
        "requests": len(losses),
        "prompt_tokens": prompt,
        "cached_tokens": prompt - computed,
        "computed_tokens": computed,
        "hit_ratio": round((prompt - computed) / prompt, 4) if prompt else None,
        "causes": causes,
        "by_model": _by(losses, lambda x: x.model),
        "by_tenant": _by(losses, lambda x: x.tenant),
        "by_session": _by(losses, lambda x: x.session)[:TOP_SESSIONS],
    }


def _by(losses: Sequence[Loss], key) -> list[dict[str, Any]]:
    """Per model, tenant or session: its tokens computed again and its top cause."""
    groups: dict[str, list[Loss]] = defaultdict(list)
    for x in losses:
        groups[key(x)].append(x)
    out = []
    for name, group in groups.items():
        ranked, prompt, computed = rank(group)
        top = next((r for r in ranked if r.cause != "new_content"), None)
        out.append({
            "name": name,
            "requests": len(group),
            "prompt_tokens": prompt,
            "computed_tokens": computed,
            "hit_ratio": round((prompt - computed) / prompt, 4) if prompt else None,
            "top_cause": top.cause if top else None,
            "top_cause_tokens": top.tokens if top else 0,
        })  # fmt: skip
    return sorted(out, key=lambda g: -g["computed_tokens"])


def context(settings: Any, tiers: Any, models: Any, keep_flags=None) -> Context:
    """The figures fixes are worded from: the engine's settings, the tiers' stats (read
    off the MLX thread: the SSD's come from its index), the memory guard's state and the
    autotuner's (the served models' lifecycle runs both)."""
    pressure = models.memory.pressure
    ram, ssd, shared = tiers.ram, tiers.ssd, tiers.shared
    policy = settings.cache_policy
    cached_tokens = ram.blocks * policy.block_size
    per_token = ram.block_bytes / cached_tokens if cached_tokens else None
    room = None
    if pressure.available_bytes is not None and pressure.floor_bytes is not None:
        # Half of what the guard leaves: a budget that grows never pushes toward swap.
        room = max((pressure.available_bytes - pressure.floor_bytes) // 2, 0)
    tuning = models.autotune_stats()
    return Context(
        ram_budget_bytes=ram.budget_bytes,
        ram_room_bytes=room,
        bytes_per_token=per_token,
        ssd_enabled=ssd is not None,
        ssd_disabled_reason=ssd.disabled_reason if ssd is not None else None,
        ssd_max_bytes=ssd.max_bytes if ssd is not None else None,
        ssd_bytes=ssd.bytes if ssd is not None else None,
        session_ttl_s=settings.session_ttl_s,
        ssd_ttl_s=settings.ssd_ttl_s,
        checkpoint_interval=policy.checkpoint_interval,
        # As tuning left it, where it kept periodic checkpoints (autotune.py).
        keep_periodic=policy.keep_periodic or bool(tuning.get("keep_periodic")),
        block_size=policy.block_size,
        warm_ahead=bool(getattr(settings.warm_ahead, "enabled", False)),
        shared_down=_shared_down(shared),
        keep_flags=keep_flags or (lambda model: {}),
        tuning=tuning,
    )


def _shared_down(shared: Any) -> str | None:
    """Why the shared tier is down, while a fault keeps calls off the network."""
    if shared is None or shared.available:
        return None
    faults = ", ".join(f"{k} {n}" for k, n in shared.errors.items() if n) or "a fault"
    return f"unreachable ({faults})"
