"""pathgate: a validation gate for specialized inference paths."""

__version__ = "0.1.0"
