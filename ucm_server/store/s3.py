"""The S3 tier: one object per block in an S3-compatible object store (AWS S3, Ceph RGW, MinIO...).

Objects are named ``<prefix>/<namespace hex>/<key hex>`` and hold the 128-byte header of
:mod:`ucm_server.store.format` followed by the payload. An S3 PUT replaces an object atomically, so two
daemons writing one block leave exactly one of their versions; the header and checksum are verified on
every read anyway, so an object damaged or written by something else is reported FAILED, never served.

boto3 is blocking, so every request runs on this tier's own thread pool (the client is thread-safe and
keeps a pool of connections as large as the thread pool); at most ``max_workers`` requests are in flight
and each is bounded by ``timeout_s`` (botocore's connect/read timeouts, plus a hard limit here so a
stalled endpoint becomes a per-block FAILED result, counted in ``stats().errors``, never a hang).

Credentials come from the ``access_key``/``secret_key`` settings when given, otherwise from boto3's
usual chain (``AWS_ACCESS_KEY_ID``..., ``AWS_PROFILE``/``profile``, ``~/.aws``, instance roles). They are
never logged and never put in error messages. :meth:`open` checks them against the bucket, so wrong
credentials fail the daemon's start with a message naming the endpoint and bucket.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, cast

from ucm_protocol.errors import ConfigError, Unavailable
from ucm_protocol.keys import KEY_BYTES, NAMESPACE_BYTES, BlockKey, Digest, Namespace
from ucm_server.store.base import (
    MISSING,
    OK,
    BlockInfo,
    BlockResult,
    IoVec,
    Tier,
    TierStats,
    copy_iov,
    failed,
    iov_len,
)
from ucm_server.store.format import (
    HEADER_SIZE,
    CorruptBlock,
    decode_header,
    encode_header,
    payload_checksum,
    verify_payload,
)
from ucm_server.store.io_classes import ClassedExecutor, ClassedSlots

log = logging.getLogger(__name__)
T = TypeVar("T")

# Error codes that mean "no such object" (HEAD answers a bare 404, GET names the code).
_MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
_AUTH_CODES = frozenset(
    {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"}
)


@dataclass(frozen=True, slots=True)
class S3Settings:
    """The S3 tier's ``tier_settings`` entry: one field per key, with the constructor's defaults."""

    bucket: str = "ucm"
    """bucket holding the blocks; created at :meth:`S3Tier.open` if missing and ``create_bucket``."""
    endpoint_url: str = ""
    """``http(s)://host:port`` of an S3-compatible endpoint; empty means AWS."""
    region: str = "us-east-1"
    """signing region (most non-AWS stores accept any)."""
    prefix: str = "ucm"
    """object names are ``<prefix>/<namespace hex>/<key hex>``; daemons sharing blocks must agree on
    it."""
    access_key: str = ""
    """with ``secret_key`` (and optionally ``session_token``): explicit credentials. Empty: boto3's
    chain (environment, ``profile``, config files, instance role)."""
    secret_key: str = field(default="", metadata={"secret": True})
    """the secret of ``access_key``; never shown in errors or logs."""
    session_token: str = field(default="", metadata={"secret": True})
    """a temporary credential's token, with ``access_key``/``secret_key``; never shown."""
    profile: str = ""
    """a named profile from ``~/.aws/config`` when no explicit keys are given."""
    create_bucket: bool = True
    """create ``bucket`` at :meth:`S3Tier.open` if it is missing."""
    timeout_s: float = 10.0
    """connect and read timeout of each request, and the hard limit on one block's operation
    including retries."""
    max_workers: int = 16
    """requests in flight at once (threads and pooled connections)."""
    retries: int = 2
    """botocore attempts after the first (``standard`` mode, with backoff)."""
    addressing_style: str = "path"
    """``"path"`` (works with any endpoint) or ``"virtual"``."""
    verify_tls: bool = True
    """check the endpoint's certificate (turn off only for self-signed test setups)."""
    list_page: int = 1000
    """keys per LIST/DELETE request."""


