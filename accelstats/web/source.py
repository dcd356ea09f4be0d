"""The web configuration in force, reloaded while the exporter runs (``--web-config FILE``).

Files are looked at by a thread of their own (:class:`WebConfigSource`), so that the HTTP server's
event loop never blocks on one (a FIFO named as a certificate, a hung network mount); every file is
read only when it is a regular file of bounded size (:mod:`accelstats.web.config`). A reload never
lowers security (:func:`~accelstats.web.checks.weakening`): a changed file that is broken or would
turn basic auth or TLS off, switch to HTTPS, or lower ``client_auth_type`` or ``min_version`` is
refused, the configuration in force stays, one error is logged and counted; those changes take a
restart. :func:`~accelstats.web.checks.security_warnings` are logged at start and at every reload.
"""

from __future__ import annotations

import logging
import ssl
import threading
import weakref
from pathlib import Path

from accelstats.web.checks import security_warnings, weakening
from accelstats.web.config import (
    WebConfig,
    WebConfigError,
    _Parser,
    build_ssl_context,
    load_web_config,
)

log = logging.getLogger(__name__)


_Stat = tuple[int, int, int, int] | None


def _stat(path: Path) -> _Stat:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)


def _signature(paths: tuple[Path, ...]) -> tuple[_Stat, ...]:
    return tuple(_stat(path) for path in paths)


CHECK_INTERVAL = 1.0  # seconds: the checking thread looks at the files at least this often
REQUEST_WAIT = 0.25  # seconds a request waits for the check it starts (never for one already running)


