"""Hostile inputs: what a careless or malicious source can hold, generated here (never committed), each file with
the fate it must meet through ingest -> filter -> dedup: kept, or rejected with its reason. Nothing crashes the
stage, nothing hangs it, nothing is read without bound, and nothing the walk meets vanishes without a row."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from samples import encoded, png_header_only, scene, webdataset_tar

from assets.decode import DecodeFailure, measure
from assets.filters import filter_stage
from assets.ingest import ingest, list_inputs
from assets.source import list_source
from kiln.config import load_config
from kiln.paths import REPO_ROOT
from kiln.reasons import detail_of
from kiln.stage import read_dataset, run_stage
from kiln.uri import read_bytes, split_uri, tar_uri

# small limits, so that the oversize file and the bomb stay a few kilobytes
LIMITS = ["data.ingest.max_bytes=100000", "data.filters.max_pixels=1000000"]


def jpeg(im: Image.Image) -> bytes:
    return encoded(im, "JPEG", quality=90)


def hostile_corpus(root: Path) -> dict[str, str]:
    """Write the corpus under root/src; return each uri's fate: `kept`, `twin` (one kept, the other its exact
    duplicate), or the reason it is rejected. Files outside src (a symlink's target) carry no fate of their own."""
    src = root / "src"
    (src / "photos").mkdir(parents=True)
    (root / "elsewhere").mkdir()
    files = {
        "photos/plain.jpg": (jpeg(scene(40, 200)), "kept"),
        "photos/x::y.jpg": (jpeg(scene(41, 200)), "kept"),  # `::` is part of a file name, not a tar member
        "photos/a#b%20c.jpg": (jpeg(scene(42, 200)), "kept"),
        "photos/bomb.png": (png_header_only(2000, 2000), "too_many_pixels"),  # 4 MP > max_pixels, never decoded
        "photos/huge.jpg": (jpeg(scene(43, 200)) + bytes(100_000), "too_large"),  # over max_bytes: never read
        "photos/notes.jpg": (b"<html>404</html>\n", "not_an_image"),
        "garbage.tar": (os.urandom(3000), "unreadable"),  # named like a shard, holds no tar
        "locked/inside.jpg": (jpeg(scene(47, 200)), None),  # its folder cannot be listed: the folder is the row
    }
    original = scene(44, 260)
    copy = jpeg(original.resize((200, 200), Image.Resampling.LANCZOS))
    files |= {
        "photos/original.jpg": (jpeg(original), "kept"),
        # three byte copies of a smaller version: all three near duplicates of the larger original, none "exact"
        **{f"photos/copy-{i}.jpg": (copy, "near_duplicate") for i in (1, 2, 3)},
        **{f"photos/twin-{i}.jpg": (jpeg(scene(45, 200)), "twin") for i in (1, 2)},
    }
    shard = webdataset_tar({"000": {"jpg": jpeg(scene(46, 200)), "txt": b"discs on a gradient"}})
    fates = {}
    for rel, (data, fate) in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
        if fate:
            fates[f"{src.as_posix()}/{rel}"] = fate
    (src / "shards").mkdir()
    (src / "shards" / "odd#%name.tar").write_bytes(shard)  # the shard's own name holds the member separator
    fates[tar_uri(f"{src.as_posix()}/shards/odd#%name.tar", "000.jpg")] = "kept"

    with open(os.path.join(os.fsencode(src), b"caf\xe9.jpg"), "wb") as f:  # Latin-1, not UTF-8: no uri can name it
        f.write(jpeg(scene(48, 200)))
    fates[f"{src.as_posix()}/caf\\xe9.jpg"] = "bad_uri"
    os.mkfifo(src / "pipe.jpg")  # opening it for reading would wait for a writer forever
    fates[f"{src.as_posix()}/pipe.jpg"] = "not_a_file"
    (root / "elsewhere" / "far.jpg").write_bytes(jpeg(scene(49, 200)))
    (src / "linked").symlink_to(root / "elsewhere")  # followed by default
    fates[f"{src.as_posix()}/linked/far.jpg"] = "kept"
    (src / "loop").symlink_to(src)  # a folder that contains itself
    fates[f"{src.as_posix()}/loop"] = "symlink"
    (src / "dangling.jpg").symlink_to(root / "nowhere.jpg")
    fates[f"{src.as_posix()}/dangling.jpg"] = "unreadable"
    (src / "locked").chmod(0)
    fates[f"{src.as_posix()}/locked"] = "unreadable"
    return fates


def kiln_source(out: Path, *overrides: str) -> None:
    """`kiln source` in a child process. As root it runs without the capabilities that let root read any folder,
    so a folder without permissions is unreadable to it as it would be to a user."""
    cmd = [
        sys.executable,
        "-c",
        "from kiln.cli import main; raise SystemExit(main())",
        "source",
        "--out",
        str(out),
        *overrides,
    ]
    if os.geteuid() == 0:
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *cmd]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def fates_after(tmp_path: Path, listing: Path, cfg, run: str) -> dict[str, tuple[str, str, str]]:
    """ingest -> filter -> dedup from a listing: each uri's (fate, id, detail)."""
    out = tmp_path / run
    run_stage("ingest", listing, out / "m", cfg)
    run_stage("filter", out / "m", out / "f", cfg)
    run_stage("dedup", out / "f", out / "d", cfg)
    got = {}
    for stage in "mfd":
        for r in read_dataset(out / stage / "rejected").to_pylist():
            got[r["uri"]] = (r["reason"], r["id"], r["detail"])
    for r in read_dataset(out / "d" / "kept").to_pylist():
        got[r["uri"]] = ("kept", r["id"], "")
    return got


