"""Where this node sits in a job: the rendezvous's address and port.

Kept free of the training kit (standard library only), so the test harness that starts ranks
(``tests/multiproc.py``) and the launcher share it without importing torch's stack twice.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
