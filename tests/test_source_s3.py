"""Your own images where they are: a bucket on a local S3-compatible server (moto's server mode) holding real
photographs with their near-duplicates, WebDataset shards and a Parquet list with captions, run through
`kiln run` to an evaluated checkpoint; a new object marks the lineage stale; failures name the uri."""

from __future__ import annotations

import json

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import start_moto, use_s3_endpoint
from samples import encoded, real_photos, webdataset_tar

from assets.ingest import ingest
from assets.source import SourceError, check_source, list_source
from kiln.config import load_config
from kiln.stage import read_dataset

pytestmark = [pytest.mark.s3]

STAGES = ["manifest", "filtered", "deduped", "captioned", "train_set_pretrain"]
# The real-data profile with the captions the source carries, and offline stand-ins for the models it has no
# copy of here (the main job never calls them; the profile still names a model for every model stage).
WEB_OFFLINE = [
    "data=web", "data.caption.captioner=source", "data.embed.embedder=classical", "data.rewrite.rewriter=rules",
    "data.stand_ins=[classical_embedder,rules_rewriter]",
]  # fmt: skip


def put(s3, bucket: str, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        s3.put_object(Bucket=bucket, Key=key, Body=data)


def lab_bucket(s3, bucket: str) -> dict[str, str]:
    """What a lab keeps: photos under a prefix (with copies), WebDataset shards, a Parquet list with alt text.

    Returns the fate each object should meet, by uri: kept through to training, or the reason it is rejected."""
    photos = {n: im.resize((384, 288)) for n, im in real_photos().items()}
    jpg = {n: encoded(im, "JPEG", quality=92) for n, im in photos.items()}
    s3.create_bucket(Bucket=bucket)
    put(s3, bucket, {
        "photos/astronaut.jpg": jpg["astronaut"],
        "photos/coffee.jpg": jpg["coffee"],
        "photos/coffee-copy.jpg": jpg["coffee"],  # the same bytes
        "photos/coffee-small.jpg": encoded(photos["coffee"].resize((192, 144)), "JPEG", quality=70),  # resized, re-encoded
        "photos/notes.txt": b"not a picture",
    })  # fmt: skip
    put(s3, bucket, {
        "shards/shard-000.tar": webdataset_tar({
            "000": {"jpg": jpg["chelsea"], "txt": b"a tabby cat looking to the side"},
            "001": {"jpg": jpg["rocket"], "json": json.dumps({"caption": "a rocket on the launch pad", "license": "CC0"}).encode()},
        }),
        "shards/shard-001.tar": webdataset_tar({"002": {"jpg": jpg["hubble_deep_field"], "txt": b"galaxies in the deep field"}}),
    })  # fmt: skip
    put(
        s3,
        bucket,
        {"listed/cells.jpg": jpg["immunohistochemistry"], "listed/coins.png": encoded(photos["coins"], "PNG")},
    )
    listed = pa.BufferOutputStream()
    pq.write_table(
        pa.table({
            "uri": [f"s3://{bucket}/listed/cells.jpg", f"s3://{bucket}/listed/coins.png", f"s3://{bucket}/listed/gone.jpg"],
            "caption": ["stained tissue under a microscope", "coins on a table", "an object that was never uploaded"],
            "license": ["CC-BY-4.0", "CC0", "CC0"],
        }),
        listed,
    )  # fmt: skip
    put(s3, bucket, {"lists/captioned.parquet": listed.getvalue().to_pybytes()})
    b = f"s3://{bucket}"
    return {
        f"{b}/photos/astronaut.jpg": "no_caption",  # the prefix carries no captions; captioner=source has none to give
        f"{b}/photos/coffee.jpg": "exact_duplicate",  # the keeper of the same bytes is the smallest id: the copy's
        f"{b}/photos/coffee-copy.jpg": "no_caption",
        f"{b}/photos/coffee-small.jpg": "near_duplicate",
        f"{b}/photos/notes.txt": "not_an_image",
        f"tar://{b}/shards/shard-000.tar#000.jpg": "kept",
        f"tar://{b}/shards/shard-000.tar#001.jpg": "kept",
        f"tar://{b}/shards/shard-001.tar#002.jpg": "kept",
        f"{b}/listed/cells.jpg": "kept",
        f"{b}/listed/coins.png": "kept",
        f"{b}/listed/gone.jpg": "unreadable",
    }


def sources(bucket: str) -> str:
    return f"data.source=[s3://{bucket}/photos/,s3://{bucket}/shards/*.tar,s3://{bucket}/lists/captioned.parquet]"


def fates(data) -> dict[str, str]:
    """Each listed uri's end: `kept` in the train set, or the reason of the stage that rejected it."""
    out = {}
    for stage in STAGES:
        for r in read_dataset(data / stage / "rejected").to_pylist():
            out[r["uri"]] = r["reason"]
    for uri in read_dataset(data / "captioned" / "kept").column("uri").to_pylist():
        out[uri] = "kept"
    return out


def test_a_prefix_shards_and_a_parquet_list_in_a_bucket_are_listed_and_read_in_place(s3):
    expected = lab_bucket(s3, "lab-listing")
    listing = list_source(sources("lab-listing").split("=", 1)[1].strip("[]").split(","))
    assert sorted(listing.column("uri").to_pylist()) == sorted(expected)
    assert all(v is not None for v in listing.column("version").to_pylist()[:5])  # ETags as listed
    manifest = ingest(listing, load_config()).kept.to_pylist()
    by_uri = {r["uri"]: r for r in manifest}
    assert by_uri["tar://s3://lab-listing/shards/shard-000.tar#001.jpg"]["license"] == "CC0"
    assert by_uri["s3://lab-listing/listed/cells.jpg"]["source_caption"] == "stained tissue under a microscope"
    assert not any("testing" in json.dumps(r) for r in manifest)  # no credential is written into a manifest


@pytest.mark.slow
@pytest.mark.integration
def test_kiln_run_on_a_bucket_reaches_an_evaluated_checkpoint_with_every_object_accounted_for(
    s3, tmp_path, monkeypatch, text_encoder_dir
):
    from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
    from dagster._core.loader import LoadingContextForTest

    from dagster_project.definitions import defs
    from dagster_project.resources import KilnResource
    from dagster_project.run import materialize_all
    from dagster_project.sensors import observe_source

    expected = lab_bucket(s3, "lab-run")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / ".dagster"))
    overrides = [
        *WEB_OFFLINE, sources("lab-run"),
        "data.pack.resolution=16", "data.pack.batch_size=4",
        "model.size=micro", "model.patch_size=2", "model.pad_to_multiple=16", "model.text_encoder.max_length=16",
        "model.text_encoder.layers=[-1,-2,-3]", f"model.text_encoder.path={text_encoder_dir}",
        "train.steps=3", "train.warmup_steps=1", "train.batch_size=4", "train.holdout=2", "train.log_every=1", "train.threads=1",
        "train.sample.steps=2", "train.sample.n_per_prompt=1", "train.eval.steps=2", "train.eval.n_per_prompt=1", "metrics.n_per_prompt=1",
    ]  # fmt: skip
    assert materialize_all(overrides)
    data = tmp_path / "data"
    assert fates(data) == expected
    metrics = json.loads((data / "eval" / "metrics.json").read_text())
    assert metrics and (data / "checkpoint" / "model.safetensors").is_file()

    # one more object: an observation of the source marks manifest, and all after it, stale; a run ingests just it
    instance = dg.DagsterInstance.get()
    resource = KilnResource(overrides=overrides, data_dir="data")
    assert observe_source(instance, resource) is None  # nothing changed yet
    put(
        s3,
        "lab-run",
        {"photos/cat.png": encoded(real_photos()["chelsea"].resize((200, 150)).rotate(90, expand=True), "PNG")},
    )
    observation = observe_source(instance, resource)
    assert observation is not None
    instance.report_runless_asset_event(observation)
    stale = CachingStaleStatusResolver(instance, defs.resolve_asset_graph(), LoadingContextForTest(instance))
    assert stale.get_status(dg.AssetKey("manifest")) == StaleStatus.STALE
    before = {r["id"] for t in ("kept", "rejected") for r in read_dataset(data / "manifest" / t).to_pylist()}
    assert materialize_all(overrides, select=["raw_images", "manifest"])
    after = {r["uri"]: r["id"] for t in ("kept", "rejected") for r in read_dataset(data / "manifest" / t).to_pylist()}
    assert set(after.values()) - before == {after["s3://lab-run/photos/cat.png"]}


