"""Make a CURVE key pair for KV events: ``python -m ucm_server.kv_events.keygen SECRET_FILE``.

Writes the secret key (40 Z85 characters) to ``SECRET_FILE``, mode 0600, refusing to overwrite one,
and prints the public key. The daemon's pair: ``kv_events_curve_secret_key_file`` names the file and
subscribers are given the public key. A subscriber's pair: its public key goes into
``kv_events_subscribers_file``, its secret key stays with the subscriber.
"""

from __future__ import annotations

import os
import sys

import zmq


def write_key_pair(path: str) -> bytes:
    """Create ``path`` (0600, never replacing a file) holding a new secret key; the public key."""
    public, secret = zmq.curve_keypair()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret + b"\n")
    return public


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    try:
        public = write_key_pair(args[0])
    except OSError as exc:
        print(f"keygen: {args[0]}: {exc.strerror}", file=sys.stderr)
        return 1
    print(public.decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
