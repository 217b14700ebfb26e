"""Adapters to trainers people already use; each module imports its framework (an extra)."""