class S3Tier(Tier):
    """Blocks as objects in one bucket of an S3-compatible store (see the module docstring)."""

    kind: ClassVar[str] = "S3"
    persistent: ClassVar[bool] = True
    shared: ClassVar[bool] = True
    pin_gap: ClassVar[str] = (
        "a shared bucket: other nodes and bucket lifecycle rules delete without this daemon's pins"
    )

    def __init__(
        self,
        name: str = "S3",
        *,
        bucket: str = "ucm",
        endpoint_url: str = "",
        region: str = "us-east-1",
        prefix: str = "ucm",
        access_key: str = "",
        secret_key: str = "",
        session_token: str = "",
        profile: str = "",
        create_bucket: bool = True,
        timeout_s: float = 10.0,
        max_workers: int = 16,
        retries: int = 2,
        addressing_style: str = "path",
        verify_tls: bool = True,
        list_page: int = 1000,
    ) -> None:
        """Every parameter is a key of the tier's settings, documented on :class:`S3Settings`."""
        super().__init__(name)
        if max_workers < 1 or timeout_s <= 0 or retries < 0 or not bucket:
            raise ConfigError(f"tier {name!r}: need a bucket, max_workers >= 1, timeout_s > 0, retries >= 0")
        if addressing_style not in ("path", "virtual", "auto"):
            raise ConfigError(f"tier {name!r}: addressing_style must be path, virtual or auto")
        if bool(access_key) != bool(secret_key):
            raise ConfigError(f"tier {name!r}: access_key and secret_key must be given together")
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self.region = region
        self.prefix = prefix.strip("/")
        self.profile = profile
        self.create_bucket = create_bucket
        self.timeout_s = timeout_s
        self.max_workers = max_workers
        self.retries = retries
        self.addressing_style = addressing_style
        self.verify_tls = verify_tls
        self.list_page = max(1, min(list_page, 1000))
        self._credentials = (access_key, secret_key, session_token)  # never logged
        self._client: Any = None
        self._pool: ClassedExecutor | None = None
        self._sem: ClassedSlots | None = None
        self._stats = TierStats(name=name, kind=self.kind)
        self._known: dict[BlockKey, int] = {}
        """Blocks this daemon wrote, read or found, with sizes: the bucket's totals would need a full
        listing, so ``stats().blocks``/``bytes`` report this local view."""

    def __repr__(self) -> str:
        return f"S3Tier({self.name!r}, endpoint={self.where})"

    @property
    def where(self) -> str:
        """``endpoint/bucket`` for messages (no credentials)."""
        return f"{self.endpoint_url or 'AWS S3'} bucket {self.bucket!r}"

    # -- configuration -----------------------------------------------------------------------------------
    Settings: ClassVar[type[Any] | None] = S3Settings
    """Built by :meth:`Tier.from_settings`: unknown keys and wrong types name the key (and never
    echo a credential)."""

    # -- life cycle ---------------------------------------------------------------------------------------
    async def open(self) -> None:
        """Build the client and check the bucket: wrong credentials or an unreachable endpoint fail here."""
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:
            raise Unavailable(
                f"tier {self.name!r}: boto3 is not installed ({exc}); pip install boto3"
            ) from exc
        access, secret, token = self._credentials
        session = boto3.session.Session(profile_name=self.profile or None)
        config = Config(
            region_name=self.region,
            connect_timeout=self.timeout_s,
            read_timeout=self.timeout_s,
            retries={"max_attempts": self.retries + 1, "mode": "standard"},
            max_pool_connections=self.max_workers,
            s3=cast(Any, {"addressing_style": self.addressing_style}),
            tcp_keepalive=True,
            # Newer botocore adds CRC trailers by default, which older RGW/MinIO reject; our own
            # header checksum already covers the payload end to end.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._client = session.client(
            "s3",
            endpoint_url=self.endpoint_url or None,
            aws_access_key_id=access or None,
            aws_secret_access_key=secret or None,
            aws_session_token=token or None,
            config=config,
            verify=self.verify_tls,
        )
        # Loads first, then prefetch, then writes (ucm_server.store.io_classes).
        self._pool = ClassedExecutor(self.max_workers, thread_name_prefix=f"ucm-{self.name}")
        self._sem = ClassedSlots(self.max_workers)
        try:
            await self._check_bucket()
        except BaseException:
            await self.close()
            raise
        log.info("%s: S3 at %s, prefix %r, %d workers", self.name, self.where, self.prefix, self.max_workers)

    async def _check_bucket(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        limit = self.timeout_s * (self.retries + 2)
        try:
            await self._call(lambda: self._client.head_bucket(Bucket=self.bucket), limit)
            return
        except NoCredentialsError as exc:
            raise ConfigError(
                f"tier {self.name!r}: no S3 credentials for {self.where} "
                "(set access_key/secret_key, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile)"
            ) from exc
        except ClientError as exc:
            code = _code(exc)
            if code in _AUTH_CODES:
                raise ConfigError(
                    f"tier {self.name!r}: {self.where} rejected our credentials or denies access ({code})"
                ) from exc
            if code not in _MISSING_CODES and code != "NoSuchBucket":
                raise Unavailable(f"tier {self.name!r}: {self.where}: {code}") from exc
        except (BotoCoreError, TimeoutError) as exc:
            raise Unavailable(f"tier {self.name!r}: cannot reach {self.where}: {exc}") from exc
        if not self.create_bucket:
            raise ConfigError(f"tier {self.name!r}: {self.where} does not exist (create_bucket is off)")
        try:
            await self._call(lambda: self._client.create_bucket(Bucket=self.bucket), limit)
        except ClientError as exc:
            code = _code(exc)
            if code in _AUTH_CODES:
                raise ConfigError(f"tier {self.name!r}: cannot create {self.where} ({code})") from exc
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise Unavailable(f"tier {self.name!r}: cannot create {self.where}: {code}") from exc
        except (BotoCoreError, TimeoutError) as exc:
            raise Unavailable(f"tier {self.name!r}: cannot reach {self.where}: {exc}") from exc
        log.info("%s: created %s", self.name, self.where)

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        client, self._client = self._client, None
        if client is not None:
            client.close()

    # -- primitives -------------------------------------------------------------------------------------
    def object_name(self, key: BlockKey) -> str:
        """The object key a block is stored under (other daemons compute the same)."""
        return f"{self.prefix}/{key.namespace.hex()}/{key.digest.hex()}"

    async def lookup(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """Concurrent HEADs; errors count as misses (and in ``stats().errors``)."""
        self._require()
        sizes = await asyncio.gather(*(self._op(self._head, k) for k in keys))
        out: list[int | None] = []
        for key, size in zip(keys, sizes, strict=True):
            if isinstance(size, BlockResult) or size is None:
                out.append(None)
                self._stats.misses += 1
                if size is None:
                    self._known.pop(key, None)
            else:
                out.append(size)
                self._known[key] = size
                self._stats.hits += 1
        return out

    async def read_into(self, key: BlockKey, dest: IoVec) -> BlockResult:
        self._require()
        return await self._op(self._get, key, dest)

    async def write_from(self, key: BlockKey, src: IoVec) -> BlockResult:
        self._require()
        return await self._op(self._put, key, src)

    async def read_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        """All blocks at once; the semaphore keeps ``max_workers`` requests in flight."""
        self._require()
        return list(await asyncio.gather(*(self._op(self._get, k, d) for k, d in items)))

    async def write_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        self._require()
        return list(await asyncio.gather(*(self._op(self._put, k, s) for k, s in items)))

    async def delete(self, keys: Sequence[BlockKey]) -> int:
        """HEAD to count what exists, then multi-object DELETEs (S3's DELETE cannot say)."""
        existing = [k for k, size in zip(keys, await self.lookup(keys), strict=True) if size is not None]
        removed = 0
        for start in range(0, len(existing), self.list_page):
            batch = existing[start : start + self.list_page]
            objects = [{"Key": self.object_name(k)} for k in batch]
            try:
                resp = await self._call(
                    lambda objects=objects: self._client.delete_objects(  # type: ignore[misc]
                        Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True}
                    ),
                    self.timeout_s * (self.retries + 1),
                )
            except Exception as exc:
                self._stats.errors += 1
                log.warning("%s: delete of %d blocks failed: %s", self.name, len(batch), _describe(exc))
                continue
            errors = {e.get("Key") for e in resp.get("Errors", [])}
            if errors:
                self._stats.errors += 1
            for k in batch:
                if self.object_name(k) not in errors:
                    removed += 1
                    self._known.pop(k, None)
        return removed

    async def list_blocks(self, namespace: Namespace | None = None) -> AsyncIterator[BlockInfo]:
        """A paginated LIST under our prefix; a failing page ends the listing and counts an error."""
        self._require()
        prefix = f"{self.prefix}/" + (f"{namespace.hex()}/" if namespace is not None else "")
        token: str | None = None
        while True:
            args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": self.list_page}
            if token:
                args["ContinuationToken"] = token
            try:
                page = await self._call(lambda args=args: self._client.list_objects_v2(**args))  # type: ignore[misc]
            except Exception as exc:
                self._stats.errors += 1
                log.warning("%s: listing %s failed: %s", self.name, self.where, _describe(exc))
                return
            for obj in page.get("Contents", []):
                key = self._parse_name(obj["Key"])
                if key is not None and obj["Size"] >= HEADER_SIZE:
                    stamp = obj.get("LastModified")
                    yield BlockInfo(
                        key=key,
                        size=int(obj["Size"]) - HEADER_SIZE,
                        tier=self.name,
                        stored_at=stamp.timestamp() if stamp is not None else 0.0,
                    )
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def stats(self) -> TierStats:
        known = self._known
        return dataclasses.replace(
            self._stats, blocks=len(known), bytes=sum(known.values()), extra=dict(self._stats.extra)
        )

    # -- per-block work (on pool threads) ----------------------------------------------------------------
    def _head(self, key: BlockKey) -> int | None:
        from botocore.exceptions import ClientError

        try:
            resp = self._client.head_object(Bucket=self.bucket, Key=self.object_name(key))
        except ClientError as exc:
            if _code(exc) in _MISSING_CODES:
                return None
            raise
        size = int(resp["ContentLength"])
        return size - HEADER_SIZE if size >= HEADER_SIZE else None

    def _put(self, key: BlockKey, src: IoVec) -> BlockResult:
        n = iov_len(src)
        body = bytearray(HEADER_SIZE + n)
        body[:HEADER_SIZE] = encode_header(key, n, payload_checksum(src))
        copy_iov([memoryview(body)[HEADER_SIZE:]], src)
        self._client.put_object(Bucket=self.bucket, Key=self.object_name(key), Body=bytes(body))
        self._stats.write_bytes += n
        self._known[key] = n
        return OK

    def _get(self, key: BlockKey, dest: IoVec) -> BlockResult:
        from botocore.exceptions import ClientError

        want = iov_len(dest)
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=self.object_name(key))
        except ClientError as exc:
            if _code(exc) in _MISSING_CODES:
                self._known.pop(key, None)
                self._stats.misses += 1
                return MISSING
            raise
        body = resp["Body"]
        try:
            size = int(resp["ContentLength"])
            if size != HEADER_SIZE + want and size >= HEADER_SIZE:
                # Read only the header: a wrong size may still be a valid block of another length.
                header = decode_header(body.read(HEADER_SIZE), expect=key)
                self._stats.errors += 1
                return failed(f"length mismatch: block is {header.payload_len} bytes, reader has {want}")
            raw = memoryview(body.read())
        except CorruptBlock as exc:
            return self._corrupt(key, exc)
        finally:
            body.close()
        try:
            header = decode_header(raw[:HEADER_SIZE], expect=key)
            verify_payload(header, [raw[HEADER_SIZE:]])
        except CorruptBlock as exc:
            return self._corrupt(key, exc)
        copy_iov(dest, [raw[HEADER_SIZE:]])
        self._known[key] = want
        self._stats.hits += 1
        self._stats.read_bytes += want
        return OK

    def _corrupt(self, key: BlockKey, exc: CorruptBlock) -> BlockResult:
        self._stats.corrupt += 1
        self._stats.errors += 1
        return failed(f"corrupt object {self.object_name(key)}: {exc}")

    # -- helpers ----------------------------------------------------------------------------------------
    async def _op(self, fn: Callable[..., T], *args: Any) -> T | BlockResult:
        """One block's request under the concurrency bound and the hard ``timeout_s`` limit; any
        failure becomes a FAILED result with the reason (never the credentials)."""
        assert self._sem is not None
        async with self._sem.hold():
            try:
                return await self._call(lambda: fn(*args), self.timeout_s * (self.retries + 1))
            except TimeoutError:
                self._stats.errors += 1
                return failed(f"S3 request timed out after {self.timeout_s * (self.retries + 1):g}s")
            except Exception as exc:
                self._stats.errors += 1
                return failed(f"S3 {self.where}: {_describe(exc)}")

    async def _call(self, fn: Callable[[], T], limit_s: float | None = None) -> T:
        assert self._pool is not None
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn)
        return await asyncio.wait_for(fut, limit_s or self.timeout_s)

    def _require(self) -> None:
        if self._client is None:
            raise Unavailable(f"tier {self.name!r} is not open")

    def _parse_name(self, name: str) -> BlockKey | None:
        _, _, rest = name.partition(f"{self.prefix}/")
        ns_hex, _, key_hex = rest.partition("/")
        try:
            ns, digest = bytes.fromhex(ns_hex), bytes.fromhex(key_hex)
        except ValueError:
            return None
        if len(ns) != NAMESPACE_BYTES or len(digest) != KEY_BYTES:
            return None
        return BlockKey(Namespace(ns), Digest(digest))


def _code(exc: Exception) -> str:
    """The S3 error code of a botocore ``ClientError`` (``"404"`` for bodiless HEAD answers)."""
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", "")) or type(exc).__name__


def _describe(exc: Exception) -> str:
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        return _code(exc)
    return f"{type(exc).__name__}: {exc}"
