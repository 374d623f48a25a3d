"""The one error type for configuration mistakes a user can fix."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value is wrong. ``field`` is the dotted key; the message says the fix."""

    def __init__(self, field: str, message: str) -> None:
        # Messages that already start with the field name are not prefixed twice.
        super().__init__(message if message.startswith(field) else f"{field}: {message}")
        self.field = field
        self.message = message
