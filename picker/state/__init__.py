"""Tenants' fair-queue counters and budget levels shared by every picker replica and kept
across restarts (``state.backend: redis``): ``RedisSync`` exchanges this picker's changes for
everyone's (the rules of the exchange are ``picker.core.shared``)."""

from picker.state.redis_sync import RedisSync, open_redis

__all__ = ["RedisSync", "open_redis"]
