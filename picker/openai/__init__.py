"""OpenAI request and response formats: what a request asks for, and what a response delivered.

Pure functions over bytes; no I/O. The ext_proc handler feeds them what Envoy forwards.
"""

from picker.openai.request import InferenceRequest, error_body, parse_request
from picker.openai.response import ResponseMeter

__all__ = ["InferenceRequest", "ResponseMeter", "error_body", "parse_request"]
