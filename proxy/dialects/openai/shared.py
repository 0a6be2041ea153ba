"""What the OpenAI chat and completions routes share: the request fields both bodies have
(model, n, max_tokens, stop, user, and the sampling fields, which the Responses dialect
reads too), the usage object, and LM Studio's /api/v0 extras."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from engine_bridge.types import Sampling

from ... import fields as f
from ...errors import ApiError
from ...generation import Generation, request_options, session_id


def parse_sampling(body: dict) -> Sampling:
    return Sampling(
        temperature=f.get_float(body, "temperature", 1.0, lo=0.0, hi=2.0),
        top_p=f.get_float(body, "top_p", 1.0, lo=0.0, hi=1.0),
        top_k=f.get_int(body, "top_k", 0, lo=0),
        min_p=f.get_float(body, "min_p", 0.0, lo=0.0, hi=1.0),
        repetition_penalty=f.get_float(body, "repetition_penalty", 1.0, lo=0.01, hi=10.0),
        seed=_seed(f.get_int(body, "seed")),
    )


def _seed(value: int | None) -> int | None:
    # MLX keys are unsigned 64-bit; any integer (-1 included, which some clients send)
    # names one key stream, the same one every time.
    return None if value is None else value % (1 << 64)


def _max_tokens(body: dict) -> int:
    value = f.get_int(body, "max_completion_tokens", None, lo=1)
    if value is None:
        value = f.get_int(body, "max_tokens", 2048, lo=1)
    return value


def request_fields(body: dict, request: web.Request) -> dict[str, Any]:
    model = f.get_str(body, "model", nonempty=True)
    n = f.get_int(body, "n", 1, lo=1)
    if n != 1:
        raise ApiError(400, "n: only n=1 is supported", param="n")
    tenant, use_cache = request_options(request)
    return dict(
        model=model,
        max_tokens=_max_tokens(body),
        stop=f.get_stop(body, "stop"),
        sampling=parse_sampling(body),
        tenant=tenant,
        use_cache=use_cache,
        session=session_id(request, f.get_str(body, "user", None)),
    )


def usage(gen: Generation) -> dict[str, Any]:
    r = gen.result
    prompt = r.prompt_tokens if r else gen.info.prompt_tokens
    completion = r.completion_tokens if r else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": gen.info.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": gen.reasoning_tokens},
    }


_LMSTUDIO_STOP = {
    "stop": "eosFound",
    "length": "maxPredictedTokensReached",
    "stop_string": "stopStringFound",
    "cancelled": "userStopped",
}


def lmstudio_extras(gen: Generation) -> dict[str, Any]:
    """LM Studio's /api/v0 `stats` object, plus what the prompt cache did."""
    r = gen.result
    if r is None:
        return {}
    decode_s = max(r.generation_s - r.ttft_s, 1e-9)
    return {
        "stats": {
            "tokens_per_second": round(max(r.completion_tokens - 1, 0) / decode_s, 3),
            "time_to_first_token": round(r.ttft_s, 4),
            "generation_time": round(r.generation_s, 4),
            "stop_reason": _LMSTUDIO_STOP.get(r.finish_reason, r.finish_reason),
            "cached_prompt_tokens": gen.info.cached_tokens,
            "prompt_cache_source": gen.info.source,
        },
        "model_info": {"format": "mlx", "context_length": gen.context_length},
        "runtime": {"name": "mlx-prompt-cache", "type": "mlx-lm"},
    }
