"""The browser page, in a real headless browser (Debian's chromium, driven by its chromedriver).

Real agents throughout: fed by real Report streams (tests/rankstream.py), by a real torchrun
job of the harness, or, for the 1,024-rank check, by the coordinator load benchmark's
simulated nodes over real ``Sync`` calls.  The page's text is compared with what the CLI prints.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from headless import chromium

from conftest import AgentProcess, torchrun, wait_for
from rankstream import Stream, hello
from rankwatch.proto import pb

pytestmark = [pytest.mark.e2e]

PAYLOAD = "<script>window.__pwned=1</script><img src=x onerror=\"window.__pwned=2\">boom"
SCREENSHOT = os.environ.get("RANKWATCH_PAGE_SCREENSHOT")   # set to write docs/page.png


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    yield from chromium(tmp_path_factory.mktemp("chromium"))


def _js(browser, script: str):
    return browser.execute_script(script)


def _cells(browser) -> dict[int, str]:
    return {int(k): v for k, v in _js(browser, "return Array.from(document.querySelectorAll('#grid .cell'))"
                                                ".map(c => [c.dataset.rank, c.dataset.state]);")}


def _summaries(browser) -> list[str]:
    return _js(browser, "return Array.from(document.querySelectorAll('#timeline summary')).map(s => s.textContent);")


def _get(url: str, headers: dict | None = None) -> tuple[int, bytes, dict]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def test_ranks_a_rank_exit_story_and_wire_text_that_stays_text(tmp_path, browser):
    agent = AgentProcess(tmp_path / "a.sock").start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with grpc.insecure_channel(f"unix:{agent.sock}") as ch:
            r0 = Stream(ch, hello(0, world_size=2))
            r1 = Stream(ch, pb.Hello(**{**_hello_fields(1), "pid": child.pid}))
            wait_for(lambda: len(agent.status()["ranks"]) == 2, 10, what="both ranks")
            browser.get(f"http://127.0.0.1:{agent.metrics_port}/")
            assert wait_for(lambda: set(_cells(browser)) == {0, 1}, 5, what="both ranks on the page")
            r1.batch(exit=pb.ExitRecord(type="RuntimeError", message=PAYLOAD, step=3, at=time.time(),
                                        thread="MainThread", main_thread=True))
            child.kill()
            child.wait()
            r1.cancel()
            (inc,) = wait_for(lambda: [i for i in agent.status()["incidents"] if i["kind"] == "rank_exit"],
                              30, what="the rank_exit incident")
            seen = time.monotonic()
            wait_for(lambda: any(inc["id"] in s for s in _summaries(browser)), 3, what="the exit on the page")
            assert time.monotonic() - seen <= 3
            _js(browser, f"document.querySelector('details[data-id=\"{inc['id']}\"] summary').click();")
            story = wait_for(lambda: (t := _js(browser, f"return document.querySelector('details[data-id="
                                                         f"\"{inc['id']}\"] pre').textContent;")) != "loading…" and t,
                             5, what="the story")
            cli = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "diagnose", "--agent", str(agent.addr),
                                  inc["id"]], capture_output=True, text=True, timeout=60, check=True).stdout
            assert story.strip() == cli.strip() and PAYLOAD in story
            assert _js(browser, "return typeof window.__pwned;") == "undefined"
            assert _js(browser, "return document.querySelectorAll('img, #timeline script').length;") == 0
            r0.cancel()
    finally:
        child.kill()
        agent.stop()


def _hello_fields(rank: int) -> dict:
    h = hello(rank, world_size=2)
    return {"rank": h.rank, "world_size": h.world_size, "node_id": h.node_id, "backend": h.backend,
            "op_names": list(h.op_names)}


def test_a_token_guards_the_page_and_its_json_not_metrics(tmp_path, browser):
    token = "s3cret-token"
    (tmp_path / "token").write_text(token + "\n")
    (tmp_path / "token").chmod(0o600)
    agent = AgentProcess(tmp_path / "t.sock", extra=("--token-file", str(tmp_path / "token"))).start()
    base = f"http://127.0.0.1:{agent.metrics_port}"
    try:
        for path in ("/", "/status.json", "/story?id=x"):
            assert _get(base + path)[0] == 401, path
            assert _get(base + path, {"Authorization": "Bearer wrong"})[0] == 401, path
        code, body, _ = _get(base + "/status.json", {"Authorization": f"Bearer {token}"})
        assert code == 200 and b'"node":"n0"' in body
        assert _get(base + "/", {"Authorization": f"Bearer {token}"})[0] == 200
        assert _get(base + "/metrics")[0] == 200
        browser.delete_all_cookies()
        browser.get(base + "/")
        assert _js(browser, "return document.querySelector('input[name=token]') !== null;")
        assert _js(browser, "return document.querySelector('#grid') === null;")
        field = browser.find_element("name", "token")
        field.send_keys(token)
        field.submit()
        wait_for(lambda: int(_js(browser, "return document.body.dataset.polls || 0;")) > 0, 10, what="the page")
        cookie = browser.get_cookie("rankwatch_session")
        assert cookie and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert token not in cookie["value"]
    finally:
        agent.stop()


def test_a_sigstopped_rank_of_a_real_job_shows_hung_on_the_page(tmp_path, browser):
    agent = AgentProcess(tmp_path / "j.sock").start()
    job = torchrun(2, "--steps", "100000", "--step-sleep", "0.05", agent=agent.addr, log=tmp_path / "job.log")
    pid = None
    try:
        ranks = wait_for(lambda: [r for r in agent.status()["ranks"] if r["step"] > 3], 120,
                         what="both ranks stepping")
        browser.get(f"http://127.0.0.1:{agent.metrics_port}/")
        wait_for(lambda: _cells(browser) == {0: "ok", 1: "ok"} or None, 10, what="both ranks ok on the page")
        wait_for(lambda: len(agent.status()["ranks"]) == 2 and ranks, 5)
        pid = next(r["pid"] for r in agent.status()["ranks"] if r["rank"] == 1)
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: any(i["kind"] == "hang" for i in agent.status()["incidents"]), 120, interval=0.05,
                 what="the hang in status")
        seen = time.monotonic()
        wait_for(lambda: _cells(browser).get(1) == "hung"
                 and any("hang" in s and "rank 1 " in s for s in _summaries(browser)), 3, interval=0.05,
                 what="the hang naming rank 1 on the page")
        assert time.monotonic() - seen <= 3
        if SCREENSHOT:   # the README's picture
            browser.save_screenshot(SCREENSHOT)
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        agent.stop()


def test_a_1024_rank_job_renders_quickly_and_an_update_is_cheap(tmp_path, browser):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from coordinator_load import SimNode

    from multinode import free_port
    from rankwatch.address import Address
    from rankwatch.agent.config import AgentConfig
    from rankwatch.agent.server import Agent
    from rankwatch.agent.views.live import LiveView
    from rankwatch.credentials import ClientCredentials, open_channel
    from rankwatch.proto import pb_grpc

    tcp = Address.parse(f"127.0.0.1:{free_port()}")
    agent = Agent(AgentConfig(node_id="coord", listen=[Address(path=str(tmp_path / "c.sock")), tcp],
                              coordinators=[tcp], metrics_port=0, metrics_addr="127.0.0.1"))
    agent.start()
    try:
        wait_for(lambda: agent.status().coordinator, 15, what="the agent coordinating")
        born = time.time() - 5
        with open_channel(tcp, ClientCredentials(None)) as ch:
            stub = pb_grpc.AgentStub(ch)
            for i in range(128):
                summary = SimNode(i, 8, slow=False, born=born).summary(time.time())
                summary.run_id = ""
                stub.Sync(summary, timeout=10)
        assert agent.status().ranks_total == 1024
        browser.get(f"http://127.0.0.1:{agent.metrics_port}/")
        wait_for(lambda: len(_cells(browser)) == 1024, 10, what="1,024 cells")
        shown = float(_js(browser, "return document.body.dataset.shownAt;"))
        assert shown <= 2000, f"first full render {shown:.0f} ms after navigation"
        view = LiveView(agent.status, clock=itertools.count(step=10).__next__)   # every call builds
        view.status_json()
        n, t0 = 20, time.thread_time()
        for _ in range(n):
            view.status_json()
        cpu_ms = (time.thread_time() - t0) / n * 1000
        print(f"1,024 ranks: page shown {shown:.0f} ms after navigation; one update {cpu_ms:.1f} ms of CPU")
        assert cpu_ms <= 80
    finally:
        agent.stop()
