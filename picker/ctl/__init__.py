"""``python -m picker.ctl``: what is a running picker doing? Read from its admin API.

``top`` (``picker.ctl.top``) shows its tenants and endpoints, refreshed like ``top(1)``.
"""
