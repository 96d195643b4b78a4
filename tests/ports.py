"""A free TCP port on 127.0.0.1 for a server a test starts (bound, read, released: a race with another
process is possible but unseen here, and each server's start-up fails loudly if it loses it).

Never a port that a server binds by default without being told: Ray's dashboard serves its metrics on
44227 (`DASHBOARD_METRIC_PORT`), inside the kernel's ephemeral range, so a test Ray head given 44227 as
its dashboard port lost it to a dashboard's metrics server (its own or another cluster's) and answered
with Prometheus text (CI)."""

from __future__ import annotations

import socket

FIXED_DEFAULT_PORTS = frozenset({44227})


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in FIXED_DEFAULT_PORTS:
            return port
