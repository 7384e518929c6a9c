"""``ablate-analyze --report``: one self-contained HTML file, opened in headless Chromium."""

import json
import shutil
import subprocess
from urllib.parse import urlsplit

import matplotlib.image
import numpy as np
import pytest

from ablate.analysis.cli import main
from tests.test_analysis_store import BUDGETS, write_cell

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Headless Chromium as root, with nothing of its own that reaches a network.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")
# Run in a copy of the report only: marks the body once every image has decoded with a size.
PROBE = ("<script>window.addEventListener('load', () => { const imgs = [...document.images]; "
         "document.body.setAttribute('data-images', imgs.length); document.body.setAttribute('data-decoded', "
         "imgs.filter(i => i.complete && i.naturalWidth > 0).length); });</script>")


@pytest.fixture
def report(tmp_path):
    sweep_dir = tmp_path / "runs" / "toy"
    for seed in range(6):
        for policy, budget in [("none", 0.0), ("full", 1.0)] + [(p, b) for b in BUDGETS for p in ("random", "fisher")]:
            write_cell(sweep_dir, policy, budget, seed)
    out = tmp_path / "analysis"
    assert main([str(sweep_dir), "--out", str(out), "--report", "--outcome", "final_reward",
                 "--outcome", "kl_k3_mean", "--primary", "replay", "--margin", "final_reward=0.05"]) == 0
    return out / "report.html"


def test_report_is_one_self_contained_file(report):
    text = report.read_text()
    assert text.count("<img ") == text.count('src="data:image/png;base64,') == 2 * 3 + 1  # 3 plots per outcome, steps
    assert "http://" not in text and "https://" not in text and "<link" not in text
    assert "exact two-sided sign-flip test" in text and "primary 1: replay" in text
    assert "seeds per arm: 6" in text and "|effect| &lt; 0.05" in text


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium: bash .ci/chromium.sh installs it")
def test_report_renders_offline_in_headless_chromium(report, tmp_path):
    probed = tmp_path / "probed.html"
    probed.write_text(report.read_text().replace("</body>", PROBE + "</body>"))
    netlog = tmp_path / "net.json"
    common = [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", f"--log-net-log={netlog}",
              "--virtual-time-budget=5000"]
    dom = subprocess.run([*common, "--dump-dom", probed.as_uri()], capture_output=True, text=True, timeout=120)
    assert 'data-images="7"' in dom.stdout and 'data-decoded="7"' in dom.stdout, dom.stderr[-2000:]
    urls = {event.get("params", {}).get("url", "") for event in json.loads(netlog.read_text())["events"]}
    # Chromium itself still asks Google's services for the time, accounts and component updates
    # (seen in runs with every flag above); those are the browser's, not the page's, and the
    # report names no host at all (test above). Any other request is the report's.
    browser_own = (".google.com", ".googleapis.com", ".gstatic.com", ".gvt1.com")
    external = [url for url in urls if urlsplit(url).scheme in ("http", "https", "ws", "wss")]
    assert not [url for url in external if not (urlsplit(url).hostname or "").endswith(browser_own)]

    shot = tmp_path / "shot.png"
    subprocess.run([*common, f"--screenshot={shot}", "--window-size=1280,2400", report.as_uri()],
                   capture_output=True, timeout=120, check=True)
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2400, 1280)
    # Not blank: text and plots put dark pixels on the white page, in many rows.
    dark_rows = np.count_nonzero((pixels.mean(axis=2) < 0.5).any(axis=1))
    assert dark_rows > 300


def test_report_leads_with_the_verdict_and_holds_every_arm_step_by_step(report):
    text = report.read_text()
    assert text.index("<h2>Verdict: budget or selection?</h2>") < text.index("<table")
    assert "<b>replay: " in text and "<b>fisher: " in text  # the answers the command prints
    assert text.index('alt="steps"') > text.index("<h2>Every arm step by step</h2>")


def test_every_figure_of_the_report_is_captioned_with_its_title_naming_what_it_draws(report):
    import base64
    import html
    import io
    import re

    from PIL import Image

    from tests.test_analysis_plots import title_names_what_is_drawn

    figures = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)"><figcaption>([^<]*)</figcaption>',
                         report.read_text())
    assert len(figures) == 2 * 3 + 1
    for stem, data, caption in figures:
        with Image.open(io.BytesIO(base64.b64decode(data))) as png:
            title = png.text["Title"]
        assert html.unescape(caption) == title and title_names_what_is_drawn(stem, title), (stem, title)


# Opens every folded section and records the page's width at the window's width.
WIDTH = ("<script>window.addEventListener('load', () => { document.querySelectorAll('details').forEach(d => "
         "d.open = true); document.body.setAttribute('data-width', document.documentElement.scrollWidth + ' ' + "
         "window.innerWidth); });</script>")


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium: bash .ci/chromium.sh installs it")
def test_report_fits_a_1280_pixel_window_without_a_horizontal_scroll_bar(report, tmp_path):
    probed = tmp_path / "width.html"
    probed.write_text(report.read_text().replace("</body>", WIDTH + "</body>"))
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,2400",
                          "--virtual-time-budget=5000", "--dump-dom", probed.as_uri()],
                         capture_output=True, text=True, timeout=120)
    width, window = map(int, dom.stdout.split('data-width="')[1].split('"')[0].split())
    assert window == 1280 and width <= 1280, (width, window)
