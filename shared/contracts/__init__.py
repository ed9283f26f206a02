"""Public contracts: subjects, streams, the event envelope and every request/reply model of API.md."""
