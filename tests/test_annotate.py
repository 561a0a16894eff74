"""Human preference labels: the annotation page in a real headless Chromium shows a pair, takes a key and
stores which image was picked; the label store behaves the same on DuckDB and Postgres; the image shown
left is fixed per pair and balanced; the export makes the picked image the winner, with ties dropped and
counted, for calibration on human labels only."""

from __future__ import annotations

import os
import random
import threading
import urllib.error
import urllib.request
from urllib.parse import urlencode

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.outputs import OutputError
from training.post.annotate import Annotation, make_server
from training.post.labels import (
    DuckDBLabels,
    PostgresLabels,
    human_pairs,
    left_is_winner,
    make_label,
    pairs_sha256,
    picked,
)
from training.post.pairs import PAIRS, PAIRS_FILE, png, read_pairs

WINNER, LOSER = (
    (220, 30, 30),
    (30, 30, 220),
)  # the rewards' winner is red, the loser blue: the test can see which is where


def write_pairs(folder, n: int = 3):
    """n on-policy pairs `pair-0`... (pair-0 and pair-1 show the winner left, pair-2 right); a random seed
    makes the file, and so its labels, this test's own in a shared Postgres."""
    solid = lambda rgb: png(np.full((16, 16, 3), rgb, np.uint8))
    seed = random.getrandbits(62)
    rows = [{"pair_id": f"pair-{i}", "prompt": f"a red square number {i}", "source": "on_policy", "winner_png": solid(WINNER), "loser_png": solid(LOSER),
             "winner_reward": 0.9, "loser_reward": 0.1 * i, "winner_rewards": '{"rubric": 0.9}', "loser_rewards": f'{{"rubric": {0.1 * i}}}',
             "seed": seed, "winner_index": 2 * i, "loser_index": 2 * i + 1} for i in range(n)]  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=PAIRS), folder / PAIRS_FILE)
    return folder


@pytest.fixture
def serving(tmp_path):
    """The page for a 3-pair table, labels in a DuckDB file, served on a free port of 127.0.0.1."""
    pairs = write_pairs(tmp_path / "pairs")
    store = DuckDBLabels(tmp_path / "labels.duckdb")
    server = make_server(Annotation(pairs, store, "ada"))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield pairs, store, f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def browser(tmp_path):
    from chromium import Browser, chromium_binary

    binary = chromium_binary()
    if binary is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("chromium must be installed in CI (scripts/system-deps.sh)")
        pytest.skip("no chromium here; scripts/system-deps.sh installs it")
    b = Browser(binary, tmp_path / "chromium-profile")
    yield b
    b.close()


TEXT = "document.getElementById('{}').textContent.trim()"
IMAGES_LOADED = "document.images.length === 2 && [...document.images].every(i => i.complete && i.naturalWidth > 0)"
IMAGE_COLOURS = """[...document.querySelectorAll('figure img')].map(img => {
  const c = document.createElement('canvas'); c.width = img.naturalWidth; c.height = img.naturalHeight;
  const g = c.getContext('2d'); g.drawImage(img, 0, 0); return Array.from(g.getImageData(0, 0, 1, 1).data.slice(0, 3)); })"""


def shown(browser) -> dict[str, str]:
    """Which image of the pair the page shows on each side, read from the pixels the browser drew."""
    left, right = browser.evaluate(IMAGE_COLOURS)
    return {side: {WINNER: "winner", LOSER: "loser"}[tuple(rgb)] for side, rgb in (("left", left), ("right", right))}


