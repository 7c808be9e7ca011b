"""What `web_fetch` may open: URLs parsed strictly, hosts against the allow-list, and every
resolved address public unless an operator's network holds it."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from gateway.routing.table import FetchPolicy
from gateway.servertools.guard import Guard, Refused, address_allowed, client_allows, host_allowed, parse


def test_urls_are_parsed_strictly() -> None:
    target = parse("https://Docs.Example.org/a/b?x=1#frag")
    assert (target.scheme, target.host, target.port, target.path) == (
        "https",
        "docs.example.org",
        443,
        "/a/b?x=1",
    )
    assert parse("http://[::1]:8080").url == "http://[::1]:8080/"
    for url, code in [
        ("file:///etc/passwd", "url_not_allowed"),
        ("gopher://x.org/", "url_not_allowed"),
        ("http://user:pw@x.org/", "url_not_allowed"),
        ("http://x.org/a b", "invalid_tool_input"),
        ("http:\\\\x.org", "invalid_tool_input"),
        ("http://x.org:99999/", "invalid_tool_input"),
        ("http:///path", "invalid_tool_input"),
        ("http://x.org/" + "a" * 3000, "url_too_long"),
    ]:
        with pytest.raises(Refused) as refused:
            parse(url)
        assert refused.value.code == code, url


def test_the_allow_list_names_hosts_and_subdomains() -> None:
    allow = ["docs.python.org", "*.readthedocs.io"]
    assert host_allowed("docs.python.org", allow)
    assert host_allowed("fleet.readthedocs.io", allow) and host_allowed("a.b.readthedocs.io", allow)
    assert not host_allowed("readthedocs.io", allow)
    assert not host_allowed("evilreadthedocs.io", allow) and not host_allowed("python.org", allow)
    assert not host_allowed("docs.python.org.evil.com", allow)


def test_a_clients_domain_lists_narrow_the_allow_list_only() -> None:
    assert client_allows("a.example.org", ["example.org"], None)
    assert not client_allows("example.net", ["example.org"], None)
    assert not client_allows("a.example.org", None, ["example.org"])


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",  # cloud metadata
        "100.100.100.200",  # shared address space (a metadata service too)
        "0.0.0.0",
        "224.0.0.1",
        "::1",
        "fe80::1",
        "fd00:ec2::254",  # metadata over IPv6
        "::ffff:127.0.0.1",  # IPv4-mapped
        "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
        "2002:7f00:1::",  # 6to4 of 127.0.0.1
    ],
)
def test_private_and_reserved_addresses_are_refused(address: str) -> None:
    assert not address_allowed(ipaddress.ip_address(address))


def test_public_addresses_pass_and_an_operators_network_is_exempt() -> None:
    assert address_allowed(ipaddress.ip_address("93.184.216.34"))
    assert address_allowed(ipaddress.ip_address("2606:4700::1111"))
    loopback = ipaddress.ip_address("127.0.0.1")
    assert address_allowed(loopback, [ipaddress.ip_network("127.0.0.1/32")])


def resolver(answers: dict[str, list[str]]):  # type: ignore[no-untyped-def]
    async def resolve(host: str, port: int) -> list[str]:
        if host not in answers:
            raise OSError("no such name")
        return answers[host]

    return resolve


def check(policy: FetchPolicy, url: str, answers: dict[str, list[str]]) -> str:
    guard = Guard(policy, resolver(answers))
    try:
        return asyncio.run(guard.check(url)).address
    except Refused as refused:
        return refused.code


def test_a_name_is_checked_by_every_address_it_resolves_to() -> None:
    policy = FetchPolicy(allow=["docs.example.org", "rebind.example.org", "gone.example.org"])
    answers = {"docs.example.org": ["93.184.216.34"], "rebind.example.org": ["93.184.216.34", "10.0.0.5"]}
    assert check(policy, "https://docs.example.org/x", answers) == "93.184.216.34"
    assert check(policy, "https://rebind.example.org/x", answers) == "url_not_accessible"
    assert check(policy, "https://gone.example.org/x", answers) == "url_not_accessible"
    assert check(policy, "https://other.example.org/x", answers) == "url_not_allowed"
    assert check(policy, "https://docs.example.org:8443/x", answers) == "url_not_allowed"


def test_loopback_is_refused_even_when_the_allow_list_names_it() -> None:
    named = FetchPolicy(allow=["127.0.0.1", "localhost"], ports=[80, 8080])
    answers = {"localhost": ["127.0.0.1", "::1"]}
    assert check(named, "http://127.0.0.1:8080/", answers) == "url_not_accessible"
    assert check(named, "http://localhost:8080/", answers) == "url_not_accessible"
    exempt = FetchPolicy(allow=["127.0.0.1"], ports=[8080], allow_networks=["127.0.0.1/32"])
    assert check(exempt, "http://127.0.0.1:8080/", {}) == "127.0.0.1"
