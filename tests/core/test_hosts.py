"""One loopback rule (stream_persia.core.hosts.is_loopback) for every role's bind check."""

from __future__ import annotations

import pytest
from stream_persia.api.settings import ApiSettings

from stream_persia.core.hosts import is_loopback
from stream_persia.errors import ConfigError
from stream_persia.rpc.auth import check_bind

HOSTS = [
    # the loopback interface, however it is spelled
    ("127.0.0.1", True), ("127.1.2.3", True), ("127.255.255.254", True),
    ("localhost", True), ("LocalHost", True), (" localhost ", True),
    ("::1", True), ("[::1]", True), ("0:0:0:0:0:0:0:1", True),
    ("::ffff:127.0.0.1", True), ("[::ffff:127.0.0.2]", True),
    # wildcards and other interfaces
    ("", False), ("0.0.0.0", False), ("::", False), ("[::]", False),
    ("10.0.0.1", False), ("192.168.1.1", False), ("128.0.0.1", False),
    ("::ffff:10.0.0.1", False), ("::2", False),
    # names: only "localhost" itself; nothing is resolved
    ("api.localhost", False), ("localhost.", False), ("localhost.example.com", False),
    ("example.com", False), ("127.0.0.1.nip.io", False), ("not a host", False),
]


@pytest.mark.parametrize("host, expected", HOSTS)
def test_loopback_table(host, expected):
    assert is_loopback(host) is expected


@pytest.mark.parametrize("host, expected", HOSTS)
def test_the_rpc_and_api_bind_checks_follow_the_one_rule(host, expected):
    """Without a secret (RPC) or a token (API), both refuse exactly the non-loopback
    hosts. Before, the API let "api.localhost" through and the RPC check refused
    "LocalHost"."""
    checks = {"rpc": lambda: check_bind(host, None, "the server"),
              "api": lambda: ApiSettings(host=host, token=None).check_bind()}
    for role, check in checks.items():
        if expected:
            check()
        else:
            with pytest.raises(ConfigError):
                check()
                pytest.fail(f"{role} accepted {host!r}")
