"""Signed contributions: each learner signs its stream entries with its own secret.

The signature is HMAC-SHA-256 (standard library) over the run name and every field of the
entry but the payload itself and the signature — the payload is covered through its
``sha256`` field, which the syncer checks against the payload before using it. It travels in
the entry's ``sig`` field (hex). The syncer holds one key per learner (a folder of
``<learner>.sign`` files, `diloco keys`), verifies before anything else, and dead-letters an
entry that is unsigned, signed by a learner it has no key for, or whose signature does not
match: a stranger with write access to the streams can neither inject a contribution nor
pre-empt a learner's (learner, base version, step) so that its real push is dropped as a
duplicate. Deleting a learner's file on the syncers' hosts (and restarting them) revokes it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from broker.ids import as_text

log = logging.getLogger("diloco.signing")

SIG_FIELD = "sig"
CLOCK_SKEW_S = 60.0  # hosts' clocks may differ by this much (a signed heartbeat's age)
KEY_BYTES = 32
_SKIP = {"payload", SIG_FIELD}
_MAX_FIELDS = 64
_MAX_FIELD_BYTES = 4096


class SignatureError(ValueError):
    """An entry that is unsigned, from a learner without a key, or whose signature fails."""


def _message(run: str, fields: Mapping) -> bytes:
    items = []
    for k, v in fields.items():
        key = as_text(k)
        if key in _SKIP or key.startswith("payload:"):  # the payload's pieces: `sha256` is signed
            continue
        if len(items) >= _MAX_FIELDS:
            raise SignatureError(f"over {_MAX_FIELDS} fields")
        raw = v if isinstance(v, bytes) else str(v).encode()
        if len(raw) > _MAX_FIELD_BYTES:
            raise SignatureError(f"field {key!r} is over {_MAX_FIELD_BYTES} bytes")
        items.append((key.encode(), raw))
    items.sort()
    parts = [b"diloco-entry-v1", run.encode()]
    for k, raw in items:
        parts += [k, raw]
    # length-prefixed, so no two field sets give the same message
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def sign(key: bytes, run: str, fields: Mapping) -> str:
    """The hex signature of an entry's `fields` (as `broker.entries.entry_fields` builds them)."""
    return hmac.new(key, _message(run, fields), hashlib.sha256).hexdigest()


def signed(key: bytes, run: str, fields: dict) -> dict:
    """`fields` with its ``sig`` field added."""
    return {**fields, SIG_FIELD: sign(key, run, fields)}


def _record_message(run: str, kind: str, learner: str, rec: Any) -> bytes:
    body = {k: v for k, v in rec.to_dict().items() if k != SIG_FIELD}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return _message(run, {"kind": kind, "learner": learner, "record": text})


def sign_epoch(key: bytes, run: str, learner: str, epoch: int) -> str:
    """The hex signature of `learner`'s claim of `epoch` (``broker.registry.claim_epoch``):
    only a process holding the learner's key can make another one of it stand down."""
    fields = {"learner": learner, "epoch": str(int(epoch))}
    message = b"diloco epoch claim\n" + _message(run, fields)
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign_record(key: bytes, run: str, kind: str, learner: str, rec: Any) -> Any:
    """`rec` (a report of `broker.records` with a ``sig`` field) signed by its learner."""
    sig = hmac.new(key, _record_message(run, kind, learner, rec), hashlib.sha256).hexdigest()
    return replace(rec, sig=sig)


class Verifier:
    """The syncer's learner keys: a folder of ``<learner>.sign`` files (re-read when an
    unknown learner shows up, at most every `rescan_s`, so learners can be added live)."""

    def __init__(self, folder: str | Path, rescan_s: float = 5.0,
                 heartbeat_max_age_s: float | None = None):
        self.folder = Path(folder)
        self.rescan_s = rescan_s
        # a signed heartbeat stamped longer ago is not counted: a copy of an old one written
        # back (a learner credential may write the learners' records) does not keep its
        # learner alive
        self.heartbeat_max_age_s = heartbeat_max_age_s
        self._keys: dict[str, bytes] = {}
        self._scanned = -1e18
        self._load()
        if not self._keys:
            raise ValueError(f"no learner signing keys (*.sign) in {self.folder}")

    def _load(self) -> None:
        """(Re)read the folder; a file being copied in or a bad one is skipped (logged), and a
        folder that is briefly gone or empty keeps the keys already known."""
        self._scanned = time.monotonic()
        keys = {}
        try:
            paths = sorted(self.folder.glob("*.sign"))
        except OSError as e:
            log.warning("cannot list %s (%s); keeping the %d keys known", self.folder, e,
                        len(self._keys))
            return
        for path in paths:
            try:
                keys[path.stem] = read_key(path)
            except (OSError, ValueError) as e:
                log.warning("signing key %s skipped: %s", path, e)
        if keys or not self._keys:
            self._keys = {**keys} if keys else self._keys

    def knows(self, learner: str) -> bool:
        """True when `learner` has a signing key here (re-reading the folder at most every
        `rescan_s`)."""
        if learner not in self._keys and time.monotonic() - self._scanned > self.rescan_s:
            self._load()
        return learner in self._keys

    def record_ok(self, run: str, kind: str, learner: str, rec: Any) -> bool:
        """True when `rec` (a learner's report) is signed by `learner`'s key."""
        if not self.knows(learner) or not getattr(rec, SIG_FIELD, ""):
            return False
        if kind == "heartbeat" and self.heartbeat_max_age_s is not None and not (
                time.time() - float(getattr(rec, "t", 0.0)) <= self.heartbeat_max_age_s):
            return False
        want = sign_record(self._keys[learner], run, kind, learner, rec).sig
        return hmac.compare_digest(want.encode(), str(rec.sig).encode())

    def verify(self, run: str, fields: Mapping) -> str:
        """The learner an entry is from, once its signature checks.

        Raises:
            SignatureError: With the reason (unsigned, unknown learner, bad signature).
        """
        learner = as_text(fields.get(b"learner", fields.get("learner", b"")))
        got = fields.get(SIG_FIELD.encode(), fields.get(SIG_FIELD))
        if got is None:
            raise SignatureError("unsigned entry")
        key = self._keys[learner] if self.knows(learner) else None
        if key is None:
            raise SignatureError(f"no signing key for learner {learner[:64]!r}")
        got = got if isinstance(got, bytes) else str(got).encode()
        if not hmac.compare_digest(got, sign(key, run, fields).encode()):
            raise SignatureError(f"bad signature for learner {learner[:64]!r}")
        return learner


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def write_key(path: Path, key: bytes) -> None:
    """Write a key file (hex, mode 600 from the start; never over an existing file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key.hex() + "\n")


def write_private(path: str | Path, text: str) -> None:
    """Write a secret file: a new temporary file, mode 600 from its creation (no symlink
    followed), renamed over `path` — an existing file's mode never applies to the secret."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_key(path: str | Path) -> bytes:
    """Read a key file written by `write_key`.

    Raises:
        ValueError: Not a key file.
    """
    text = Path(path).read_text(encoding="ascii", errors="replace").strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{path} is not a signing key file") from None
    if len(key) != KEY_BYTES:
        raise ValueError(f"{path}: a signing key has {KEY_BYTES} bytes, this one {len(key)}")
    return key
