"""RedisTier over TLS (`rediss://`) against real redis-servers on a TLS port, with the
committed test certificates of tests/redis/tls: a prompt shared bit for bit, a server
not trusted or misnamed refused, a handshake never answered bounded by `timeout`, client
certificates, and bad TLS arguments refused at construction."""

from __future__ import annotations

import socket
import time

import pytest
from redis_server import TLS, TlsRedisServer, server_binary
from test_tiers import PROMPT, check_contents, evict_everything, pool, serve, tier_stats

import kvrs

CA = TLS / "ca.pem"


def start(**kw):
    binary = server_binary()
    if binary is None:
        pytest.fail("no redis-server: run `make redis` (the tier tests need a real server)")
    server = TlsRedisServer(binary, **kw)
    server.start()
    return server


@pytest.fixture(scope="module")
def tls_server():
    """A TLS server with the certificate for 127.0.0.1 and localhost."""
    server = start()
    yield server
    server.stop()


@pytest.fixture
def tls_url(tls_server):
    """The TLS server, empty."""
    tls_server.client().flushall()
    return tls_server.url


def stored(tls_url):
    """A prompt's blocks stored through a trusted tier; returns that tier."""
    tier = kvrs.RedisTier(tls_url, timeout=2.0, tls_ca=CA)
    p = pool([tier])
    serve(p, PROMPT).free()
    evict_everything(p)
    assert tier_stats(p)["stores"] >= 4 and tier_stats(p)["errors"] == 0
    return tier


def test_two_pools_share_a_prompt_through_rediss(tls_server, tls_url):
    tier = stored(tls_url)
    assert tier.url.startswith("rediss://127.0.0.1:") and repr(tier).startswith("RedisTier('rediss://")
    # Another tier object (its own connections), by IP address and by DNS name.
    for url in (tls_url, f"rediss://localhost:{tls_server.port}/0"):
        other = kvrs.RedisTier(url, timeout=2.0, tls_ca=CA)
        s = pool([other]).new_sequence(tokens=PROMPT)
        assert s.num_cached_tokens == 16
        assert s.cached_tokens_by_tier == {"pool": 0, other.stats()["name"]: 16}
        check_contents(s, PROMPT)
        assert other.stats()["hits"] == 4 and other.stats()["errors"] == 0


def refused(tier):
    """Lookups through `tier` miss, count an error, load nothing."""
    p = pool([tier])
    s = p.new_sequence(tokens=PROMPT)
    assert s.num_cached_tokens == 0
    st = tier_stats(p)
    assert st["errors"] >= 1 and st["hits"] == 0
    check_contents(serve(p, [9, 9, 9, 9, 9]), [9, 9, 9, 9, 9])  # generation goes on


def test_a_server_signed_by_another_ca_is_refused(tls_url):
    stored(tls_url)
    refused(kvrs.RedisTier(tls_url, timeout=2.0, tls_ca=TLS / "other-ca.pem"))


def test_a_server_certificate_for_another_name_is_refused(tls_server, tls_url):
    stored(tls_url)
    wrong = start(cert="wrong-name")
    try:
        src, dst = tls_server.client(), wrong.client()
        for key in src.keys("kvrs:*"):
            dst.set(key, src.get(key))
        assert len(dst.keys("kvrs:*")) >= 4
        refused(kvrs.RedisTier(wrong.url, timeout=2.0, tls_ca=CA))
    finally:
        wrong.stop()


def test_a_handshake_never_answered_costs_one_timeout():
    with socket.socket() as listener:  # the kernel accepts; nothing answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        tier = kvrs.RedisTier(f"rediss://127.0.0.1:{port}/0", timeout=0.3, tls_ca=CA)
        p = pool([tier])
        t0 = time.monotonic()
        s = p.new_sequence(tokens=PROMPT)
        again = p.new_sequence(tokens=PROMPT)  # skipped for retry_after
        took = time.monotonic() - t0
    assert 0.25 < took < 0.8, took
    assert s.num_cached_tokens == 0 and again.num_cached_tokens == 0
    assert tier_stats(p)["errors"] >= 2


def test_client_certificates_for_a_server_that_asks_for_them():
    server = start(auth_clients=True)
    try:
        mine = {"tls_ca": CA, "tls_cert": TLS / "client.pem", "tls_key": TLS / "client.key"}
        p = pool([kvrs.RedisTier(server.url, timeout=2.0, **mine)])
        serve(p, PROMPT).free()
        evict_everything(p)
        s = pool([kvrs.RedisTier(server.url, timeout=2.0, **mine)]).new_sequence(tokens=PROMPT)
        assert s.num_cached_tokens == 16
        check_contents(s, PROMPT)
        refused(kvrs.RedisTier(server.url, timeout=2.0, tls_ca=CA))
    finally:
        server.stop()


def test_bad_tls_arguments_are_refused_at_construction(tmp_path):
    url = "rediss://127.0.0.1:1/0"
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    for kw, name in [
        ({"tls_ca": tmp_path / "missing.pem"}, "tls_ca"),
        ({"tls_ca": not_pem}, "tls_ca"),
        ({"tls_ca": CA, "tls_cert": TLS / "client.pem"}, "tls_key"),
        ({"tls_ca": CA, "tls_key": TLS / "client.key"}, "tls_cert"),
        ({"tls_ca": CA, "tls_cert": TLS / "client.pem", "tls_key": not_pem}, "tls_key"),
    ]:
        with pytest.raises(ValueError, match=name):
            kvrs.RedisTier(url, **kw)
    with pytest.raises(ValueError, match="tls_ca"):
        kvrs.RedisTier("redis://127.0.0.1:1/0", tls_ca=CA)  # TLS options need rediss://
    with pytest.raises(ValueError, match="url"):
        kvrs.RedisTier(url + "#insecure", tls_ca=CA)  # verification cannot be turned off
    t = kvrs.RedisTier("rediss://u:s3cret@127.0.0.1:1/2", tls_ca=str(CA))
    assert t.url == "rediss://u:***@127.0.0.1:1/2" and "s3cret" not in repr(t)
