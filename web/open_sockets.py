"""The websockets one web process holds, counted by client address.

Both socket doors (``/subscribe`` and Socket.IO) enter here before their
upgrade. An address (an IPv6 /64: ``identity.client_network``) holds at most ``NDIF_WEBSOCKETS_PER_ADDRESS`` of a
process's sockets: with auth off every client is "anonymous", so the address
is the only party there is to count. Socket.IO sockets carry no key until a
request claims them; at most ``NDIF_UNCLAIMED_SOCKETS`` may wait unclaimed, so
anonymous clients can never hold the whole connection budget
(``NDIF_WEB_CONNECTIONS``).

Counts are per process, as gunicorn's connection budget is.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from ndif_celery import config
from ndif_celery.errors import Refused


class Entry(NamedTuple):
    address: str
    claimed: bool


class OpenSockets:
    """Who holds this process's websockets: admitted while within both bounds."""

    def __init__(self, settings: config.Settings) -> None:
        self.per_address = settings.websockets_per_address
        self.most_unclaimed = settings.unclaimed_sockets
        self.entries: dict[str, Entry] = {}
        self.by_address: dict[str, int] = {}
        self.unclaimed = 0
        self.lock = threading.Lock()

    def enter(self, sid: str, address: str, claimed: bool) -> None:
        """Count one more socket for ``address``; ``Refused`` (429 or 503) past a bound."""
        with self.lock:
            if self.per_address and self.by_address.get(address, 0) >= self.per_address:
                raise Refused(
                    f"Too many open websockets from your address: at most {self.per_address} per web process "
                    "(NDIF_WEBSOCKETS_PER_ADDRESS). Let some finish, then try again.", 429)
            if not claimed and self.most_unclaimed and self.unclaimed >= self.most_unclaimed:
                raise Refused(
                    f"This server holds {self.most_unclaimed} sockets that no request has claimed yet "
                    "(NDIF_UNCLAIMED_SOCKETS), its most; retry shortly.", 503)
            self.entries[sid] = Entry(address, claimed)
            self.by_address[address] = self.by_address.get(address, 0) + 1
            self.unclaimed += not claimed

    def claim(self, sid: str) -> None:
        """A request claimed the socket: it no longer counts as unclaimed."""
        with self.lock:
            entry = self.entries.get(sid)
            if entry is not None and not entry.claimed:
                self.entries[sid] = entry._replace(claimed=True)
                self.unclaimed -= 1

    def leave(self, sid: str) -> None:
        """The socket closed (or never opened): its place is free. Safe to call twice."""
        with self.lock:
            entry = self.entries.pop(sid, None)
            if entry is None:
                return
            held = self.by_address[entry.address] - 1
            if held:
                self.by_address[entry.address] = held
            else:
                del self.by_address[entry.address]
            self.unclaimed -= not entry.claimed

    def held(self) -> set:
        with self.lock:
            return set(self.entries)
