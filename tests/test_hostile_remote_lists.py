"""A Parquet list in a bucket may name only objects in that bucket (or under `data.ingest.roots`): an entry that
points at another bucket, another host or a local file is rejected `outside_roots` before a byte of it is read,
so a list someone hands you cannot make kiln read what the process can reach (docs/sources.md). The local
lists' case is tests/test_hostile_inputs.py; this is the object-store one, on a local S3-compatible server."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from samples import encoded, scene

from assets.ingest import ingest
from assets.source import list_source
from kiln.config import load_config

pytestmark = [pytest.mark.s3]


def parquet_bytes(uris: list[str]) -> bytes:
    out = pa.BufferOutputStream()
    pq.write_table(pa.table({"uri": uris}), out)
    return out.getvalue().to_pybytes()


def test_a_bucket_list_reads_only_its_own_bucket_unless_roots_name_more(s3):
    picture = encoded(scene(80, 128), "JPEG", quality=90)
    s3.create_bucket(Bucket="shared-list")
    s3.create_bucket(Bucket="someone-else")
    s3.put_object(Bucket="shared-list", Key="photos/ok.jpg", Body=picture)
    s3.put_object(
        Bucket="someone-else", Key="private.jpg", Body=picture
    )  # there and readable: only the list's reach stops it
    own, other = "s3://shared-list/photos/ok.jpg", "s3://someone-else/private.jpg"
    climbing = "s3://shared-list/../someone-else/private.jpg"
    elsewhere = [other, climbing, "/etc/passwd", "file:///etc/passwd", "https://example.invalid/x.jpg"]
    s3.put_object(Bucket="shared-list", Key="lists/list.parquet", Body=parquet_bytes([own, *elsewhere]))
    listing = list_source("s3://shared-list/lists/list.parquet")

    out = ingest(listing, load_config())
    assert out.kept.column("uri").to_pylist() == [own]
    assert {r["uri"]: r["reason"] for r in out.rejected.to_pylist()} == dict.fromkeys(elsewhere, "outside_roots")
    assert {r["detail"] for r in out.rejected.to_pylist()} == {
        "not under s3://shared-list/ (data.ingest.roots names more)"
    }

    # a bucket the config names is readable too; `..` still climbs nowhere
    out = ingest(listing, load_config(["data.ingest.roots=[s3://someone-else/]"]))
    assert sorted(out.kept.column("uri").to_pylist()) == [own, other]
    assert climbing in out.rejected.column("uri").to_pylist()
