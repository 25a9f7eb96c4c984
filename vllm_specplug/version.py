"""The plugin's version (part of the start-up profile's cache key)."""

__version__ = "0.1.0"
