"""Screenshots of the checkpoint and evaluation pages for docs/ui.md, from a materialized demo, without rerunning it.

    KILN_DATA=/path/to/data DAGSTER_HOME=$(mktemp -d) .venv/bin/python scripts/ui_screenshots.py record
    DAGSTER_HOME=... .venv/bin/dagster-webserver -m dagster_project.definitions -p 3399 &
    .venv/bin/python scripts/ui_screenshots.py shoot http://127.0.0.1:3399 docs/images

`record` builds both pages with dagster_project.pages from the demo's checkpoint/ and eval/ folders (the
same builders the assets call) and records them as runless materializations in DAGSTER_HOME, a scratch
instance; `shoot` drives Debian's headless `chromium` over DevTools (tests/chromium.py): each page, then
the picture behind one "[Show Markdown]" on it.
"""

from __future__ import annotations

import base64
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPEN = {"checkpoint": "samples", "evaluation": "prompt_following_chart"}  # the picture opened on each page


def record() -> None:
    import dagster as dg
    import torch

    from dagster_project.pages import checkpoint_page, checkpoint_samples, evaluation_page
    from kiln.config import load_config
    from kiln.paths import artifact

    torch.set_num_threads(1)
    ckpt = artifact("checkpoint")
    instance = dg.DagsterInstance.get()
    page = checkpoint_page(ckpt, samples=checkpoint_samples(ckpt, load_config([])))
    instance.report_runless_asset_event(dg.AssetMaterialization(asset_key="checkpoint", metadata=page))
    instance.report_runless_asset_event(
        dg.AssetMaterialization(asset_key="evaluation", metadata=evaluation_page(artifact("eval")))
    )


def shoot(base: str, outdir: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from chromium import Browser, chromium_binary

    outdir.mkdir(parents=True, exist_ok=True)
    browser = Browser(chromium_binary(), Path(tempfile.mkdtemp(prefix="kiln-chromium-")))
    try:
        browser.call("Emulation.setDeviceMetricsOverride", width=1900, height=1500, deviceScaleFactor=1, mobile=False)
        for name, entry in OPEN.items():
            browser.goto(f"{base}/assets/{name}")
            browser.wait_for(
                "document.body.innerText.includes('Metadata') && document.body.innerText.includes('Key')", timeout=60
            )
            time.sleep(2)
            browser.evaluate(
                "[...document.querySelectorAll('button')].filter(b => b.innerText.trim() === 'Skip').forEach(b => b.click()); true"
            )  # the newsletter modal
            time.sleep(1.5)
            _save(browser, outdir / f"ui_{name}.png")
            opened = browser.evaluate(f"""(() => {{ const row = [...document.querySelectorAll('tr')].find(r => r.innerText.trim().startsWith({entry!r}));
                const link = row && [...row.querySelectorAll('*')].find(x => x.children.length === 0 && x.innerText.trim() === '[Show Markdown]');
                if (link) link.click(); return !!link; }})()""")
            if opened:
                time.sleep(2.5)
                _save(browser, outdir / f"ui_{name}_{entry}.png")
    finally:
        browser.close()


def _save(browser, path: Path) -> None:
    from PIL import Image

    path.write_bytes(base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"]))
    Image.open(path).crop((0, 0, 1900, 1100)).quantize(colors=128).save(
        path, optimize=True
    )  # the top of the page, small in git
    print("wrote", path)


if __name__ == "__main__":
    if sys.argv[1:2] == ["record"]:
        record()
    elif sys.argv[1:2] == ["shoot"] and len(sys.argv) == 4:
        shoot(sys.argv[2], Path(sys.argv[3]))
    else:
        sys.exit(__doc__)
