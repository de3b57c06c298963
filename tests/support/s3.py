"""A real S3 API for the files sink tests: moto's server (``moto_server``) on 127.0.0.1.

Registered in ``tests/conftest.py``: ``s3_server`` (one per test process) and ``s3_bucket`` (a
bucket of its own per test, with the standard AWS variables set for the test and the processes
it starts: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_DEFAULT_REGION``). Without moto's server the tests skip and say why; the dev extra has it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest

from pspf.embedded import free_port

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """The endpoint URL of a moto S3 server on loopback."""
    binary = shutil.which("moto_server")
    if binary is None:
        pytest.skip("moto's S3 server is not installed (pip install 'moto[server]')")
    port = free_port()
    process = subprocess.Popen(
        [binary, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"moto_server did not start on port {port}") from None
            time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def s3_bucket(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new bucket's name, the AWS variables pointing at the server."""
    import boto3

    for name, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(name, value)
    bucket = f"pspf-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return bucket
