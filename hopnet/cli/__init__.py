"""The `hopnet` command line."""
