"""The OpenAI-compatible gateway's pure rules: API keys (``keys``)."""
