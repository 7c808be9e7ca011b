"""What `web_fetch` may open: the URL, its host against the allow-list, and every address the name
resolves to. The model chooses the URL, and the model reads whatever a web page or a tool result
told it, so the URL is untrusted input: it is parsed here, never handed to a library that would
resolve it again, follow redirects or read `file:` URLs.

The checked address is the one connected to (http.py): a name is resolved once, every address it
resolves to must be public, and the connection goes to the first of them with the name only in the
`Host` header and the TLS server name. A second resolution (DNS rebinding) never happens.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from gateway.routing.table import FetchPolicy

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# (host, port) -> the addresses the name resolves to.
Resolver = Callable[[str, int], Awaitable[list[str]]]
MAX_URL = 2048
# NAT64 (RFC 6052) embeds an IPv4 address in its last 32 bits: it is checked as that address.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class Refused(Exception):
    """A URL the gateway does not open; `code` is Anthropic's `web_fetch_tool_result_error` code."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True)
class Target:
    """A parsed http(s) URL: what to connect to and what to ask for."""

    scheme: str
    host: str  # lower case, IDNA-encoded; an IPv6 literal without brackets
    port: int
    path: str  # path and query, never empty; no fragment

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        port = "" if self.port == default else f":{self.port}"
        return f"{self.scheme}://{host}{port}{self.path}"

    @property
    def host_header(self) -> str:
        return self.url.split("://", 1)[1].split("/", 1)[0]


def parse(url: str) -> Target:
    """An absolute http(s) URL without credentials, as a Target; Refused otherwise."""
    if not isinstance(url, str) or not url:
        raise Refused("invalid_tool_input", "the URL is missing")
    if len(url) > MAX_URL:
        raise Refused("url_too_long", f"URLs are limited to {MAX_URL} characters")
    if any(ch.isspace() or ord(ch) < 0x20 or ch == "\\" for ch in url):
        raise Refused("invalid_tool_input", "the URL holds whitespace, control characters or backslashes")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise Refused("invalid_tool_input", "the URL cannot be parsed") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise Refused("url_not_allowed", "only http and https URLs are fetched")
    if parts.username is not None or parts.password is not None:
        raise Refused("url_not_allowed", "URLs with credentials are not fetched")
    host = parts.hostname or ""
    if not host or "%" in host:
        raise Refused("invalid_tool_input", "the URL has no usable host")
    try:
        host = host.encode("idna").decode("ascii").lower() if not _literal(host) else host.lower()
    except UnicodeError:
        raise Refused("invalid_tool_input", "the URL's host is not a valid name") from None
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return Target(scheme, host.rstrip("."), port or (443 if scheme == "https" else 80), path)


def _literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _matches(host: str, pattern: str) -> bool:
    pattern = pattern.lower().rstrip(".")
    if pattern.startswith("*."):
        return host.endswith(pattern[1:]) and len(host) > len(pattern) - 1
    return host == pattern


def host_allowed(host: str, allow: Iterable[str]) -> bool:
    """The host is a name of the allow-list or a subdomain a `*.` pattern names."""
    return any(_matches(host, pattern) for pattern in allow)


def client_allows(host: str, allowed: Sequence[str] | None, blocked: Sequence[str] | None) -> bool:
    """A client's own `allowed_domains` / `blocked_domains` (Anthropic's tool fields): they narrow
    the operator's allow-list, never widen it. A domain names itself and its subdomains."""

    def within(domains: Sequence[str]) -> bool:
        return any(
            host == d.lower().rstrip(".") or host.endswith("." + d.lower().strip(".")) for d in domains
        )

    if allowed and not within(allowed):
        return False
    return not (blocked and within(blocked))


def networks(policy: FetchPolicy) -> list[Network]:
    return [ipaddress.ip_network(n, strict=False) for n in policy.allow_networks]


def address_allowed(address: Address, exempt: Sequence[Network] = ()) -> bool:
    """Public unicast only, unless an operator's network holds it: no loopback, private, link-local
    (169.254.169.254 and the other metadata services), shared (100.64/10), multicast, reserved or
    unspecified address, in IPv4 or in any IPv6 form that carries one (mapped, NAT64, 6to4,
    Teredo)."""
    if any(address in network for network in exempt):
        return True
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded(address)
        if embedded is not None:
            return address_allowed(embedded, exempt)
    return address.is_global and not address.is_multicast


def _embedded(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    return None


async def system_resolver(host: str, port: int) -> list[str]:
    """The host's addresses by the system's resolver (the event loop's getaddrinfo)."""
    import asyncio

    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True)
class Checked:
    """A target that passed every check, and the address to connect to."""

    target: Target
    address: str


class Guard:
    """The fetch policy of the table, applied to one URL at a time (redirects included)."""

    def __init__(self, policy: FetchPolicy, resolver: Resolver = system_resolver) -> None:
        self.policy = policy
        self.resolver = resolver
        self.exempt = networks(policy)

    async def check(
        self, url: str, allowed: Sequence[str] | None = None, blocked: Sequence[str] | None = None
    ) -> Checked:
        """The URL parsed, its host and port allowed, its name resolved and every address public."""
        target = parse(url)
        if not host_allowed(target.host, self.policy.allow) or not client_allows(
            target.host, allowed, blocked
        ):
            raise Refused("url_not_allowed", "the host is not on the gateway's fetch allow-list")
        if target.port not in self.policy.ports:
            raise Refused("url_not_allowed", f"port {target.port} is not one fetches may use")
        if _literal(target.host):
            found = [target.host]
        else:
            try:
                found = await self.resolver(target.host, target.port)
            except OSError:
                raise Refused("url_not_accessible", "the host name does not resolve") from None
        addresses = [ipaddress.ip_address(a.split("%", 1)[0]) for a in found]
        if not addresses:
            raise Refused("url_not_accessible", "the host name does not resolve")
        if not all(address_allowed(a, self.exempt) for a in addresses):
            # One private answer is enough to refuse: a name that mixes public and private
            # addresses is how a rebinding attack starts.
            raise Refused("url_not_accessible", "the host resolves to a private or reserved address")
        return Checked(target, str(addresses[0]))

    async def redirect(
        self, current: Target, location: str, allowed: Sequence[str] | None, blocked: Sequence[str] | None
    ) -> Checked:
        """A redirect's target, checked like the first URL (a relative one against the current)."""
        return await self.check(urljoin(current.url, location), allowed, blocked)
