"""The Envoy-facing adapter: the only package that knows Envoy's ext_proc messages."""

from picker.extproc.service import ExternalProcessor, add_to_server

__all__ = ["ExternalProcessor", "add_to_server"]
