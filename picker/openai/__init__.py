"""Inference API formats: which API a path names, what a request asks for, what a response
delivered (OpenAI completions, chat, Responses and embeddings; Anthropic Messages).

Pure functions over bytes; no I/O. The ext_proc handler feeds them what Envoy forwards.
"""

from picker.openai.paths import ApiKind, classify, normalise_path
from picker.openai.request import InferenceRequest, error_body, parse_request
from picker.openai.response import ResponseMeter

__all__ = ["ApiKind", "InferenceRequest", "ResponseMeter", "classify", "error_body",
           "normalise_path", "parse_request"]
