"""Who may change anything, decided by pure functions.

- Bound to a non-loopback address, the dashboard refuses to start without a token (from
  SKIPLOCK_DASHBOARD_TOKEN) unless it is read-only: anyone who can reach the port could
  otherwise retry, cancel or delete jobs.
- With a token, every request needs it: a ``Authorization: Bearer`` header, or the cookie
  that the sign-in form sets (it holds a digest of the token, never the token itself).
- Every POST carries a CSRF token: a random value in a cookie that a page of another site
  cannot read, repeated in a form field (double submit). A request whose Origin names
  another host is refused as well.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from urllib.parse import urlsplit

from skiplock.errors import ConfigurationError

TOKEN_ENV = "SKIPLOCK_DASHBOARD_TOKEN"
CSRF_COOKIE = "skiplock_csrf"
CSRF_FIELD = "csrf"
AUTH_COOKIE = "skiplock_auth"


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


def origin_allowed(origin: str | None, host: str | None) -> bool:
    """A browser's POST from a page of another site names that site in Origin: refuse it.
    No Origin (older clients, curl) leaves the CSRF token as the check."""
    if origin is None:
        return True
    if origin == "null" or not host:
        return False
    return urlsplit(origin).netloc.lower() == host.lower()
