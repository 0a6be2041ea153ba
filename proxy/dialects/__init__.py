"""The API dialects served in-process: OpenAI chat and completions, Anthropic messages,
the OpenAI Responses API, LM Studio's /api/v0 model list, and what they share (output
parts, images in bodies, server-sent events)."""