def test_a_missing_bucket_names_the_uri_before_any_stage(s3):
    with pytest.raises(SourceError, match=r"s3://no-such-bucket/images/: not found"):
        check_source(["s3://no-such-bucket/images/"])


def test_an_empty_prefix_lists_no_objects(s3):
    s3.create_bucket(Bucket="lab-empty")
    with pytest.raises(SourceError, match=r"s3://lab-empty/images/: lists no objects"):
        list_source("s3://lab-empty/images/")


def test_an_object_replaced_after_listing_is_rejected_unreadable(s3):
    s3.create_bucket(Bucket="lab-changes")
    put(
        s3,
        "lab-changes",
        {"a.png": encoded(real_photos()["coins"], "PNG"), "b.png": encoded(real_photos()["camera"], "PNG")},
    )
    listing = list_source("s3://lab-changes/")
    put(s3, "lab-changes", {"a.png": encoded(real_photos()["camera"], "PNG")})  # same key, other bytes
    s3.delete_object(Bucket="lab-changes", Key="b.png")
    rejected = {r["uri"]: r for r in ingest(listing, load_config()).rejected.to_pylist()}
    assert {r["reason"] for r in rejected.values()} == {"unreadable"}
    assert "changed since listing" in rejected["s3://lab-changes/a.png"]["detail"]
    assert "not found" in rejected["s3://lab-changes/b.png"]["detail"]


