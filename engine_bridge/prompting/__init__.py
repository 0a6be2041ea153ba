"""The model's text formats: a request rendered to token ids and message starts (`render`,
remembered across requests by `prefix_memo`), and its output split back into reasoning,
text and tool calls (`output_format`, `harmony`)."""
