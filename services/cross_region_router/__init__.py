"""Cross-region router: picks the region for each request."""
