"""The project's version, read by pyproject.toml (setuptools' dynamic version) and written into every bundle and
package it produces."""

__version__ = "0.1.0"