# ------------------------------------------------------------------------------------------ page
@pytest.mark.integration
@pytest.mark.browser
def test_the_page_shows_a_pair_takes_a_key_and_stores_which_image_was_picked(serving, browser):
    pairs, store, url = serving
    browser.goto(url)
    assert browser.evaluate(TEXT.format("prompt")) == "a red square number 0"
    assert browser.evaluate(TEXT.format("counter")).startswith("0 / 3 labelled")
    browser.wait_for(IMAGES_LOADED)
    first = shown(browser)
    assert sorted(first.values()) == ["loser", "winner"]

    browser.press("ArrowRight")
    browser.wait_for(f"{TEXT.format('counter')}.startsWith('1 / 3')")  # the label went in and the page moved on
    assert browser.evaluate(TEXT.format("prompt")) == "a red square number 1"
    browser.wait_for(IMAGES_LOADED)
    second = shown(browser)
    browser.press("1")  # the other key for "left"
    browser.wait_for(f"{TEXT.format('counter')}.startsWith('2 / 3')")
    browser.wait_for(IMAGES_LOADED)
    third = shown(browser)
    browser.press("2")  # the other key for "right"
    browser.wait_for(f"{TEXT.format('counter')}.startsWith('3 / 3')")
    assert browser.evaluate(TEXT.format("prompt")).startswith("All pairs are labelled")

    labels = store.labels(pairs_sha256(pairs))
    assert [(lab.pair_id, lab.annotator, lab.choice, lab.picked) for lab in labels] == [
        ("pair-0", "ada", "right", first["right"]),
        ("pair-1", "ada", "left", second["left"]),
        ("pair-2", "ada", "right", third["right"]),
    ]
    assert (first["left"], third["left"]) == ("winner", "loser")  # the winner is not always on one side


