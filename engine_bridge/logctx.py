"""The request id of the work in progress, for log lines on any thread."""

from __future__ import annotations

import contextvars

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
