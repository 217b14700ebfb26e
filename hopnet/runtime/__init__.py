"""The node runtime: event-loop thread, clock, queues, metrics and the Node itself."""
