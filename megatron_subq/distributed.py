"""Process-group helpers the trainer needs at run time (tests reuse them through ``testing``)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago: the rendezvous port of a single-process
    run (``MASTER_PORT`` unset) or of the test harness's spawned groups. The OS picks it (bind to
    port 0), so concurrent runs on one machine do not collide on a fixed default."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