@pytest.fixture
def corpus(tmp_path):
    fates = hostile_corpus(tmp_path)
    yield tmp_path / "src", fates
    (tmp_path / "src" / "locked").chmod(0o755)


@pytest.mark.slow
def test_every_hostile_file_meets_its_fate_and_the_outputs_reproduce(corpus, tmp_path):
    src, expected = corpus
    kiln_source(tmp_path / "source", f"data.source={src}")
    cfg = load_config(LIMITS)
    got = fates_after(tmp_path, tmp_path / "source" / "listing.parquet", cfg, "one")
    assert {u: f for u, (f, _, _) in got.items() if expected.get(u) != "twin"} == {
        u: f for u, f in expected.items() if f != "twin"
    }

    # byte copies get one reason: the three copies all point at the larger original; the twins at each other's md5
    original = got[f"{src.as_posix()}/photos/original.jpg"][1]
    assert {got[f"{src.as_posix()}/photos/copy-{i}.jpg"][2] for i in (1, 2, 3)} == {original}
    twins = sorted(got[f"{src.as_posix()}/photos/twin-{i}.jpg"] for i in (1, 2))
    assert [t[0] for t in twins] == ["exact_duplicate", "kept"] and twins[0][2] == twins[1][1]

    # the names that look like uri syntax read back as themselves
    assert read_bytes(f"{src.as_posix()}/photos/x::y.jpg") == (src / "photos" / "x::y.jpg").read_bytes()
    assert split_uri(tar_uri(f"{src.as_posix()}/shards/odd#%name.tar", "000.jpg")) == (
        f"{src.as_posix()}/shards/odd#%name.tar",
        "000.jpg",
    )

    # a second run writes the same bytes: no detail carries a memory address or anything else that changes
    fates_after(tmp_path, tmp_path / "source" / "listing.parquet", cfg, "two")
    for stage in "mfd":
        one, two = (sorted((tmp_path / run / stage / "rejected").glob("*.parquet")) for run in ("one", "two"))
        assert [p.read_bytes() for p in one] == [p.read_bytes() for p in two]


@pytest.mark.slow
def test_symlinks_can_be_refused_at_the_listing_or_at_ingest(corpus, tmp_path):
    src, _ = corpus
    linked = f"{src.as_posix()}/linked"
    kiln_source(tmp_path / "source", f"data.source={src}", "data.ingest.symlinks=refuse")
    listing = pq.read_table(tmp_path / "source" / "listing.parquet").to_pylist()
    refused = {r["uri"]: r["problem"] for r in listing if r["symlink"]}
    assert refused == {
        linked: "symlink",
        f"{src.as_posix()}/loop": "symlink",
        f"{src.as_posix()}/dangling.jpg": "symlink",
    }

    # listed by a door that has no config (`kiln stage ingest FOLDER`), the link is followed; ingest still refuses it
    cfg = load_config([*LIMITS, "data.ingest.symlinks=refuse"])
    out = ingest(list_inputs(src), cfg)
    reasons = {r["uri"]: (r["reason"], r["detail"]) for r in out.rejected.to_pylist()}
    assert reasons[f"{linked}/far.jpg"] == (
        "symlink",
        f"reached through the symlink {linked} (data.ingest.symlinks=refuse)",
    )


