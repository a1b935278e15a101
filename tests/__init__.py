"""The test suite: offline, CPU, tiny models built from configs (see tests/support.py)."""
