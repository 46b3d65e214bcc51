"""Save-time integrations: thin adapters that build a source and call the one writer.

Each module imports its engine (transformers, accelerate, ...) at import time, so import them
only when that engine is in use; the package root re-exports them lazily.
"""
