"""`hetsched console`: the operator's live web page (nodes and HBM, NVLink domains, TPU pods, reservations,
recent placements with their explanations, the rebalancer), served from this package's ``static/`` files."""
