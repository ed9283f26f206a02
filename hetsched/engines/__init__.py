"""Inference engines a node runs: `sim_server` is a simulated, vLLM-compatible one (tests, CI, demos)."""
