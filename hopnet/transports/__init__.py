"""Pluggable transports: ``inproc`` (tests, simulator) and ``zmq`` (tcp and ipc)."""

from hopnet.transports.base import DISCARD, Receiver, Transport, TransportStats

__all__ = ["DISCARD", "Receiver", "Transport", "TransportStats"]
