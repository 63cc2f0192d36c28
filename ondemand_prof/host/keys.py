"""CurveZMQ keys for ondemand-profd's TCP listener and for ondemandctl across hosts.

A key directory (`ondemandctl keygen DIR`; every file 0600, the directories 0700):

    DIR/server.key, DIR/server.key_secret     the daemons' key pair (the same on every host, or per host:
                                               DIR/servers/<host>.key overrides the public key the CLI expects)
    DIR/client.key, DIR/client.key_secret     ondemandctl's key pair
    DIR/authorized/*.key                      the client public keys a daemon accepts

Everything is checked at each load: regular files and directories (no symlinks), owned by us or root, secret
keys unreadable by group and others, public keys and directories not writable by them (a writable
authorized/ would let anyone add a key). KeyFileError says what is wrong and how to fix it.

The ZAP handler (ZapHandler) runs on the daemon's own loop: one REP socket on the same poller, no thread.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85

log = logging.getLogger("ondemand_prof.host.keys")

SERVER = "server"
CLIENT = "client"
AUTHORIZED = "authorized"
SERVERS = "servers"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"ondemand_prof"


class KeyFileError(Exception):
    """A key file or directory that is missing or unsafe; the text says how to fix it."""


def _check(path: Path, *, secret: bool = False, directory: bool = False) -> None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise KeyFileError(f"{path} does not exist (create keys with: ondemandctl keygen {path.parent})") from None
    except OSError as exc:
        raise KeyFileError(f"{path}: {exc.strerror}") from None
    kind = stat.S_ISDIR if directory else stat.S_ISREG
    if not kind(st.st_mode):
        raise KeyFileError(f"{path} is not a {'directory' if directory else 'regular file'} (symlinks are refused)")
    if st.st_uid not in (os.getuid(), 0):
        raise KeyFileError(f"{path} belongs to uid {st.st_uid}, not to us (uid {os.getuid()}) or root")
    mode = stat.S_IMODE(st.st_mode)
    if secret and mode & 0o077:
        raise KeyFileError(f"{path} is readable by others (mode {mode:o}): a secret key must be owner-only; "
                           f"chmod 600 {path}, and consider the key leaked")
    if mode & 0o022:
        raise KeyFileError(f"{path} is writable by group or others (mode {mode:o}); chmod go-w {path}")


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    _check(path, secret=secret)
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"{path}: not a key file: {exc}") from None
    if secret and not secret_key:
        raise KeyFileError(f"{path} holds no secret key")
    return public, secret_key


@dataclass(frozen=True)
class KeyPair:
    public: bytes
    secret: bytes


def load_pair(key_dir: Path, name: str) -> KeyPair:
    _check(key_dir, directory=True)
    public, secret = _load(key_dir / f"{name}.key_secret", secret=True)
    assert secret is not None
    return KeyPair(public, secret)


def server_public_key(key_dir: Path, host: str) -> bytes:
    """The public key the daemon at `host` must prove it holds: DIR/servers/<host>.key, else DIR/server.key."""
    own = key_dir / SERVERS / f"{host}.key"
    if own.exists():
        return _load(own, secret=False)[0]
    return _load(key_dir / f"{SERVER}.key", secret=False)[0]


def authorized_keys(key_dir: Path) -> dict[bytes, str]:
    """Public key (z85) -> the file that authorises it."""
    adir = key_dir / AUTHORIZED
    _check(adir, directory=True)
    keys = {}
    for path in sorted(adir.glob("*.key")):
        keys[_load(path, secret=False)[0]] = path.name
    return keys


def keygen(key_dir: Path, client_only: bool = False) -> list[Path]:
    """Create what is missing: the server pair, the client pair, and the client's authorisation (with
    `client_only`, the client pair alone: a user's own keys, authorised by copying client.key into the daemons'
    authorized/ directory). Existing keys are kept (a second run never replaces a key hosts already trust).
    Returns the new files."""
    client = CLIENT
    created: list[Path] = []
    old = os.umask(0o077)  # the files are never, even briefly, readable by others
    try:
        for d in (key_dir,) if client_only else (key_dir, key_dir / AUTHORIZED):
            try:
                d.mkdir(mode=0o700, parents=True)
            except FileExistsError:
                _owned_dir(d)  # checked before anything is changed: a squatter's directory is never chmodded
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)  # the directory checked, not a link
            try:
                os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
            _check(d, directory=True)
        for name in (client,) if client_only else (SERVER, client):
            if not (key_dir / f"{name}.key_secret").exists():
                created += [Path(p) for p in zmq.auth.create_certificates(key_dir, name)]
        auth = key_dir / AUTHORIZED / f"{client}.key"
        if not client_only and not auth.exists():
            auth.write_bytes((key_dir / f"{client}.key").read_bytes())
            created.append(auth)
        for path in created:
            os.chmod(path, 0o600)
    finally:
        os.umask(old)
    return created


def _owned_dir(path: Path) -> None:
    """An existing key directory must be a directory of ours (or root's), not a symlink; KeyFileError says why."""
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise KeyFileError(f"{path} is not a directory (symlinks are refused)")
    if st.st_uid not in (os.getuid(), 0) or (os.getuid() != 0 and st.st_uid == 0):
        raise KeyFileError(f"{path} belongs to uid {st.st_uid}, not to us (uid {os.getuid()}): choose another "
                           "directory")


class ZapHandler:
    """ZAP (RFC 27) on the daemon's loop: accept a CURVE client whose public key is in DIR/authorized/.

    The authorised keys are read again whenever the directory changes, so adding or removing a key file takes
    effect at the next connection without a restart. A refusal is logged with the client's address."""

    def __init__(self, key_dir: Path) -> None:
        self.key_dir = key_dir
        self._stamp: tuple[int, int] | None = None
        self.keys: dict[bytes, str] = {}
        self.refused = 0
        self._reload()

    def _reload(self) -> None:
        adir = self.key_dir / AUTHORIZED
        st = adir.stat()
        stamp = (st.st_mtime_ns, st.st_ino)
        if stamp != self._stamp:
            self.keys = authorized_keys(self.key_dir)
            self._stamp = stamp
            log.info("ondemand-profd: %d authorised client key(s) in %s", len(self.keys), adir)

    def reply(self, frames: list[bytes]) -> list[bytes]:
        """One ZAP request's frames -> the reply's frames."""
        if len(frames) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism = frames[:6]
        addr = address.decode(errors="replace")
        if mechanism != b"CURVE" or len(frames) < 7:
            log.warning("ondemand-profd: refused a %s connection from %s: only CURVE clients are served on TCP",
                        mechanism.decode(errors="replace"), addr)
            return [version, request_id, b"400", b"CURVE required", b"", b""]
        try:
            self._reload()
        except (OSError, KeyFileError) as exc:
            log.error("ondemand-profd: refusing every TCP client: %s", exc)
            self.keys = {}
        key = zmq.utils.z85.encode(frames[6])
        name = self.keys.get(key)
        if name is None:
            self.refused += 1
            log.warning("ondemand-profd: refused a client from %s: its public key %s is not in %s", addr,
                        key.decode(), self.key_dir / AUTHORIZED)
            return [version, request_id, b"400", b"key not authorised", b"", b""]
        log.debug("ondemand-profd: client %s from %s authenticated", name, addr)
        return [version, request_id, b"200", b"OK", name.encode(), b""]