def post_label(url: str, form: dict, origin: str | None = None) -> int:
    headers = {"Origin": origin} if origin else {}
    req = urllib.request.Request(url + "label", data=urlencode(form).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_page_refuses_labels_it_cannot_place_and_labels_from_other_sites(serving):
    pairs, store, url = serving
    sha = pairs_sha256(pairs)
    assert post_label(url, {"pair_id": "pair-0", "pairs": sha, "choice": "both"}) == 400
    assert post_label(url, {"pair_id": "no-such-pair", "pairs": sha, "choice": "left"}) == 400
    assert (
        post_label(url, {"pair_id": "pair-0", "pairs": "0" * 64, "choice": "left"}) == 409
    )  # a page of another pairs table
    assert post_label(url, {"pair_id": "pair-0", "pairs": sha, "choice": "left"}, origin="http://evil.example") == 403
    assert store.labels(sha) == []
    assert (
        post_label(url, {"pair_id": "pair-0", "pairs": sha, "choice": "tie"}) == 200
    )  # followed the redirect to the next pair
    assert [(lab.pair_id, lab.picked) for lab in store.labels(sha)] == [("pair-0", "tie")]


def test_the_page_listens_on_localhost_by_default(tmp_path):
    server = make_server(Annotation(write_pairs(tmp_path / "pairs"), DuckDBLabels(tmp_path / "l.duckdb"), "ada"))
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.server_close()


# ----------------------------------------------------------------------------------------- sides
def test_the_side_of_the_winner_is_fixed_per_pair_and_balanced_over_pairs():
    ids = [f"7:{i}:0:2" for i in range(400)]
    sides = [left_is_winner(i) for i in ids]
    assert sides == [left_is_winner(i) for i in ids]  # the same pair shows the same way on every visit
    assert 0.4 < np.mean(sides) < 0.6  # the winner is not always on one side
    assert (left_is_winner("pair-0"), left_is_winner("pair-2")) == (True, False)
    assert [picked("pair-0", c) for c in ("left", "right", "tie")] == ["winner", "loser", "tie"]
    assert [picked("pair-2", c) for c in ("left", "right", "tie")] == ["loser", "winner", "tie"]
    with pytest.raises(ValueError, match="one of"):
        picked("pair-0", "up")
    with pytest.raises(ValueError, match="annotator"):
        make_label("0" * 64, "p", "pair-0", "  ", "left")


# ----------------------------------------------------------------------------------------- store
@pytest.fixture(params=["duckdb", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request, tmp_path):
    if request.param == "duckdb":
        return DuckDBLabels(tmp_path / "labels.duckdb")
    return PostgresLabels(request.getfixturevalue("dsn"))


def test_the_store_keeps_one_label_per_pair_and_annotator(store):
    sha, other = f"{random.getrandbits(128):032x}", f"{random.getrandbits(128):032x}"  # this test's own keys
    store.add(make_label(sha, "/p", "pair-0", "ada", "left"))
    store.add(make_label(sha, "/p", "pair-0", "bob", "tie"))
    store.add(make_label(sha, "/p", "pair-2", "ada", "left"))
    store.add(make_label(sha, "/p", "pair-0", "ada", "right"))  # ada changes her mind: it replaces her label
    store.add(make_label(other, "/q", "pair-0", "ada", "left"))  # another pairs table's pair-0
    got = store.labels(sha)
    assert [(lab.pair_id, lab.annotator, lab.choice, lab.shown_left, lab.picked) for lab in got] == [
        ("pair-0", "ada", "right", "winner", "loser"),
        ("pair-0", "bob", "tie", "winner", "tie"),
        ("pair-2", "ada", "left", "loser", "loser"),
    ]
    assert all(lab.labelled_at.tzinfo is not None and lab.pairs_dir == "/p" for lab in got)
    assert [lab.pairs_dir for lab in store.labels(other)] == ["/q"]


# ---------------------------------------------------------------------------------------- export
def test_human_pairs_make_the_picked_image_the_winner_and_count_what_they_drop(tmp_path):
    pairs = write_pairs(tmp_path / "pairs", n=5)
    store = DuckDBLabels(tmp_path / "labels.duckdb")
    sha = pairs_sha256(pairs)
    label = lambda pid, who, choice: store.add(make_label(sha, pairs, pid, who, choice))
    label("pair-0", "ada", "left")  # pair-0 shows the winner left: agrees with the rewards
    label("pair-2", "ada", "left")  # pair-2 shows the loser left: the human prefers the rewards' loser
    label("pair-2", "bob", "tie")  # a tie does not outvote a pick
    label("pair-1", "ada", "tie")  # only ties: dropped
    label("pair-3", "ada", "left")  # ada and bob disagree: dropped as a split
    label("pair-3", "bob", "right")
    # pair-4: nobody labelled it
    report = human_pairs(pairs, store, tmp_path / "human")

    out = read_pairs(tmp_path / "human", source="human")  # what dpo(..., source="human") reads
    assert out.num_rows == 2 and set(out.column("source").to_pylist()) == {"human"}
    rows = {r["pair_id"]: r for r in out.to_pylist()}
    src = {r["pair_id"]: r for r in read_pairs(pairs).to_pylist()}
    assert rows["pair-0"]["winner_png"] == src["pair-0"]["winner_png"]
    flipped = rows["pair-2"]
    assert (flipped["winner_png"], flipped["loser_png"]) == (src["pair-2"]["loser_png"], src["pair-2"]["winner_png"])
    assert (flipped["winner_reward"], flipped["winner_rewards"], flipped["winner_index"]) == (
        0.2,
        '{"rubric": 0.2}',
        5,
    )  # all of the picked image
    assert {k: report[k] for k in ("pairs_in", "pairs", "agree_with_rewards", "flipped", "ties", "split", "unlabelled", "labels", "annotators")} == {
        "pairs_in": 5, "pairs": 2, "agree_with_rewards": 1, "flipped": 1, "ties": 1, "split": 1, "unlabelled": 1, "labels": 6, "annotators": 2}  # fmt: skip

    human_pairs(pairs, store, tmp_path / "human")  # a rerun replaces its own output
    with pytest.raises(OutputError):
        human_pairs(pairs, store, pairs)  # never over the candidate pairs


def test_kiln_annotate_export_writes_human_pairs(tmp_path, capsys):
    from kiln.cli import main

    pairs = write_pairs(tmp_path / "pairs")
    db = tmp_path / "labels.duckdb"
    DuckDBLabels(db).add(make_label(pairs_sha256(pairs), pairs, "pair-1", "ada", "right"))
    assert main(["annotate", "--pairs", str(pairs), "--export", str(tmp_path / "human"), "--db", str(db)]) == 0
    assert '"pairs": 1' in capsys.readouterr().out
    assert read_pairs(tmp_path / "human", source="human").column("pair_id").to_pylist() == ["pair-1"]
