"""The OpenAI-compatible gateway: API keys, routing and admission, proxying and streaming (docs/GATEWAY.md)."""
