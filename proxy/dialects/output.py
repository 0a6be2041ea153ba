"""The parts a generation's text splits into, as both dialects write them out.

The parsing itself follows the loaded model's own format and lives with the model
(`engine_bridge/prompting/output_format.py`); a dialect only renders the parts.
"""

from engine_bridge.types import Part, merge, new_call_id

__all__ = ["Part", "merge", "new_call_id"]
