"""Credentials in URLs, replaced wherever a URL is written.

A server URL may carry a user name and password (`http://user:key@host`), and URLs are written
into manifests, the experiment dir's copy of the experiment file, profiles, fit reports and
error messages, which are shared and committed: every such copy gets `<redacted>` in their
place. The API key of `--api-key-env` is read from the environment and written nowhere.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REDACTED = "<redacted>"
# scheme://userinfo@ : the userinfo ends at the last '@' before the path, query or fragment
_USERINFO = re.compile(r"(?P<scheme>\bhttps?://)(?P<userinfo>[^\s/?#@'\"]*(?:@[^\s/?#@'\"]*)*)@")


def has_credentials(url: str) -> bool:
    """Whether `url` names a user or a password."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    return parts.username is not None or parts.password is not None


def redact_url(url: str) -> str:
    """`url` with its user name and password replaced (unchanged when it has none)."""
    if not has_credentials(url):
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address keeps its brackets
        host = f"[{host}]"
    netloc = f"{REDACTED}@{host}" + (f":{parts.port}" if parts.port is not None else "")
    return urlunsplit(parts._replace(netloc=netloc))


def redact_text(text: str) -> str:
    """Every http(s) URL in `text` with its credentials replaced (a file kept as written, its
    comments included, but for the user:password of each URL)."""
    if "@" not in text:
        return text
    return _USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)


def redact_value(value: Any) -> Any:
    """A parsed document (JSON, TOML) with every string passed through `redact_text`."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {redact_value(k): redact_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact_value(v) for v in value)
    return value
