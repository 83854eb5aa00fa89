"""The S3-API object store on boto3: AWS, MinIO, R2, moto.

`create` is a PUT with `IfNoneMatch: *` (a 412 means someone else wrote the key first); ranged reads
send `Range: bytes=a-b`. boto3's errors are translated here into the hub's, naming bucket and key.
"""

from __future__ import annotations

from typing import Any

from fleetrl.config import SecretError, SecretField, StoreConfig
from fleetrl.hub.errors import ObjectExists, ObjectNotFound, StoreError
from fleetrl.hub.store_api import ObjectInfo, ObjectStore

_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_EXISTS = {"PreconditionFailed", "412"}


class S3Store(ObjectStore):
    """`s3://bucket/prefix` through one thread-safe boto3 client."""

    def __init__(self, name: str, config: StoreConfig, *, max_connections: int = 10) -> None:
        import boto3  # type: ignore[import-untyped,unused-ignore]
        from botocore.config import Config  # type: ignore[import-untyped,unused-ignore]

        super().__init__(name, config.url)
        bucket, _, prefix = config.url[len("s3://") :].partition("/")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self._client: Any = boto3.client(
            "s3",
            endpoint_url=config.endpoint_url,
            region_name=config.region_name,
            config=Config(max_pool_connections=max_connections, retries={"max_attempts": 3, "mode": "standard"}),
            **_credentials(name, config),
        )

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _fail(self, exc: Exception, key: str, op: str) -> StoreError:
        response = getattr(exc, "response", None) or {}  # a connection error has response None
        code = str(response.get("Error", {}).get("Code", ""))
        if code in _NOT_FOUND:
            return ObjectNotFound(f"no object {self.where(key)}")
        if code in _EXISTS:
            return ObjectExists(f"{self.where(key)} already exists")
        return StoreError(f"{op} {self.where(key)} failed: {code or type(exc).__name__}: {exc}")

    def _get(self, key: str, start: int | None, end: int | None) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped,unused-ignore]

        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(key)}
        if start is not None:
            if end is not None and end <= start:
                return b""
            kwargs["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        try:
            body: bytes = self._client.get_object(**kwargs)["Body"].read()
        except (ClientError, BotoCoreError) as exc:
            raise self._fail(exc, key, "GET") from exc
        return body

    def _put(self, key: str, data: bytes, **extra: Any) -> None:
        from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped,unused-ignore]

        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **extra)
        except (ClientError, BotoCoreError) as exc:
            raise self._fail(exc, key, "PUT") from exc

    def _create(self, key: str, data: bytes) -> None:
        self._put(key, data, IfNoneMatch="*")

    def _scan(self, prefix: str) -> list[ObjectInfo]:
        from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped,unused-ignore]

        out = []
        cut = len(self.prefix) + 1 if self.prefix else 0
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix)
            ):
                for item in page.get("Contents", []):
                    out.append(ObjectInfo(item["Key"][cut:], int(item["Size"]), item["LastModified"].timestamp()))
        except (ClientError, BotoCoreError) as exc:
            raise self._fail(exc, prefix, "LIST") from exc
        return out

    def exists(self, key: str) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped,unused-ignore]

        try:
            self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            err = self._fail(exc, key, "HEAD")
            if isinstance(err, ObjectNotFound):
                return False
            raise err from exc
        except BotoCoreError as exc:
            raise self._fail(exc, key, "HEAD") from exc
        return True

    def delete(self, key: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped,unused-ignore]

        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except (ClientError, BotoCoreError) as exc:
            raise self._fail(exc, key, "DELETE") from exc


def _credentials(name: str, config: StoreConfig) -> dict[str, str]:
    """Explicit keys from the store's secret fields; none set leaves boto3's own chain (instance role)."""
    try:
        key_id = SecretField(f"store {name}: access_key_id", config, "access_key_id").value()
        secret = SecretField(f"store {name}: secret_access_key", config, "secret_access_key").value()
    except SecretError as exc:
        raise StoreError(str(exc)) from exc
    if (key_id is None) != (secret is None):
        raise StoreError(f"store {name} ({config.url}): set both access_key_id and secret_access_key, or neither")
    return {} if key_id is None or secret is None else {"aws_access_key_id": key_id, "aws_secret_access_key": secret}

