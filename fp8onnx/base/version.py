"""The package's version (the face re-exports it; reports and model metadata carry it)."""

__version__ = "0.1.0"
