"""One copy of the weights beside LM Studio: before a model loads here, LM Studio is asked
to unload its own instances of the same model.

LM Studio loads models by itself (from its UI, or just in time for a request), so on a
32 GB Mac a 20 GB model held by LM Studio and by this process means swapping. The engine
awaits `UnloadDuplicates` before every in-process load (`Engine.before_load`). Whatever
LM Studio's API does, the load goes on: a refusal, an old LM Studio without an unload
endpoint or an unreachable one is a warning with the figures, never a failed request.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

import psutil

from engine_bridge.offline import gb, weights_bytes

from .lmstudio_rest import REST_TIMEOUT_S, Listing, LmsModel, LmStudioError, LmStudioRest

if TYPE_CHECKING:
    from engine_bridge.offline import ModelRef

log = logging.getLogger("proxy.upstream.one_copy")


# The quantization LM Studio drops from a download's folder name to make its key: the v0
# docs list `mlx-community/Qwen2-VL-7B-Instruct-4bit` as `"id": "qwen2-vl-7b-instruct"`
# beside `"quantization": "4bit"`, so `Qwen3.6-35B-A3B-MLX-4bit` is `qwen3.6-35b-a3b-mlx`.
_QUANT_TAIL = re.compile(r"-(?:\d+bits?|bf16|fp16|f16|fp8|mxfp4|nvfp4|mxfp8)$")
_MLX_TAIL = re.compile(r"-mlx$")
# Whose downloads LM Studio's catalog (model.yaml) lists by its own key: `qwen/qwen3-8b`
# over `lmstudio-community/Qwen3-8B-MLX-4bit` and its other quantizations.
CATALOG_PUBLISHER = "lmstudio-community"


def _folder(ref: ModelRef) -> tuple[str, str] | None:
    """(publisher, model dir) of the folder, lower case: LM Studio keeps models in
    `<models dir>/<publisher>/<model-dir>/`."""
    if len(ref.path.parts) < 2:
        return None
    publisher, name = ref.path.parts[-2:]
    return publisher.lower(), name.lower()


def ref_names(ref: ModelRef) -> set[str]:
    """Names LM Studio could know our model by: its id, and `publisher/model-dir` of its
    folder."""
    if ref.is_demo:
        return set()  # built here from random weights; LM Studio never has them
    names = {ref.id.lower()}
    if (folder := _folder(ref)) is not None:
        names.add("/".join(folder))
    return names


def lms_names(model: LmsModel) -> set[str]:
    """An LM Studio model's key, and `publisher/key` when the key has no publisher in it
    (the docs list `"key": "gemma-3-270m-it-qat"` beside `"publisher": "lmstudio-community"`)."""
    names = {model.key.lower()}
    if model.publisher and "/" not in model.key:
        names.add(f"{model.publisher}/{model.key}".lower())
    return names


def same_model(ref: ModelRef, model: LmsModel) -> bool:
    """Whether LM Studio's `model` is our `ref`'s weights: by its key as it is, by the key
    LM Studio gives the folder's download, or by the catalog key it lists the download by."""
    names = lms_names(model)
    if ref_names(ref) & names:
        return True
    # LM Studio's own names for an MLX download. Its GGUF of the same model is other
    # weights, which LM Studio serves itself.
    folder = _folder(ref)
    if ref.is_demo or folder is None or model.format not in (None, "mlx"):
        return False
    publisher, name = folder
    bare = _QUANT_TAIL.sub("", name)
    if f"{publisher}/{bare}" in names:
        return True
    # The catalog model over LM Studio's download: `qwen/qwen3.6-35b-a3b`.
    _, slash, catalog = model.key.lower().partition("/")
    return publisher == CATALOG_PUBLISHER and bool(slash) and catalog == _MLX_TAIL.sub("", bare)


def held_copies(ref: ModelRef, listing: Listing) -> list[LmsModel]:
    """LM Studio's models with loaded instances that are the model `ref` names."""
    return [m for m in listing.loaded if same_model(ref, m)]


def two_copies(ref: ModelRef, size_bytes: int | None) -> str:
    """The figures a warning gives: the weights twice, against the machine's RAM."""
    if size_bytes is None:
        try:
            size_bytes = weights_bytes(ref.path)
        except OSError:
            size_bytes = 0
    ram = psutil.virtual_memory()
    return (
        f"2 x {gb(size_bytes)} of weights in {gb(ram.total)} of RAM, "
        f"{gb(ram.available)} available now"
    )


class UnloadDuplicates:
    """`Engine.before_load`: unload LM Studio's instances of the model about to load here."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        connect_timeout_s: float = 2.0,
        timeout_s: float = REST_TIMEOUT_S,
    ):
        self.url = url
        self._client = lambda: LmStudioRest(url, token, timeout_s, connect_timeout_s)

    async def __call__(self, ref: ModelRef) -> None:
        if ref.is_demo:
            return
        try:
            await self._unload_held(ref)
        except LmStudioError as exc:
            log.warning(
                "could not ask LM Studio whether it holds %s: %s; loading it here anyway. "
                "If LM Studio has it loaded, this Mac holds two copies: %s",
                ref.id,
                exc,
                two_copies(ref, None),
            )
        except Exception:
            # A bug here must not fail the load it runs before: the user asked for a model.
            log.exception("asking LM Studio to unload %s failed; loading it here anyway", ref.id)

    async def _unload_held(self, ref: ModelRef) -> None:
        async with self._client() as lms:
            listing = await lms.models()
            for model in held_copies(ref, listing):
                size = gb(model.size_bytes) if model.size_bytes is not None else "size unknown"
                if not listing.can_unload:
                    log.warning(
                        "LM Studio at %s holds %s loaded, and its REST API (v0, before "
                        "LM Studio 0.4) cannot unload it; loading %s here anyway, so this Mac "
                        "holds two copies: %s. Unload it in LM Studio, or update LM Studio",
                        self.url,
                        model.key,
                        ref.id,
                        two_copies(ref, model.size_bytes),
                    )
                    continue
                for instance in model.instances:
                    try:
                        await lms.unload(instance)
                    except LmStudioError as exc:
                        log.warning(
                            "LM Studio did not unload instance %s of %s (%s); loading %s "
                            "here anyway, so this Mac holds two copies: %s",
                            instance,
                            model.key,
                            exc,
                            ref.id,
                            two_copies(ref, model.size_bytes),
                        )
                        continue
                    log.info(
                        "LM Studio held %s (%s); unloaded instance %s before loading it here",
                        model.key,
                        size,
                        instance,
                    )
