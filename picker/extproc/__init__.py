"""The Envoy-facing adapter: the only package that knows Envoy's ext_proc and access log
messages."""

from picker.extproc.accesslog import AccessLogReceiver
from picker.extproc.accesslog import add_to_server as add_access_log_to_server
from picker.extproc.service import ExternalProcessor, add_to_server

__all__ = ["AccessLogReceiver", "ExternalProcessor", "add_access_log_to_server", "add_to_server"]
