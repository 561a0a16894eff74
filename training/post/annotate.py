"""`kiln annotate`: a local page where a person labels preference pairs, and the export of those labels.

The page shows the prompt and the two images of the next pair this annotator has not labelled (order of
the pairs table), which one on the left fixed by a hash of the pair id (training/post/labels.py). A click or a
key labels it: ArrowLeft or 1 the left image, ArrowRight or 2 the right one, ArrowDown or 0 a tie. The form
POSTs the label, which goes to the label store (DuckDB under the warehouse root, or Postgres), and the page
moves on. Plain http.server and a form: no JavaScript framework, nothing to install. The server binds to
127.0.0.1 unless told otherwise, and refuses a POST whose Origin is another site.
"""

from __future__ import annotations

import html
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

from kiln.progress import log
from training.post.labels import (
    CHOICES,
    LabelStore,
    left_is_winner,
    make_label,
    pairs_sha256,
)
from training.post.pairs import read_pairs

MAX_BODY = 16_384  # a label form is a few hundred bytes
KEYS = {"left": "ArrowLeft or 1", "right": "ArrowRight or 2", "tie": "ArrowDown or 0"}


class Annotation:
    """What the page serves: the candidate pairs (read once), their labels so far, and where labels go."""

    def __init__(self, pairs_dir: Path, store: LabelStore, annotator: str):
        self.pairs_dir = Path(pairs_dir)
        self.sha256 = pairs_sha256(self.pairs_dir)
        table = read_pairs(self.pairs_dir)
        self.order = table.column("pair_id").to_pylist()
        if len(set(self.order)) != len(self.order):
            raise ValueError(f"{self.pairs_dir}: pair ids repeat; a label could not say which pair it is for")
        self.prompt = dict(zip(self.order, table.column("prompt").to_pylist(), strict=True))
        self.png = {
            pid: (w, lo)
            for pid, w, lo in zip(
                self.order, table.column("winner_png").to_pylist(), table.column("loser_png").to_pylist(), strict=True
            )
        }
        self.store, self.annotator = (
            store,
            make_label(self.sha256, self.pairs_dir, "", annotator, "tie").annotator,
        )  # a bad name fails now
        self.lock = threading.Lock()  # one label at a time: a DuckDB file takes one writer
        self.done = {lab.pair_id for lab in store.labels(self.sha256) if lab.annotator == self.annotator}

    def next_pair(self) -> str | None:
        return next((pid for pid in self.order if pid not in self.done), None)

    def image(self, pair_id: str, side: str) -> bytes:
        winner, loser = self.png[pair_id]
        return winner if (side == "left") == left_is_winner(pair_id) else loser

    def label(self, pair_id: str, choice: str) -> None:
        if pair_id not in self.png:
            raise KeyError(pair_id)
        with self.lock:
            self.store.add(make_label(self.sha256, self.pairs_dir, pair_id, self.annotator, choice))
            self.done.add(pair_id)


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kiln annotate</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1rem auto; padding: 0 1rem; max-width: 70rem; color: #222; }}
#prompt {{ font-size: 1.3rem; margin: 1rem 0; }}
.pair {{ display: flex; gap: 1.5rem; }}
figure {{ margin: 0; flex: 1; text-align: center; }}
figure img {{ width: min(100%, 55vh); image-rendering: pixelated; border: 1px solid #ccc; }}
button {{ font-size: 1.1rem; padding: .5rem 1.5rem; margin: .5rem; }}
.keys, #counter {{ color: #555; }}
</style></head><body>
<p id="counter">{done} / {total} labelled &middot; annotator {annotator}</p>
{body}
<p class="keys">Keys: <kbd>&larr;</kbd> or <kbd>1</kbd> picks the left image, <kbd>&rarr;</kbd> or <kbd>2</kbd> the right one,
<kbd>&darr;</kbd> or <kbd>0</kbd> says they are as good (a tie). Pick the image that matches the prompt better and looks better.</p>
</body></html>
"""
FORM = """<p id="prompt">{prompt}</p>
<form id="label" method="post" action="/label">
<input type="hidden" name="pair_id" value="{pair_id}"><input type="hidden" name="pairs" value="{sha}">
<div class="pair">
<figure><img id="left" src="/image?pair={pair_q}&amp;side=left" alt="left image"><br><button name="choice" value="left">Left ({k_left})</button></figure>
<figure><img id="right" src="/image?pair={pair_q}&amp;side=right" alt="right image"><br><button name="choice" value="right">Right ({k_right})</button></figure>
</div>
<p style="text-align:center"><button name="choice" value="tie">Tie ({k_tie})</button></p>
</form>
<script>
const keys = {{ArrowLeft: "left", "1": "left", ArrowRight: "right", "2": "right", ArrowDown: "tie", "0": "tie"}};
document.addEventListener("keydown", (e) => {{
  const choice = keys[e.key];
  const form = document.getElementById("label");
  if (!choice || e.repeat || e.ctrlKey || e.metaKey || e.altKey || form.dataset.sent) return;
  e.preventDefault();
  form.dataset.sent = "1";  // one label per page, however fast the keys come
  form.requestSubmit(form.querySelector(`button[value="${{choice}}"]`));
}});
</script>"""
ALL_DONE = """<p id="prompt">All pairs are labelled. Export them for calibration:
<code>kiln annotate --pairs {pairs} --export OUT</code></p>"""


def page(a: Annotation) -> str:
    pid = a.next_pair()
    if pid is None:
        body = ALL_DONE.format(pairs=html.escape(str(a.pairs_dir)))
    else:
        body = FORM.format(prompt=html.escape(a.prompt[pid]), pair_id=html.escape(pid), pair_q=html.escape(quote(pid, safe="")), sha=a.sha256,
                           k_left=KEYS["left"], k_right=KEYS["right"], k_tie=KEYS["tie"])  # fmt: skip
    return PAGE.format(done=len(a.done), total=len(a.order), annotator=html.escape(a.annotator), body=body)


class Handler(BaseHTTPRequestHandler):
    annotation: Annotation  # set on the subclass make_server builds

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/":
            return self._send(HTTPStatus.OK, "text/html; charset=utf-8", page(self.annotation).encode())
        if url.path == "/image":
            q = parse_qs(url.query)
            pid, side = q.get("pair", [""])[0], q.get("side", [""])[0]
            if pid not in self.annotation.png or side not in ("left", "right"):
                return self._error(HTTPStatus.NOT_FOUND, "no such pair or side")
            return self._send(HTTPStatus.OK, "image/png", self.annotation.image(pid, side), cache=True)
        return self._error(HTTPStatus.NOT_FOUND, "not found")

    def do_POST(self) -> None:
        if urlsplit(self.path).path != "/label":
            return self._error(HTTPStatus.NOT_FOUND, "not found")
        origin = self.headers.get("Origin")
        if origin and origin != "null" and urlsplit(origin).netloc != self.headers.get("Host"):
            return self._error(HTTPStatus.FORBIDDEN, "a label comes from this page only")
        n = int(self.headers.get("Content-Length") or 0)
        if not 0 < n <= MAX_BODY:
            return self._error(HTTPStatus.BAD_REQUEST, "a label form is a small, non-empty body")
        form = {k: v[0] for k, v in parse_qs(self.rfile.read(n).decode("utf-8", "replace")).items()}
        pid, choice = form.get("pair_id", ""), form.get("choice", "")
        if form.get("pairs") != self.annotation.sha256:
            return self._error(HTTPStatus.CONFLICT, "this page is for another pairs table; reload it")
        if pid not in self.annotation.png or choice not in CHOICES:
            return self._error(HTTPStatus.BAD_REQUEST, f"need a pair of this table and a choice in {CHOICES}")
        self.annotation.label(pid, choice)
        self.send_response(HTTPStatus.SEE_OTHER)  # post / redirect / get: a reload does not label twice
        self.send_header("Location", "/")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _send(self, status: HTTPStatus, kind: str, body: bytes, cache: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Cache-Control", "max-age=3600" if cache else "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._send(status, "text/plain; charset=utf-8", (message + "\n").encode())

    def log_message(self, format: str, *args) -> None:
        log.debug("annotate: " + format, *args)


def make_server(annotation: Annotation, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """The page's server, not yet serving (port 0: a free one, see `server.server_port`)."""
    handler = type("AnnotationHandler", (Handler,), {"annotation": annotation})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server
