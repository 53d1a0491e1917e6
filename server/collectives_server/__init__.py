"""Daemons of the collectives service: the coordinator, the workers, and a local launcher."""

__version__ = "0.1.0"
