"""Built-in demo models: tiny random-weight MLX models built on first use."""

from .build import ensure_demo_model
from .specs import DEMO_MODEL_IDS, VISION_DEMO_IDS, is_demo_model

__all__ = ["DEMO_MODEL_IDS", "VISION_DEMO_IDS", "ensure_demo_model", "is_demo_model"]
