"""Plain, varied English prose for long prompts: about 20 tokens a sentence, deterministic."""

from __future__ import annotations

_SENTENCES = (
    "The {0} service keeps every order in one ledger and writes it to disk each night.",
    "A request for the {0} report must name the region, the month and the currency.",
    "When the {0} queue is longer than forty jobs, new jobs wait and the caller is told.",
    "Never delete a {0} record; mark it closed and keep the history for seven years.",
    "Times in the {0} logs are UTC, and every line starts with the id of its request.",
    "If a {0} customer asks for a refund, check the ledger before you promise anything.",
)
_TOPICS = ("billing", "shipping", "inventory", "payroll", "support", "search", "audit")


def prose(sentences: int) -> str:
    """`sentences` sentences, always the same ones for the same count."""
    return " ".join(
        _SENTENCES[i % len(_SENTENCES)].format(_TOPICS[(i * 5 + i // 6) % len(_TOPICS)])
        for i in range(sentences)
    )
