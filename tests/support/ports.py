"""Free loopback ports for the test servers, chosen by port-for.

port-for picks from the ports no service is registered for and, unlike binding to
port 0, never from the kernel's ephemeral range: a port we hand a server cannot be
taken meanwhile by some process's outgoing connection, which matters for a server
that stops and must come back on the same ports.
"""

from __future__ import annotations

import threading

import port_for

HOST = "127.0.0.1"

_lock = threading.Lock()
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on now, never the same twice in this process.

    Another process may still take it before our server binds it: the servers
    retry their first start on fresh ports when that happens.
    """
    with _lock:
        port = port_for.select_random(exclude_ports=_handed_out)
        _handed_out.add(port)
    return port