def test_list_entries_are_confined_to_the_lists_folder_and_bad_entries_are_rejected(tmp_path):
    lists = tmp_path / "lists"
    (lists / "photos").mkdir(parents=True)
    (lists / "photos" / "ok.jpg").write_bytes(jpeg(scene(50, 200)))
    (tmp_path / "outside.jpg").write_bytes(jpeg(scene(51, 200)))
    uris = [
        f"{lists}/photos/ok.jpg",
        "/etc/passwd",
        "/dev/zero",
        f"{lists}/../outside.jpg",
        None,
        "",
        "photos/nul\0.jpg",
    ]
    pq.write_table(pa.table({"uri": pa.array(uris, pa.string())}), lists / "list.parquet")
    pq.write_table(pa.table({"uri": [5]}), lists / "numbers.parquet")
    (lists / "list.txt").write_bytes(f"{lists}/photos/ok.jpg\n".encode() + b"caf\xe9.jpg\n")
    listing = list_source([str(lists / "list.parquet"), str(lists / "numbers.parquet"), str(lists / "list.txt")])
    out = ingest(listing, load_config())
    got = {r["uri"]: (r["reason"], r["detail"]) for r in out.rejected.to_pylist()}
    assert out.kept.column("uri").to_pylist() == [f"{lists}/photos/ok.jpg"]
    assert {u: reason for u, (reason, _) in got.items()} == {
        "/etc/passwd": "outside_roots",
        "/dev/zero": "outside_roots",
        f"{lists}/../outside.jpg": "outside_roots",
        f"{lists}/list.parquet [row 4]": "bad_uri",  # null
        f"{lists}/list.parquet [row 5]": "bad_uri",  # empty
        f"{lists}/list.parquet [row 6]": "bad_uri",  # a NUL byte
        f"{lists}/numbers.parquet [row 0]": "bad_uri",  # not a string
        f"{lists}/list.txt [line 2]": "bad_uri",  # not UTF-8
    }
    assert got[f"{lists}/numbers.parquet [row 0]"][1] == "the uri is int '5', not a string"

    # a root the config adds is readable; what lies there is still only read if it is a regular file
    out = ingest(listing, load_config(["data.ingest.roots=[/dev,/etc]"]))
    got = {r["uri"]: r["reason"] for r in out.rejected.to_pylist()}
    assert (got["/dev/zero"], got["/etc/passwd"]) == ("not_a_file", "not_an_image")


def test_filter_judges_the_file_it_reads_not_the_manifest(tmp_path):
    for name, seed in (("a.jpg", 60), ("b.jpg", 61), ("c.jpg", 62)):
        (tmp_path / name).write_bytes(jpeg(scene(seed, 200)))
    (tmp_path / "bomb.png").write_bytes(png_header_only(2000, 2000))
    cfg = load_config(LIMITS)
    manifest = ingest(list_inputs(tmp_path), cfg).kept
    rows = {Path(r["uri"]).name: r for r in manifest.to_pylist()}
    rows["bomb.png"] |= {"width": 640, "height": 480}  # a manifest that declares the bomb small
    rows["c.jpg"] |= {"width": 400}  # ... and a picture wider than it is
    edited = bytearray((tmp_path / "a.jpg").read_bytes())
    edited[len(edited) // 2] ^= 0xFF
    (tmp_path / "a.jpg").write_bytes(edited)  # edited after ingest: the same size, other bytes
    (tmp_path / "b.jpg").unlink()
    os.mkfifo(tmp_path / "b.jpg")  # replaced by a FIFO: refused, not waited on
    out = filter_stage(pa.Table.from_pylist(list(rows.values()), schema=manifest.schema), cfg)
    got = {Path(r["uri"]).name: (r["reason"], r["detail"]) for r in out.rejected.to_pylist()}
    assert got["bomb.png"] == ("too_many_pixels", "2000x2000 > 1000000 pixels (the manifest said PNG 640x480)")
    assert got["a.jpg"][0] == "changed_since_ingest" and "md5" in got["a.jpg"][1]
    assert got["b.jpg"][0] == "not_a_file"
    assert got["c.jpg"] == ("changed_since_ingest", "the manifest says JPEG 400x200, the header JPEG 200x200")


def test_a_large_file_is_hashed_in_chunks_not_held_in_memory(tmp_path):
    big = jpeg(scene(70, 200)) + bytes(16 * 2**20)  # a picture with 16 MiB after its end marker
    (tmp_path / "big.jpg").write_bytes(big)
    listing = list_inputs(tmp_path)
    tracemalloc.start()
    try:
        out = ingest(listing, load_config())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.kept.column("bytes").to_pylist() == [len(big)]
    assert peak < 4 * 2**20


def test_reject_details_carry_no_memory_address():
    with pytest.raises(DecodeFailure) as caught:
        measure(b"neither a header nor pixels", 10, 10, 0, 256, 128)
    assert " at 0x" not in str(caught.value) and "UnidentifiedImageError" in str(caught.value)
    assert detail_of(ValueError(f"bad {io.BytesIO()!r}")) == "ValueError: bad <_io.BytesIO>"
