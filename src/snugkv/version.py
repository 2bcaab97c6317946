"""The package version, in one place (the top-level package re-exports it)."""

__version__ = "0.1.0"
