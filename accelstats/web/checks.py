"""What a web configuration reload may not do, and what an operator should be warned of
(:mod:`accelstats.web.config` loads the file; :mod:`accelstats.web.source` applies these checks).

:func:`weakening` names the change a running exporter refuses (basic auth or TLS off, TLS switched on,
a lower ``client_auth_type`` or ``min_version``): those take a restart. :func:`security_warnings`
lists basic auth on plain HTTP, a world-writable file, a world-readable private key and a certificate
outside its validity period (:func:`certificate_validity`).
"""

from __future__ import annotations

import stat
from datetime import datetime, timezone
from pathlib import Path

from cryptography import x509

from accelstats.web.config import BCRYPT_WARN_COST, TLS_VERSIONS, WebConfig, _key_name, _read_bytes, _redact

_CLIENT_AUTH_RANK = {"NoClientCert": 0, "VerifyClientCertIfGiven": 1, "RequireAndVerifyClientCert": 2}
_TLS_NAMES = {v: k for k, v in TLS_VERSIONS.items()}


def weakening(old: WebConfig, new: WebConfig) -> tuple[str, str] | None:
    """``(key, reason)`` when ``new`` may not replace ``old`` while running, else None: TLS turned off or
    on (the listening socket is plain or not), basic auth turned off, ``client_auth_type``
    (RequireAndVerifyClientCert > VerifyClientCertIfGiven > NoClientCert) or ``min_version`` lowered. A
    file written in place is briefly empty or cut short, and so looks like each of these. Fewer users,
    other passwords, headers or certificates are not a weakening."""
    if (old.tls is None) != (new.tls is None):
        return ("tls_server_config", "removed (or empty): turning TLS off needs a restart" if new.tls is None
                else "added: switching from HTTP to HTTPS needs a restart")
    if old.users and not new.users:
        return "basic_auth_users", "removed (or empty): turning basic auth off needs a restart"
    if old.tls is not None and new.tls is not None:
        before, after = old.tls.client_auth_type, new.tls.client_auth_type
        if _CLIENT_AUTH_RANK[after] < _CLIENT_AUTH_RANK[before]:
            return "tls_server_config.client_auth_type", f"lowered from {before} to {after}: needs a restart"
        if new.tls.min_version < old.tls.min_version:
            return ("tls_server_config.min_version", f"lowered from {_TLS_NAMES[old.tls.min_version]} to "
                    f"{_TLS_NAMES[new.tls.min_version]}: needs a restart")
    return None


def certificate_validity(path: Path) -> tuple[datetime, datetime] | None:
    """``(notBefore, notAfter)`` in UTC of the first PEM certificate in ``path`` (the server's own
    certificate: the chain follows it; RFC 5280 4.1.2.5), read by pyca/cryptography; None when the file
    cannot be read or parsed (OpenSSL reports a bad certificate when it loads it)."""
    try:
        cert = x509.load_pem_x509_certificate(_read_bytes(path))
    except (OSError, ValueError):
        return None
    return cert.not_valid_before_utc, cert.not_valid_after_utc


def _open_to_others(path: Path, bit: int) -> int | None:
    """``path``'s mode when it has ``bit`` (``S_IROTH``, ``S_IWOTH``) and every directory above the
    file it names is searchable by others (so that every user can reach it), else None."""
    try:
        real = path.resolve()
        mode = real.stat().st_mode
        if not mode & bit:
            return None
        if not all(parent.stat().st_mode & stat.S_IXOTH for parent in real.parents):
            return None
    except OSError:
        return None
    return mode


def security_warnings(config: WebConfig, now: datetime | None = None) -> list[str]:
    """One line per risk in ``config`` (naming the file, never a value from it): users whose bcrypt cost
    is above :data:`BCRYPT_WARN_COST` (one line for all of them: each check costs 0.5 s or more), the web config
    writable by every user (anyone on the host could add a user or swap the certificate), the private
    key readable by every user (a file mode that allows it, in directories that every user can
    search: a 0644 key under a 0700 directory is not reported), the server certificate expired or not
    yet valid at ``now`` (default: the current time; clients refuse it, as Go's and OpenSSL's verifiers
    do), basic auth without TLS (every scrape sends the password in clear: base64, RFC 7617 section 4)."""
    out = []
    if config.users and config.tls is None:
        out.append(f"web config {config.path}: basic_auth_users without tls_server_config: passwords travel in "
                   "clear text on plain HTTP (anyone on the path can read them); add tls_server_config")
    costly = [name for name, hashed in config.users if int(hashed[4:6]) > BCRYPT_WARN_COST]
    if costly:
        names = ", ".join(_key_name(n, 40) for n in costly[:5])
        names += f" and {len(costly) - 5} more" if len(costly) > 5 else ""
        out.append(_redact(f"web config {config.path}: basic_auth_users: bcrypt cost above {BCRYPT_WARN_COST} for "
                           f"{names}: each first login, wrong password and unknown user name costs 0.5 s of a CPU "
                           "or more (cost 13; each step doubles it), and unknown users are checked at the highest "
                           "cost configured; cost 10-12 is usual"))
    mode = _open_to_others(config.path, stat.S_IWOTH)
    if mode is not None:
        out.append(f"web config {config.path}: writable by every user on this host (mode "
                   f"{stat.S_IMODE(mode):04o}): anyone here can add a user or change the certificate; chmod o-w")
    if config.tls is not None:
        where = f"web config {config.path}: tls_server_config."
        mode = _open_to_others(config.tls.key_file, stat.S_IROTH)
        if mode is not None:
            out.append(f"{where}key_file: {config.tls.key_file}: readable by every user on this host (mode "
                       f"{stat.S_IMODE(mode):04o}): anyone here can read the private key; chmod o-r")
        validity = certificate_validity(config.tls.cert_file)
        now = now or datetime.now(timezone.utc)
        if validity is not None and now > validity[1]:
            out.append(f"{where}cert_file: {config.tls.cert_file}: the certificate expired on "
                       f"{validity[1]:%Y-%m-%d %H:%M:%S} UTC: clients will refuse it")
        elif validity is not None and now < validity[0]:
            out.append(f"{where}cert_file: {config.tls.cert_file}: the certificate is not valid before "
                       f"{validity[0]:%Y-%m-%d %H:%M:%S} UTC: clients will refuse it until then")
    return out
