"""Errors the engine raises to its callers (the HTTP server maps them to status codes)."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError):
    """The request can never be served as given (400): names the offending parameter."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class QueueFullError(EngineError):
    """The engine's own waiting queue is full (429): retry later."""


class EngineNotRunningError(EngineError):
    """The engine is not started, or is shutting down (503)."""


class UnsupportedSettingError(ValueError):
    """The settings ask for what this model, device or machine cannot run (e.g. a quantization
    without its kernels): the engine stops at start-up with exit 2 and this one line."""
