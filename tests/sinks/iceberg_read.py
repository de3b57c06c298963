"""Iceberg catalogs for the sink tests (SQL on SQLite; a warehouse on disk or on the S3 server), read back."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pyiceberg.catalog import load_catalog


def sql_catalog(tmp_path: Path, bucket: str | None = None) -> dict[str, str]:
    """The properties of a SQL catalog on a SQLite file; its warehouse on disk, or in ``bucket``.

    With a bucket, the S3 endpoint and credentials are those the ``s3_bucket`` fixture set.
    """
    properties = {"type": "sql", "uri": f"sqlite:///{tmp_path / 'catalog.db'}"}
    if bucket is None:
        (tmp_path / "warehouse").mkdir(exist_ok=True)
        return {**properties, "warehouse": f"file://{tmp_path / 'warehouse'}"}
    return {
        **properties,
        "warehouse": f"s3://{bucket}/warehouse",
        # s3fs: moto's server fails pyarrow's multipart uploads (CompleteMultipartUpload)
        "py-io-impl": "pyiceberg.io.fsspec.FsspecFileIO",
        "s3.endpoint": os.environ["AWS_ENDPOINT_URL"],
        "s3.access-key-id": os.environ["AWS_ACCESS_KEY_ID"],
        "s3.secret-access-key": os.environ["AWS_SECRET_ACCESS_KEY"],
        "s3.region": os.environ["AWS_DEFAULT_REGION"],
    }


def catalog_env(name: str, properties: dict[str, str]) -> dict[str, str]:
    """The same catalog as ``PYICEBERG_CATALOG__NAME__KEY`` variables.

    ``s3.access-key-id`` becomes ``S3__ACCESS_KEY_ID``: pyiceberg reads ``__`` as ``.`` and ``_`` as ``-``.
    """
    return {
        f"PYICEBERG_CATALOG__{name.upper()}__{key.replace('.', '__').replace('-', '_').upper()}": value
        for key, value in properties.items()
    }


def iceberg_rows(
    table: str, properties: dict[str, str], catalog_name: str = "default"
) -> list[dict[str, Any]]:
    """Every row of ``table`` (a row written twice comes twice); none when it does not exist.

    A SQL catalog keeps its tables under its name: ``catalog_name`` is the sink's.
    """
    catalog = load_catalog(catalog_name, **properties)
    if not catalog.table_exists(table):
        return []
    rows: list[dict[str, Any]] = catalog.load_table(table).scan().to_arrow().to_pylist()
    return rows
