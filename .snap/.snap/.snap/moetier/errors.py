"""Errors moetier raises for bad input: each carries a one-line message that names the fix."""


class MoetierError(Exception):
    """Base class: a user-facing problem, reported as one line (never a traceback)."""


class CheckpointError(MoetierError):
    """The model folder is missing, incomplete, corrupt, or of an architecture we do not support."""


class ConfigError(MoetierError):
    """A configuration value is out of range or inconsistent."""


class ChatTemplateError(MoetierError):
    """Chat messages are malformed, or the chat template rejected them or failed to render."""
