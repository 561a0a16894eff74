"""Ingest: every input form becomes (id, uri) rows, and every file becomes a manifest row or a reject.

`mixed_folder` is the real-world zoo the filter and dedup tests reuse: many containers and modes,
a corrupt file, a JPEG behind a .png name, a header that claims 400 million pixels.
"""

import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from samples import mixed_files

from assets.ingest import INPUTS, ingest, list_inputs, uri_id
from kiln.config import load_config
from kiln.stage import read_dataset, run_stage
from kiln.uri import read_bytes, tar_uri


def test_folder_is_walked_recursively_in_sorted_posix_order(mixed_folder):
    t = list_inputs(mixed_folder)
    assert t.schema.equals(INPUTS)
    rel = [u[len(mixed_folder.as_posix()) + 1 :] for u in t.column("uri").to_pylist()]
    assert rel == sorted(mixed_files())
    assert t.column("id").to_pylist() == [uri_id(u) for u in t.column("uri").to_pylist()]


def test_relative_inputs_give_relative_uris(mixed_folder, monkeypatch):
    monkeypatch.chdir(mixed_folder.parent)
    uris = list_inputs(Path("raw")).column("uri").to_pylist()
    assert uris[0] == "raw/a/alpha.png" and all(not u.startswith("/") for u in uris)


def test_text_list_parquet_list_and_tar_shards(tmp_path, mixed_folder):
    files = sorted(mixed_files())
    listed = tmp_path / "list.txt"
    listed.write_text("# comment\n" + "\n".join((mixed_folder / f).as_posix() for f in files[:3]) + "\n\n")
    assert len(list_inputs(listed)) == 3

    pq.write_table(pa.table({"uri": [(mixed_folder / f).as_posix() for f in files[:2]]}), tmp_path / "uris.parquet")
    assert list_inputs(tmp_path / "uris.parquet").num_rows == 2

    shards = tmp_path / "shards"
    shards.mkdir()
    with tarfile.open(shards / "shard-000.tar", "w") as tf:
        for f in files[:4]:
            tf.add(mixed_folder / f, arcname=f"{Path(f).stem}.{Path(f).suffix[1:]}")
    uris = list_inputs(shards).column("uri").to_pylist()
    assert uris[0] == f"tar://{(shards / 'shard-000.tar').as_posix()}#alpha.png" and len(uris) == 4
    assert read_bytes(uris[0]) == (mixed_folder / files[0]).read_bytes()


def test_manifest_reads_headers_and_rejects_what_is_not_an_image(mixed_folder):
    out = ingest(list_inputs(mixed_folder), load_config())
    rows = {Path(r["uri"]).name: r for r in out.kept.to_pylist()}
    reasons = {Path(r["uri"]).name: r["reason"] for r in out.rejected.to_pylist()}
    assert reasons == {"empty.jpg": "empty_file", "page.jpg": "not_an_image"}
    assert rows["bomb.png"]["width"] == 20000  # the header is read; the filter rejects it before decoding
    assert rows["really_a_jpeg.png"]["format"] == "JPEG"
    assert rows["rotated.jpg"]["exif_orientation"] == 6 and rows["photo.jpg"]["exif_orientation"] == 0
    assert rows["anim.gif"]["n_frames"] == 3
    assert (rows["print.jpg"]["mode"], rows["deep.png"]["mode"]) == ("CMYK", "I;16")


def test_unreadable_uris_are_rejected_not_lost(tmp_path):
    t = pa.Table.from_pylist(
        [{"id": "x", "uri": str(tmp_path / "gone.jpg")}, {"id": "y", "uri": tar_uri(str(tmp_path / "s.tar"), "m.jpg")}],
        schema=INPUTS,
    )
    out = ingest(t, load_config())
    assert out.kept.num_rows == 0 and out.rejected.column("reason").to_pylist() == ["unreadable", "unreadable"]


def test_manifest_is_byte_identical_across_runs(mixed_folder, tmp_path):
    cfg = load_config()
    run_stage("ingest", mixed_folder, tmp_path / "m1", cfg)
    run_stage("ingest", mixed_folder, tmp_path / "m2", cfg)
    for sub in ("kept/part-00000.parquet", "rejected/part-00000.parquet", "summary.json"):
        assert (tmp_path / "m1" / sub).read_bytes() == (tmp_path / "m2" / sub).read_bytes()
    assert read_dataset(tmp_path / "m1" / "kept").num_rows == len(mixed_files()) - 2
