"""Helpers shared by the test modules: paths, the launch helper, run records, the process
cluster, the transport conformance checks and a fault-injecting transport.

The tests directory is on ``sys.path`` (pytest's rootdir conftest), so tests import
``from support.launch import run_launch`` and the like.
"""
