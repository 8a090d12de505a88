"""Who may change anything, decided by pure functions.

- Bound to a non-loopback address, the dashboard refuses to start without a token (from
  SKIPLOCK_DASHBOARD_TOKEN) unless it is read-only: anyone who can reach the port could
  otherwise retry, cancel or delete jobs.
- With a token, every request needs it: a ``Authorization: Bearer`` header, or the cookie
  that the sign-in form sets (it holds a digest of the token, never the token itself).
- Every request names a host the dashboard serves (``Host``): localhost, an IP address,
  or a name allowed by ``--allowed-host`` / ``allowed_hosts``. A page of another site can
  point its own name at 127.0.0.1 (DNS rebinding); the browser then treats the dashboard
  as that site's and lets the page's scripts read it, but still sends the site's name.
  An IP address cannot be rebound: only a name can.
- Every POST carries a CSRF token: a random value in a cookie that a page of another site
  cannot read, repeated in a form field (double submit). A request whose Origin names
  another host, or a host not served, is refused as well.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
from collections.abc import Collection, Iterable
from urllib.parse import urlsplit

from skiplock.errors import ConfigurationError

TOKEN_ENV = "SKIPLOCK_DASHBOARD_TOKEN"
CSRF_COOKIE = "skiplock_csrf"
CSRF_FIELD = "csrf"
AUTH_COOKIE = "skiplock_auth"
ALLOWED_HOSTS_ENV = "SKIPLOCK_DASHBOARD_ALLOWED_HOSTS"
ALLOW_HOST_HINT = (
    "skiplock dashboard --allowed-host {name} (or ${env}, or create_app(allowed_hosts=[...]))"
)
# A host name as a browser sends it (IDNA names arrive in their ASCII form).
_HOST_NAME = re.compile(r"^[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?$")


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach: 127.0.0.0/8, ::1, localhost."""
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_startup(host: str, *, token: str | None, read_only: bool) -> None:
    """Refuse a configuration that would let anyone on the network change jobs."""
    if is_loopback(host) or read_only or token:
        return
    raise ConfigurationError(
        f"the dashboard would listen on {host}, which other machines can reach, and let "
        f"anyone change jobs: set ${TOKEN_ENV} to a long random value, or pass --read-only"
    )


def new_csrf_token() -> str:
    return secrets.token_urlsafe(32)


def same_token(given: str | None, expected: str | None) -> bool:
    """Constant-time equality; a missing or empty value never matches."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def auth_cookie_value(token: str) -> str:
    """What the sign-in cookie holds: a digest, so the cookie never reveals the token."""
    return hashlib.sha256(b"skiplock-dashboard\0" + token.encode()).hexdigest()


def bearer(header: str | None) -> str | None:
    if header and header[:7].lower() == "bearer ":
        return header[7:].strip()
    return None


def authorized(token: str | None, *, header: str | None, cookie: str | None) -> bool:
    """Whether a request may proceed: always without a token configured."""
    if not token:
        return True
    return same_token(bearer(header), token) or same_token(cookie, auth_cookie_value(token))


def allowed_hosts(names: Iterable[str]) -> frozenset[str]:
    """The configured host names, normalised as ``host_name`` reads a header; a value
    that is not a bare host name (a scheme, a port, a path, a pattern) is refused."""
    if isinstance(names, str):
        raise ConfigurationError(
            f"allowed_hosts takes a list of host names, got the string {names!r}"
        )
    found = set()
    for given in names:
        text = str(given).strip().lower().rstrip(".")
        try:
            text = text.encode("idna").decode("ascii")
        except UnicodeError:
            text = ""
        if not _HOST_NAME.fullmatch(text) and not is_ip_address(text):
            raise ConfigurationError(
                f"allowed host {given!r} is not a host name: give the name as the browser's "
                "address bar shows it, without scheme, port or path, e.g. queue.example.com"
            )
        found.add(text.strip("[]"))
    return frozenset(found)


def is_ip_address(text: str) -> bool:
    """True for an IPv4 or IPv6 address (brackets allowed), which no DNS answer makes."""
    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return False
    return True


def host_name(authority: str | None) -> str | None:
    """The host name of a Host header or an Origin's authority (``name[:port]``),
    lower-case, without its port, the brackets of an IPv6 address or a trailing dot; None
    when the value is not one."""
    if not authority or any(char in authority for char in "@/?#\\ \t\r\n"):
        return None
    try:
        parts = urlsplit("//" + authority)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number
    except ValueError:
        return None
    name = (parts.hostname or "").rstrip(".")
    if is_ip_address(name):
        return name
    return name if _HOST_NAME.fullmatch(name) else None


def host_allowed(name: str | None, allowed: Collection[str]) -> bool:
    """Whether the dashboard serves ``name``: localhost, any IP address (no DNS answer
    can make a browser send one for another site's page) and the names allowed."""
    if name is None:
        return False
    return name == "localhost" or is_ip_address(name) or name in allowed


def host_refusal(authority: str | None) -> str:
    """Why a request for a host not served is refused, and how to allow it."""
    name = host_name(authority)
    if name is None:
        return (
            f"refused: the request's Host header ({authority!r}) names no host: "
            "the dashboard answers requests for localhost, its IP addresses and the names "
            "allowed with " + ALLOW_HOST_HINT.format(name="NAME", env=ALLOWED_HOSTS_ENV)
        )
    return (
        f"refused: this dashboard does not serve the host name {name!r} (the request's "
        "Host header). A page of another site can point its name at this machine (DNS "
        "rebinding), so only localhost, IP addresses and the names allowed are served. "
        "If you reach the dashboard by this name, allow it: "
        + ALLOW_HOST_HINT.format(name=name, env=ALLOWED_HOSTS_ENV)
    )


def origin_refusal(
    origin: str | None, hosts: Iterable[str | None], allowed: Collection[str]
) -> str | None:
    """Why a POST's Origin is refused, or None when it is not. A browser's POST from a
    page of another site names that site in Origin: it must be a host the dashboard
    serves (``host_allowed``) and the host the request was sent to (Host, or the
    X-Forwarded-Host of a proxy). No Origin (older clients, curl) leaves the CSRF token
    as the check."""
    if origin is None:
        return None
    netloc = urlsplit(origin).netloc.lower() if origin != "null" else ""
    name = host_name(netloc)
    if name is None:
        return f"refused: the request came from another site ({origin})"
    if not host_allowed(name, allowed):
        return (
            f"refused: the request came from another site ({origin}), a name this "
            "dashboard does not serve; if you reach the dashboard by that name, allow it: "
            + ALLOW_HOST_HINT.format(name=name, env=ALLOWED_HOSTS_ENV)
        )
    if not any(host and netloc == host.strip().lower() for host in hosts):
        return f"refused: the request came from another site ({origin})"
    return None
