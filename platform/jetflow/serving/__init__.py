"""OpenAI-compatible serving behind Ray Serve: request schema, head choice, generation engine,
metrics, and the application builder `jetflow.serving.app:build_app(ServeConfig)`."""

from jetflow.serving.config import ServeConfig

__all__ = ["ServeConfig"]
