"""A local S3-compatible server for the tests: moto's server mode on loopback (as Ray's own tests do), with
the client side configured the way a user's would be, from the environment (AWS_ENDPOINT_URL and keys).

`s3_server()` starts it on a free port, sets the environment and yields a handle; leaving the context stops
that server (by its handle) and puts the environment back. `bucket(server)` makes a fresh bucket."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# What the AWS clients read (botocore for s3fs): no credentials file, no instance metadata (IMDS) lookups.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
    "AWS_CONFIG_FILE": "/nonexistent/aws-config",
}
NO_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")


@dataclass
class S3Server:
    endpoint: str
    server: Any

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def make_bucket(self, prefix: str = "b") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))


def clear_clients() -> None:
    """Forget cached fsspec S3 clients (they hold the credentials and endpoint they were made with)."""
    with contextlib.suppress(ImportError):
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


@contextlib.contextmanager
def s3_server() -> Iterator[S3Server]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {**S3_ENV, "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    saved = {k: os.environ.get(k) for k in (*env, *NO_CREDENTIALS)}
    os.environ.update(env)
    clear_clients()
    try:
        yield S3Server(env["AWS_ENDPOINT_URL"], server)
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        clear_clients()
