"""The gateway's pure rules: OpenAI requests, quotas, SSE, API keys."""
