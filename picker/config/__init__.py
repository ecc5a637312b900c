"""Configuration: strict loading of frozen dataclasses from YAML, with errors that name a path."""

from picker.config.strict import load, load_yaml_file

__all__ = ["load", "load_yaml_file"]
