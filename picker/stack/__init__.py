"""A local gateway stack on 127.0.0.1: real Envoy, the picker and simulated model servers."""
