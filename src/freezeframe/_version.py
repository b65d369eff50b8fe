"""The package version, in a module of its own so any stage can read it without importing the
top-level package (which would import every stage)."""

__version__ = "0.1.0"
