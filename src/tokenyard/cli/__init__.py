"""The `tokenyard` command: the one place that builds concrete objects (the store, the
limiter backend, replica processes) and hands them to the layers below."""

from tokenyard.cli.main import main

__all__ = ["main"]
