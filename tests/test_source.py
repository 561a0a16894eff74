"""A source is listed into one row per image, with what the source says about each: the forms a lab keeps
its images in (folders, lists, Parquet with captions, WebDataset shards, https), and their version."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from samples import encoded, real_photos, webdataset_tar

from assets.ingest import ingest, list_inputs
from assets.source import LISTING, SourceError, list_source, listing_version, write_listing
from kiln.config import load_config
from kiln.uri import split_uri


@pytest.fixture(scope="module")
def photos() -> dict[str, bytes]:
    return {name: encoded(im.resize((160, 120)), "JPEG", quality=90) for name, im in list(real_photos().items())[:4]}


def test_a_webdataset_shard_lists_one_row_per_image_with_its_caption_and_metadata(tmp_path, photos):
    a, b, c = list(photos.values())[:3]
    shard = tmp_path / "shard-000.tar"
    shard.write_bytes(
        webdataset_tar(
            {
                "s/000": {"jpg": a, "txt": b"an astronaut in a white suit"},
                "s/001": {
                    "jpg": b,
                    "json": json.dumps({"caption": "a cup of coffee", "license": "CC-BY", "aesthetic": 6.1}).encode(),
                },
                "s/002": {"png": c},
                "s/003": {"txt": b"a caption whose image went missing"},
            }
        )
    )
    rows = list_source(str(shard)).to_pylist()
    assert [split_uri(r["uri"]) for r in rows] == [
        (str(shard), m) for m in ("s/000.jpg", "s/001.jpg", "s/002.png", "s/003.txt")
    ]
    assert rows[0]["source_caption"] == "an astronaut in a white suit"
    assert (rows[1]["source_caption"], rows[1]["license"], json.loads(rows[1]["source_meta"])) == (
        "a cup of coffee",
        "CC-BY",
        {"aesthetic": 6.1},
    )
    assert rows[2]["source_caption"] is None and rows[2]["size"] == len(c)
    # a sample without an image is still a row: ingest rejects it with a reason instead of dropping it
    out = ingest(list_source(str(shard)), load_config())
    assert out.kept.num_rows == 3 and out.rejected.column("reason").to_pylist() == ["not_an_image"]
    assert out.kept.column("source_caption").to_pylist() == ["an astronaut in a white suit", "a cup of coffee", None]


def test_a_parquet_list_carries_its_extra_columns_into_the_manifest(tmp_path, photos):
    paths = []
    for name, data in photos.items():
        (tmp_path / f"{name}.jpg").write_bytes(data)
        paths.append((tmp_path / f"{name}.jpg").as_posix())
    pq.write_table(
        pa.table(
            {
                "url": paths,
                "text": [f"a photo of {n}" for n in photos],
                "license": ["CC0"] * 4,
                "source": ["skimage"] * 4,
                "width_hint": [1, 2, 3, 4],
            }
        ),
        tmp_path / "list.parquet",
    )
    manifest = ingest(list_source(str(tmp_path / "list.parquet")), load_config()).kept.to_pylist()
    assert [r["source_caption"] for r in manifest] == [f"a photo of {n}" for n in photos]
    assert {(r["license"], r["source_name"]) for r in manifest} == {("CC0", "skimage")}
    assert [json.loads(r["source_meta"]) for r in manifest] == [{"width_hint": i} for i in (1, 2, 3, 4)]


def test_several_sources_are_listed_in_order_and_a_uri_listed_twice_is_one_row(tmp_path, photos):
    for name, data in photos.items():
        (tmp_path / "imgs").mkdir(exist_ok=True)
        (tmp_path / "imgs" / f"{name}.jpg").write_bytes(data)
    one = (tmp_path / "imgs" / "astronaut.jpg").as_posix()
    (tmp_path / "list.txt").write_text(f"# picked\n{one}\n")
    listing = list_source([str(tmp_path / "list.txt"), str(tmp_path / "imgs")])
    assert listing.schema.equals(LISTING) and listing.num_rows == 4
    assert listing.column("uri").to_pylist()[0] == one


def test_the_version_changes_when_an_object_is_added_or_replaced_and_not_otherwise(tmp_path, photos):
    folder = tmp_path / "imgs"
    folder.mkdir()
    (folder / "a.jpg").write_bytes(photos["astronaut"])
    v1 = listing_version(list_source(str(folder)))
    assert listing_version(list_source(str(folder))) == v1
    (folder / "b.jpg").write_bytes(photos["coffee"])
    v2 = listing_version(list_source(str(folder)))
    (folder / "a.jpg").write_bytes(photos["chelsea"])
    assert len({v1, v2, listing_version(list_source(str(folder)))}) == 3


def test_an_object_that_changes_after_listing_is_rejected_unreadable_with_what_changed(tmp_path, photos):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for name in ("astronaut", "coffee", "chelsea"):
        (folder / f"{name}.jpg").write_bytes(photos[name])
    listing = list_source(str(folder))
    (folder / "coffee.jpg").write_bytes(photos["coffee"][:-100])  # replaced by something shorter
    (folder / "chelsea.jpg").unlink()  # gone
    out = ingest(listing, load_config())
    rejected = {r["uri"].rsplit("/", 1)[1]: r for r in out.rejected.to_pylist()}
    assert out.kept.num_rows == 1 and set(rejected) == {"coffee.jpg", "chelsea.jpg"}
    assert {r["reason"] for r in rejected.values()} == {"unreadable"}
    assert (
        "changed since listing" in rejected["coffee.jpg"]["detail"]
        and "No such file" in rejected["chelsea.jpg"]["detail"]
    )


def test_a_missing_local_source_and_a_parquet_without_uris_are_clear_errors(tmp_path):
    with pytest.raises(SourceError, match="no such file or folder"):
        list_source(str(tmp_path / "nowhere"))
    pq.write_table(pa.table({"path": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(SourceError, match="needs a `uri`"):
        list_source(str(tmp_path / "bad.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="lists no objects"):
        list_source(str(tmp_path / "empty"))


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Python's file server plus `Range: bytes=a-b`, as object stores and CDNs answer it."""

    def send_head(self):
        rng = self.headers.get("Range")
        if not rng or not rng.startswith("bytes="):
            return super().send_head()
        with open(self.translate_path(self.path), "rb") as f:
            data = f.read()
        start, _, end = rng[len("bytes=") :].partition("-")
        start, end = int(start), min(int(end) if end else len(data) - 1, len(data) - 1)
        body = data[start : end + 1]
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        return io.BytesIO(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def https_root(tmp_path):
    """A local web server over a folder: objects reached by https-style urls through fsspec's HTTP reader."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(RangeHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_objects_lists_and_shards_are_read_where_they_are(https_root, photos):
    root, url = https_root
    (root / "a.jpg").write_bytes(photos["astronaut"])
    (root / "shard.tar").write_bytes(
        webdataset_tar({"k0": {"jpg": photos["coffee"], "txt": b"coffee"}, "k1": {"jpg": photos["chelsea"]}})
    )
    pq.write_table(
        pa.table({"uri": [f"{url}/a.jpg", f"{url}/shard.tar"], "caption": ["an astronaut", None]}),
        root / "list.parquet",
    )
    listing = list_source(f"{url}/list.parquet")
    assert listing.column("uri").to_pylist() == [
        f"{url}/a.jpg",
        f"tar://{url}/shard.tar#k0.jpg",
        f"tar://{url}/shard.tar#k1.jpg",
    ]
    out = ingest(listing, load_config())
    assert out.rejected.num_rows == 0
    assert (
        out.kept.column("md5").to_pylist()[1] == hashlib.md5(photos["coffee"]).hexdigest()
    )  # a ranged read of the member
    assert out.kept.column("source_caption").to_pylist() == ["an astronaut", "coffee", None]


def test_an_unreachable_https_source_names_the_uri():
    with pytest.raises(SourceError, match=r"http://127\.0\.0\.1:9/list\.parquet"):
        list_source("http://127.0.0.1:9/list.parquet")


def test_the_demo_source_is_a_folder_written_once_and_listed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(["data.demo.n=40"])
    report = write_listing(cfg, tmp_path / "source", tmp_path / "raw")
    assert report["objects"] == 40 and (tmp_path / "raw" / "truth.parquet").is_file()
    first = (tmp_path / "source" / "listing.parquet").read_bytes()
    write_listing(
        cfg, tmp_path / "source", tmp_path / "raw"
    )  # the corpus is not rewritten; the listing is the same bytes
    assert (tmp_path / "source" / "listing.parquet").read_bytes() == first
    assert list_inputs(tmp_path / "source" / "listing.parquet").equals(
        pq.read_table(tmp_path / "source" / "listing.parquet")
    )
