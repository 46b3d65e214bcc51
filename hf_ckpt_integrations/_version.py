"""The package version: a leaf module, so that modules inside the package (the Hub-layout cache
key) read it without importing the package root."""

__version__ = "0.1.0"
