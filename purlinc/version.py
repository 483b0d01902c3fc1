"""The package's version, in a module of its own so that every layer can read it without
importing the package's public front (which forwards to the runtime)."""

__version__ = "0.1.0"
