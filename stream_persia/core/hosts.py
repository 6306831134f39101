"""Which host names keep a listening socket reachable from this machine only.

One rule for every role: the RPC servers without a role secret
(:func:`stream_persia.rpc.auth.check_bind`), the API without a token
(:meth:`stream_persia.api.settings.ApiSettings.check_bind`), and the RPC client's same-host
Unix-socket shortcut (:mod:`stream_persia.rpc.unix`).
"""

from __future__ import annotations

import ipaddress

__all__ = ["is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` names the loopback interface and nothing else.

    True for ``localhost`` (any case), IPv4 addresses in ``127.0.0.0/8``, ``::1`` and
    IPv4-mapped ``::ffff:127.x.x.x``; surrounding whitespace and the brackets of a URL's
    IPv6 literal (``[::1]``) are ignored. Everything else is False: wildcards (``""``,
    ``0.0.0.0``, ``::``) and every other name, including ``*.localhost`` and names that a
    hosts file happens to map to 127.0.0.1. Names are never resolved: what a name resolves
    to is the resolver's choice, and the point is to refuse a public bind without a secret,
    so only names that cannot mean anything else pass.
    """
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if h.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped   # Python < 3.13 calls ::ffff:127.0.0.1 not loopback
    return ip.is_loopback
