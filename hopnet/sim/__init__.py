"""Deterministic simulation: every worker in one process, in virtual time."""

GAP_MATRIX_MAX_N = 1024
"""Up to this many workers a run keeps the largest gap of every pair of workers by default
(:class:`hopnet.sim.engine.SimSpec`; here, not there, so `hopnet simulate`'s parser loads no torch)."""
