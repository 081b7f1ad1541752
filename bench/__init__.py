"""Benchmarks (``onpolicy bench``): throughput ratios measured side by side in one run, never in tests."""