class WebConfigSource:
    """The web configuration in force, reloaded when the file or a file it names changes.

    Construction loads and checks everything in the caller's thread (raises :class:`WebConfigError`),
    logs the warnings and starts one daemon thread, ``accelstats-web-config``, which alone looks at the
    files from then on (``tls_enabled`` is fixed at start). It ``stat``-s the watched files when
    :meth:`current` asks and at least every :data:`CHECK_INTERVAL` seconds, before reading them (a
    change made while reading is seen next time), and reloads when one changed: a change that loads in
    full and does not weaken security applies; another is refused: one error naming the file, the key
    and the reason, and ``reload_failures`` (``accelstats_web_config_reload_failures_total``) goes up.
    :meth:`current` never touches a file: a hung mount stalls the checking thread alone. The thread
    ends after :meth:`close`, or within :data:`CHECK_INTERVAL` once nothing refers to the source.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reload_failures = 0
        self.refused: WebConfigError | None = None  # why the file on disk is not the one in force
        seen = {path: _stat(path)}
        config = load_web_config(path)
        files = self._files(config)
        seen.update({f: _stat(f) for f in files if f not in seen})
        self._state = (config, build_ssl_context(config) if config.tls else None)
        self.initial = config  # as loaded at start-up
        self.tls_enabled = config.tls is not None
        self._watched = files
        self._sig = tuple(seen[f] for f in files)
        for line in security_warnings(config):
            log.warning("%s", line)
        self._cond = threading.Condition()
        self._wanted = False  # a check was asked for and has not started
        self._started = 0  # checks begun by the checking thread
        self._finished = 0  # of which finished
        self._closed = False
        self._last_bug = ""
        threading.Thread(target=_check_loop, args=(weakref.ref(self),), name="accelstats-web-config",
                         daemon=True).start()

    def _files(self, config: WebConfig) -> tuple[Path, ...]:
        return (self.path,) + (config.tls.files() if config.tls else ())

    def _reload(self, seen: dict[Path, _Stat]) -> None:
        """Try the files as they are now (``seen``: their signatures, taken before reading)."""
        old = self._state[0]
        watched = list(self._files(old))
        try:
            config = load_web_config(self.path)
            for f in self._files(config):  # watched even when refused: fixing a new key file retries
                if f not in seen:
                    seen[f] = _stat(f)
                if f not in watched:
                    watched.append(f)
            why = weakening(old, config)
            if why is not None:
                raise _Parser(self.path).error(*why)
            state = (config, build_ssl_context(config) if config.tls else None)
        except WebConfigError as exc:
            self.reload_failures += 1
            self.refused = WebConfigError(str(exc))  # without the traceback, whose frames hold this source
            log.error("%s; change refused, the configuration loaded before stays in force", exc)
        else:
            self._state, self.refused = state, None
            watched = list(self._files(config))
            log.info("web config %s reloaded", self.path)
            for line in security_warnings(config):
                log.warning("%s", line)
        self._watched = tuple(watched)
        self._sig = tuple(seen[f] if f in seen else _stat(f) for f in self._watched)

    def _check(self) -> None:
        """One look at the watched files (checking thread only): reload when one changed."""
        sig = _signature(self._watched)
        if sig != self._sig:
            self._reload(dict(zip(self._watched, sig, strict=True)))

    def _next_check(self) -> bool:
        """Wait until a check is asked for or :data:`CHECK_INTERVAL` passed, and count it begun; False
        once closed."""
        with self._cond:
            if not self._wanted and not self._closed:
                self._cond.wait(CHECK_INTERVAL)
            if self._closed:
                return False
            self._wanted = False
            self._started += 1
            return True

    def _check_done(self) -> None:
        with self._cond:
            self._finished += 1
            self._cond.notify_all()

    def current(self, wait: float = 0.0) -> tuple[WebConfig, ssl.SSLContext | None]:
        """``(config, ssl_context)`` in force (context None without TLS): the last configuration that
        loaded in full without lowering security. Never raises after construction, never reads a file.

        It asks the checking thread to look at the files. ``wait`` (seconds; 0: return at once, as the
        event loop does) is the longest it waits for that check when the thread was idle, so that a
        request (:class:`accelstats.web.auth.BasicAuth` passes :data:`REQUEST_WAIT`) sees a change
        made before it. It never waits while a check is running (perhaps stuck on a file, or one a
        busy server keeps asking for): such a request is served with the configuration in force,
        and the change applies to requests after that check."""
        with self._cond:
            idle = self._started == self._finished
            if not self._wanted:
                self._wanted = True
                self._cond.notify_all()
            if wait > 0 and idle:
                target = self._started + 1  # the check that starts after this call
                self._cond.wait_for(lambda: self._finished >= target, wait)
        return self._state

    def in_force(self) -> tuple[WebConfig, ssl.SSLContext | None]:
        """``(config, ssl_context)`` in force, without asking for a check: what the event loop hands each
        TLS handshake (a connection flood must not make the checking thread look at the files once per
        connection; a new certificate applies within :data:`CHECK_INTERVAL`)."""
        return self._state

    def sync(self, timeout: float = 10.0) -> bool:
        """Wait until a check that began after this call has finished (a change made before the call is
        then applied or refused); False after ``timeout`` seconds (the thread is stuck on a file)."""
        with self._cond:
            target = self._started + 1
            self._wanted = True
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._finished >= target, timeout)

    def close(self) -> None:
        """Stop the checking thread (after the check it may be running); the configuration in force
        stays as it is."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _check_loop(ref: weakref.ref[WebConfigSource]) -> None:
    """The checking thread's body. It holds the source only while waiting or checking, so a source
    that nothing else refers to is collected and the thread ends."""
    while True:
        source = ref()
        if source is None or not source._next_check():
            return
        try:
            source._check()
        except Exception as exc:  # noqa: BLE001 - a bug must not end reloading; WebConfigError is handled inside
            what = f"{type(exc).__name__} while checking for changes"  # the type: a message may quote a file
            if what != source._last_bug:  # logged once, not every second
                log.error("web config %s: %s; the configuration in force stays", source.path, what)
            source._last_bug = what
        else:
            source._last_bug = ""
        finally:
            source._check_done()
        del source