@pytest.fixture
def other_endpoint(s3_server):
    """Readers pointed elsewhere for one test, then back at the session's server."""
    yield use_s3_endpoint
    use_s3_endpoint(s3_server)


def test_an_unreachable_endpoint_names_the_uri(other_endpoint):
    other_endpoint("http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(SourceError, match=r"s3://lab/images/: .*(Could not connect|Connect)"):
        check_source("s3://lab/images/")


def test_denied_access_names_the_uri(other_endpoint):
    proc, url = start_moto(
        {"INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    )  # this server checks credentials; ours are unknown to it
    try:
        other_endpoint(url)
        with pytest.raises(SourceError, match=r"s3://lab/images/: access denied"):
            check_source("s3://lab/images/")
    finally:
        proc.terminate()


def test_kiln_run_refuses_a_bucket_it_cannot_read_before_any_asset(s3, tmp_path, monkeypatch, capsys):
    from kiln.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / ".dagster"))
    rc = main(["run", *WEB_OFFLINE, "data.source=s3://no-such-bucket/x/"])
    assert rc == 2 and "s3://no-such-bucket/x/: not found" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


def test_a_shard_replaced_after_listing_is_not_read_at_stale_offsets(s3):
    photos = real_photos()
    s3.create_bucket(Bucket="lab-shards")
    put(
        s3,
        "lab-shards",
        {
            "s.tar": webdataset_tar(
                {"a": {"jpg": encoded(photos["coins"], "JPEG")}, "b": {"jpg": encoded(photos["camera"], "JPEG")}}
            )
        },
    )
    listing = list_source("s3://lab-shards/s.tar")  # indexes the shard: member -> offset
    put(
        s3,
        "lab-shards",
        {
            "s.tar": webdataset_tar(
                {"x": {"png": encoded(photos["rocket"], "PNG")}, "b": {"jpg": encoded(photos["astronaut"], "JPEG")}}
            )
        },
    )
    out = ingest(listing, load_config())
    assert out.kept.num_rows == 0 and set(out.rejected.column("reason").to_pylist()) == {"unreadable"}
    assert all("changed" in d for d in out.rejected.column("detail").to_pylist())
