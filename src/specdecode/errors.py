"""Exceptions raised by specdecode. Bad input is a ``ValueError`` subclass naming the parameter."""

from __future__ import annotations


class SpecDecodeError(Exception):
    """Base class of specdecode's own errors."""


class ModelNotFoundError(SpecDecodeError, FileNotFoundError):
    """A model path does not exist or a default model package is not installed."""


class IncompatibleModelsError(SpecDecodeError, ValueError):
    """Target and draft cannot be paired (e.g. different vocabularies)."""


class MissingDependencyError(SpecDecodeError, ImportError):
    """An optional package a feature needs is not installed; the message gives the pip command."""
