"""A real S3 API on 127.0.0.1 for the tests: moto's standalone server in a process of its own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Credentials moto accepts (it checks none unless told to); never real ones.
KEYS = {"AWS_ACCESS_KEY_ID": "rlscope-test", "AWS_SECRET_ACCESS_KEY": "rlscope-test-secret"}


@dataclass
class S3Server:
    """A running moto server: its endpoint and the environment a client needs to reach it."""

    process: subprocess.Popen[bytes]
    endpoint: str

    @property
    def env(self) -> dict[str, str]:
        """AWS_* variables for a process (rlscope, a Dask worker) that reads this server."""
        return {**KEYS, "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"],
        )

    def upload(self, folder: Path, bucket: str, prefix: str) -> str:
        """Every file under `folder` uploaded under `prefix` (the bucket made if new): the URL."""
        s3 = self.client()
        if bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
            s3.create_bucket(Bucket=bucket)
        for file in sorted(folder.rglob("*")):
            if file.is_file():
                key = f"{prefix}/{file.relative_to(folder).as_posix()}"
                s3.upload_file(str(file), bucket, key)
        return f"s3://{bucket}/{prefix}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def s3_server(extra_env: Mapping[str, str] | None = None) -> Iterator[S3Server]:
    """moto's server (`python -m moto.server`) on a free port of 127.0.0.1, until the block
    ends; it answers once it accepts connections."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(extra_env or {})},
    )
    server = S3Server(process, f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto's server did not start") from None
                time.sleep(0.1)
        yield server
    finally:
        server.stop()
