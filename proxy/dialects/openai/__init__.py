"""The OpenAI dialect: chat completions (`chat`), completions (`completions`), and what both
routes share (`shared`)."""
