"""fairway's error taxonomy: every error the project raises on purpose derives from FairwayError.

Each kind carries, once, the HTTP status a client sees and the label metrics count it under.
"""

from __future__ import annotations


class FairwayError(Exception):
    """Base of all deliberate errors."""

    http_status = 500
    metric_label = "internal"


class ConfigError(FairwayError):
    """A config or scenario value is wrong; ``path`` names the field (``tenants[1].weight``)."""

    http_status = 500
    metric_label = "config"

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)

    def under(self, prefix: str) -> ConfigError:
        """The same error, its path placed under ``prefix``."""
        if not prefix:
            return self
        if not self.path:
            path = prefix
        elif self.path.startswith("["):
            path = prefix + self.path
        else:
            path = f"{prefix}.{self.path}"
        return ConfigError(path, self.message)
