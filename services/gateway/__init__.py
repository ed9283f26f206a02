"""Gateway: the OpenAI-compatible HTTP front door; its API keys and usage live in schema `gateway`."""
