"""Network emulation for benchmarks and tests (see forwarder.py)."""
