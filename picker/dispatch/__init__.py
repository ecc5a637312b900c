"""The request lifecycle in asyncio: hold each request until the core says go, then meter it."""

from picker.dispatch.dispatcher import Dispatcher, Ticket

__all__ = ["Dispatcher", "Ticket"]
