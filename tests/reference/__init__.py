"""Reference implementations the tests and benchmarks measure the product against (they may use the
test extra's dependencies, e.g. SciPy's HiGHS, which the shipped package does not install)."""
