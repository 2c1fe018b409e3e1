"""Who may call the server: API keys (each with a name, for per-key namespaces), and the Host and Origin
allow-lists (docs/usage/serve.md, "Access"). A key is compared with every key in constant time. The Host
check closes DNS rebinding (a page whose name now resolves to 127.0.0.1 sends its own name as Host), the
Origin check cross-site requests from browsers, as Ollama's checks after CVE-2024-28224 and Jupyter's
``allow_origin``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import stat
from dataclasses import dataclass, field
from pipeline.config.serve_options import API_KEY_ENVS, read_key_file

log = logging.getLogger("serve")

DEFAULT_NAME = "default"  # the name of the one key of --api-key / the environment, and of keyless requests


class Keys:
    """The accepted keys, by SHA-256 digest (the keys themselves are not kept)."""

    def __init__(self, keys: dict[str, str]):
        self.digests = [(hashlib.sha256(k.encode()).digest(), name) for k, name in keys.items()]

    def __bool__(self) -> bool:
        return bool(self.digests)

    def name_of(self, authorization: str) -> str | None:
        """The name of the key in an ``Authorization: Bearer KEY`` header, None when it is no key of ours.
        Every key is compared (in constant time each), so the time taken does not tell which one matched."""
        scheme, _, token = authorization.partition(" ")
        digest = hashlib.sha256(token.strip().encode()).digest()
        found = None
        for d, name in self.digests:
            if hmac.compare_digest(d, digest):
                found = name
        return found if scheme.lower() == "bearer" else None


def load_keys(api_key: str | None, api_key_file: str | None, env: dict | None = None) -> Keys:
    """The keys of the flags (checked before loading: pipeline.config.options) or the environment; warns about
    ``--api-key`` (every local user sees it in ``ps``) and a key file other users can read."""
    env = os.environ if env is None else env
    if api_key_file:
        mode = os.stat(api_key_file).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("--api-key-file %s can be read by other users (mode %o): chmod 600 it", api_key_file,
                        stat.S_IMODE(mode))
        return Keys(read_key_file(api_key_file))
    if api_key:
        log.warning("--api-key shows the key to every local user (ps, /proc): use --api-key-file or $%s instead",
                    API_KEY_ENVS[0])
        return Keys({api_key: DEFAULT_NAME})
    key = next((env[v] for v in API_KEY_ENVS if env.get(v)), None)
    return Keys({key: DEFAULT_NAME} if key else {})


@dataclass
class Access:
    """Which Host headers and browser Origins are served (anything else: 403)."""

    hosts: set[str] = field(default_factory=set)  # lower-case names without port; "*": any
    origins: set[str] = field(default_factory=set)  # "scheme://host[:port]", lower case; "*": any

    def host_ok(self, host_header: str | None) -> bool:
        if "*" in self.hosts or host_header is None:  # HTTP/1.0 without Host: no browser sends that
            return True
        name = host_name(host_header)
        # an IP address as Host cannot be a rebound name: a page at evil.example sends Host: evil.example
        return name in self.hosts or _ip(name) is not None or name.endswith(".localhost")

    def origin_ok(self, origin: str | None, host_header: str | None, scheme: str) -> bool:
        """No Origin (curl, SDKs): allowed. Else a listed origin, or the page's own origin (same-origin:
        its Host passed the Host check)."""
        if origin is None or "*" in self.origins:
            return True
        origin = origin.strip().lower().rstrip("/")
        if origin in self.origins:
            return True
        return host_header is not None and origin == f"{scheme}://{host_header.strip().lower()}"


def host_name(host_header: str) -> str:
    """``name[:port]`` or ``[v6][:port]`` -> the name or address, lower case, without brackets."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def make_access(bind_host: str, allowed_hosts: str | None, allowed_origins: str | None) -> Access:
    """Hosts: localhost, any IP address, the --serve host and, bound beyond loopback, this machine's
    names (the name clients of a cluster node use), plus ``--allowed-hosts``. Origins: ``--allowed-origins``."""
    hosts = {"localhost", host_name(bind_host)}
    if not loopback(bind_host):
        for name in (socket.gethostname(), socket.getfqdn()):
            hosts.add(name.lower())
    hosts |= {h.strip().lower() for h in (allowed_hosts or "").split(",") if h.strip()}
    origins = {o.strip().lower().rstrip("/") for o in (allowed_origins or "").split(",") if o.strip()}
    return Access(hosts, origins)


def origin_list(allowed_origins: str | None) -> list[str]:
    """--allowed-origins as given (for Starlette's CORSMiddleware)."""
    return [o.strip().rstrip("/") for o in (allowed_origins or "").split(",") if o.strip()]


def loopback(host: str) -> bool:
    return host == "localhost" or getattr(_ip(host), "is_loopback", False)
