"""The caption stage: captions from the demo truth by content hash, every row accounted for."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pytest

from assets.caption import Captioner, SceneMetadataCaptioner, caption_rows, make_captioner
from assets.demo_corpus import write_demo_corpus
from kiln.config import ConfigError, load_config
from kiln.reasons import Reason
from kiln.schemas import DEDUPED
from kiln.stage import Summary, read_dataset, run_stage, write_table


def deduped_table(truth: pa.Table, images: Path, uri_prefix: str = "") -> pa.Table:
    """DEDUPED rows for every truth file, with plausible filter statistics (the stages before are not needed here)."""
    rows = truth.to_pylist()
    uris = [uri_prefix + str(images / r["file"]) for r in rows]
    ids = [hashlib.sha1(u.encode()).hexdigest()[:16] for u in uris]
    n = len(rows)
    cols = {
        "id": ids,
        "uri": uris,
        "bytes": [r["bytes"] for r in rows],
        "md5": [r["md5"] for r in rows],
        "format": [r["format"] for r in rows],
        "width": [r["width"] or 0 for r in rows],
        "height": [r["height"] or 0 for r in rows],
        "mode": ["RGB"] * n,
        "exif_orientation": [1] * n,
        "n_frames": [1] * n,
        "aspect": [1.0] * n,
        "laplacian_var": [300.0] * n,
        "entropy": [5.5] * n,
        "white_ratio": [0.0] * n,
        "black_ratio": [0.0] * n,
        "border_share": [0.0] * n,
        "flat_share": [0.2] * n,
        "phash": [bytes(18)] * n,
        "colorhash": [bytes(8)] * n,
        "dup_group": ids,
    }
    return pa.Table.from_pylist(pa.Table.from_pydict(cols).to_pylist(), schema=DEDUPED)  # source columns: none carried


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, pa.Table]:
    out = tmp_path_factory.mktemp("demo")
    return out, write_demo_corpus(out, n=60, seed=1)


def test_scene_metadata_captioner_finds_captions_by_content_whatever_the_uri(demo):
    out, truth = demo
    captioner = make_captioner(load_config([f"data.caption.truth={out / 'truth.parquet'}"]).data.caption)
    assert isinstance(captioner, Captioner) and isinstance(captioner, SceneMetadataCaptioner)
    assert captioner.name == "scene_metadata:demo-truth"
    expected = {r["md5"]: r["caption"] for r in truth.to_pylist()}
    for prefix in ("", "/mnt/elsewhere", "shards/part-0.tar::"):
        rows = deduped_table(truth, out / "images", prefix)
        assert captioner.caption(rows) == [expected[m] for m in rows.column("md5").to_pylist()]


def test_caption_stage_keeps_captioned_rows_and_rejects_the_rest(demo, tmp_path):
    out, truth = demo
    rows = deduped_table(truth, out / "images")
    stranger = rows.slice(0, 1).to_pylist()[0] | {"id": "f" * 16, "uri": "elsewhere/x.png", "md5": "0" * 32}
    rows = pa.concat_tables([rows, pa.Table.from_pylist([stranger], schema=DEDUPED)])  # a file the truth never saw
    write_table(rows, tmp_path / "deduped" / "part-00000.parquet")
    cfg = load_config([f"data.caption.truth={out / 'truth.parquet'}", "cluster.workers=1"])

    summary = run_stage("caption", tmp_path / "deduped", tmp_path / "captioned", cfg)

    no_caption = {r["md5"] for r in truth.to_pylist() if r["caption"] is None} | {"0" * 32}
    expected_rejects = sum(m in no_caption for m in rows.column("md5").to_pylist())
    assert summary.input_rows == rows.num_rows == summary.kept + summary.rejected
    assert summary.by_reason == {Reason.NO_CAPTION: expected_rejects}
    assert Summary.read(tmp_path / "captioned") == summary
    kept = read_dataset(tmp_path / "captioned" / "kept")
    rejected = read_dataset(tmp_path / "captioned" / "rejected")
    assert "f" * 16 in rejected.column("id").to_pylist()
    assert set(kept.column("caption_source").to_pylist()) == {"scene_metadata:demo-truth"}
    assert all(c.strip() for c in kept.column("caption").to_pylist())
    assert set(kept.column("id").to_pylist()).isdisjoint(rejected.column("id").to_pylist())


class BlankCaptioner:
    """A captioner that answers with empty strings: the stage must treat that as no caption."""

    name = "blank"

    def caption(self, rows: pa.Table) -> list[str | None]:
        return ["  "] * rows.num_rows


def test_blank_captions_are_rejected_not_passed_on(demo):
    out, truth = demo
    result = caption_rows(deduped_table(truth, out / "images"), BlankCaptioner())
    assert result.kept.num_rows == 0
    assert set(result.rejected.column("reason").to_pylist()) == {Reason.NO_CAPTION}


def test_missing_truth_and_unknown_captioner_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="cfg.data.caption.truth"):
        SceneMetadataCaptioner(tmp_path / "nope.parquet")
    with pytest.raises(ConfigError, match="data.caption.captioner"):
        load_config(["data.caption.captioner=crystal_ball"])
