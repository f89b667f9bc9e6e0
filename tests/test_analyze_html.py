"""``rankwatch analyze --html``: the report, as text and in a real headless browser.

The browser test opens the written file (a ``file://`` URL) in Debian's chromium, driven by its
chromedriver, and reads the page the way a person would see it: the hottest heatmap cell, the
what-if table, the stories, and that the page asked for nothing over the network.
"""

from __future__ import annotations

import gzip
import json
import re

import pytest
from headless import chromium

from rankwatch.agent.analyze.engine import analyze
from rankwatch.agent.analyze.html_page import render
from rankwatch.agent.analyze.readers import read_paths
from rankwatch.agent.views.story import tell
from tracegen import Job, generate

PAYLOAD = "<script>window.__pwned=1</script>\"><img src=x onerror=\"window.__pwned=2\">boom"
SLOW = 37


def result(ranks: int = 128, steps: int = 50, slow: int = SLOW) -> dict:
    """An ``analyze --json`` object of a job whose rank ``slow`` arrives late from step 5 on."""
    late = [[0.002 * ((r * 7 + s * 3) % 5) for s in range(steps)] for r in range(ranks)]
    for s in range(5, steps):
        late[slow][s] = 0.150 + 0.001 * s
    return {
        "source": "job.jsonl", "ranks": ranks, "steps": steps,
        "incidents": [{"kind": "straggler", "node": "node-3", "rank": slow, "step": 5, "detected_at": 1.7e9,
                       "detail": {"cause": "data", "slowdown": 1.8, "message": PAYLOAD}}],
        "pipeline": {"stages": [{"stage": 0, "ranks": ranks // 2, "compute": 0.10, "step": 0.20, "bubble": 0.5},
                                {"stage": 1, "ranks": ranks // 2, "compute": 0.19, "step": 0.20, "bubble": 0.05}],
                     "imbalance": 1.9, "idle": 0.275, "text": "stage 1 works 1.9x stage 0"},
        "bottleneck": {"kind": "input", "share": 0.41, "shares": {"input": 0.41, "communication": 0.3, "compute": 0.29}},
        "workload_imbalance": None,
        "whatif": [{"kind": "op", "what": PAYLOAD, "speedup": 1.01}, {"kind": "rank", "what": slow, "speedup": 1.6},
                   {"kind": "stage", "what": 1, "speedup": 1.2}],
        "replay": {"error": 0.012, "ok": True, "note": "the replay reproduces the measured step times within 1.2 %"},
        "heatmap": {"ranks": list(range(ranks)), "steps": list(range(100, 100 + steps)), "late": late},
    }


def test_render_escapes_everything_and_tells_diagnose_stories():
    res = result(ranks=4, steps=6, slow=2)
    res["source"] = PAYLOAD
    page = render(res)
    assert "<script" not in page and "<img" not in page and "onerror=\"" not in page
    assert page.count("&lt;script&gt;window.__pwned=1") >= 3     # source, what-if, the incident's story
    story = tell({**res["incidents"][0], "id": "straggler-1"}, [])
    assert story.split("\n")[1].strip() in page.replace("&#x27;", "'")   # diagnose's lines, escaped
    cells = re.findall(r'data-rank="(\d+)" data-step="(\d+)" data-late="([^"]*)"', page)
    assert len(cells) == 4 * 6
    hottest = max(cells, key=lambda c: float(c[2]))
    assert hottest[0] == "2"
    whatif = re.findall(r"<td>([\d.]+)x</td>", page)
    assert whatif == sorted(whatif, reverse=True) == ["1.60", "1.20", "1.01"]
    tags = " ".join(re.findall(r"<[a-zA-Z][^>]*>", page)) + " ".join(re.findall(r"<style>(.*?)</style>", page, re.S))
    assert not re.search(r"\b(src|href)\s*=|url\(|@import", tags)   # nothing for a browser to fetch
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in page


def test_a_job_of_128_ranks_by_50_steps_stays_small():
    page = render(result())
    assert len(re.findall(r"<rect [^>]*data-late=", page)) == 128 * 50
    assert len(page.encode()) < 3_000_000


def test_missing_parts_render_as_notes():
    page = render({"source": "x", "ranks": 0, "steps": 0, "incidents": [], "pipeline": None, "bottleneck": None,
                   "workload_imbalance": None, "whatif": [], "replay": {}, "heatmap": None})
    assert "no pipeline stages" in page and "no incident" in page and "no late arrival" in page


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    yield from chromium(tmp_path_factory.mktemp("chromium"))


def _shown(browser, path, res: dict) -> None:
    path.write_text(render(res))
    browser.get(path.as_uri())
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 10).until(lambda d: d.execute_script("return document.readyState") == "complete")


HOTTEST = """
const cells = Array.from(document.querySelectorAll('#heatmap rect[data-late]')).filter(c => c.dataset.late !== '');
cells.sort((a, b) => parseFloat(b.dataset.late) - parseFloat(a.dataset.late));
const c = cells[0], box = c.getBoundingClientRect();
return {rank: +c.dataset.rank, step: +c.dataset.step, n: cells.length, w: box.width, h: box.height,
        fill: getComputedStyle(c).fill};
"""


def _trace(path, job: Job) -> str:
    """``job``'s trace as JSON Lines, its loader op and every node named with :data:`PAYLOAD`."""
    cols = generate(job)
    cols["op"] = [PAYLOAD if op == "dataloader_next" else op for op in cols["op"]]
    cols["node"] = [f"{PAYLOAD}-{rank // 8}" for rank in cols["rank"]]
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(dict(zip(cols, row))) + "\n" for row in zip(*cols.values()))
    return str(path)


@pytest.mark.e2e
def test_the_report_of_a_generated_job_in_a_browser(tmp_path, browser):
    # 128 ranks (32 replicas x 4 stages), 50 steps; rank 12 (a first stage) computes 1.3x from step 10.
    job = Job(dp=32, pp=4, steps=50, slow_rank=12, slow_from=10, seed=5)
    res = analyze(read_paths([_trace(tmp_path / "job.jsonl.gz", job)]))
    (straggler,) = [i for i in res["incidents"] if i["kind"] == "straggler"]
    assert straggler["rank"] == 12
    _shown(browser, tmp_path / "report.html", res)
    hot = browser.execute_script(HOTTEST)
    assert hot["rank"] == 12 and hot["n"] == 128 * 50
    assert hot["w"] >= 3 and hot["h"] >= 3 and hot["fill"] == "rgb(142, 13, 30)"   # seen, in the top colour
    rows = browser.execute_script("return Array.from(document.querySelectorAll('#whatif-table tr'))"
                                  ".map(r => r.textContent);")
    assert len(rows) == len(res["whatif"]) + 1 >= 3 and rows[1].startswith("rank12")
    assert any(PAYLOAD in r for r in rows)                                # the payload op, as text
    story = browser.execute_script("return document.querySelector('#incidents pre').textContent;")
    assert story == tell(straggler, res["incidents"]) and PAYLOAD in story and "cause: compute" in story
    bars = browser.execute_script("return document.querySelectorAll('#pipeline rect[data-stage]').length;")
    assert bars == 4
    assert browser.execute_script("return typeof window.__pwned;") == "undefined"
    assert browser.execute_script("return document.querySelectorAll('img, script').length;") == 0
    assert browser.execute_script("return performance.getEntriesByType('resource').length;") == 0
