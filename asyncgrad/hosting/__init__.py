"""Hosting asyncgrad inside other event loops.

`open_asyncio_portal` runs trio in guest mode on the running asyncio loop, with an asyncgrad runtime open
inside it, and yields a portal: ``await portal.run(trio_fn, *args)`` from asyncio code.
"""

from ._asyncio import AsyncioPortal, PortalClosedError, open_asyncio_portal

__all__ = ["AsyncioPortal", "PortalClosedError", "open_asyncio_portal"]
