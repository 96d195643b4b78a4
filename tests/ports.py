"""A free TCP port on 127.0.0.1 for a server a test starts (bound, read, released: a race with another
process is possible but unseen here, and each server's start-up fails loudly if it loses it)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
