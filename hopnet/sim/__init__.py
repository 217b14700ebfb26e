"""Deterministic simulation: every worker in one process, in virtual time."""
