"""The dashboard in a real headless Chromium against a live 3-node DLedger group.

Method: start three `python -m node` processes (free ports), write some traffic, open
`/dashboard` served by a follower, and wait until the page names the leader, lists
the topic's queues, the group's lag and a drill report, and finds a message by key.
Then kill -9 the leader and wait until the page (still open, polling) names a new
leader, which /health on that node confirms. A screenshot goes to reports/.
Needs Debian's `chromium` and `chromium-driver` (`make install` installs them as
root); without them the test fails and says so — it never skips.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from tests.integration.dledger_group import DLedgerGroup
from tests.integration.test_node_process import ROOT, http

PAGE_TIMEOUT_S = 20.0


def chromium_paths() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        pytest.fail("headless Chromium is required: apt-get install -y chromium chromium-driver "
                    f"(found chromium={browser}, chromedriver={driver}); `make install` does this as root")
    return browser, driver


def open_browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    browser, driver = chromium_paths()
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1600"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=driver), options=opts)


def wait_text(drv, css: str, pred, timeout_s: float = PAGE_TIMEOUT_S) -> str:
    from selenium.webdriver.common.by import By
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = drv.find_element(By.CSS_SELECTOR, css).text
        if pred(text):
            return text
        time.sleep(0.2)
    raise AssertionError(f"{css} never satisfied the check; last text: {text!r}")


@pytest.fixture
def group(tmp_path, monkeypatch):
    reports = tmp_path / "drills"
    reports.mkdir()
    (reports / "drill-leader-kill-20260101-000000.json").write_text(json.dumps({"drill": "leader-kill", "ok": True}))
    monkeypatch.setenv("MQSTORE_REPORTS_DIR", str(reports))   # the node processes inherit it
    g = DLedgerGroup(tmp_path).start()
    yield g
    g.close()


def test_dashboard_follows_a_leader_kill(group):
    from selenium.webdriver.common.by import By
    chromium_paths()
    g = group
    leader = g.leader()
    lp = g.api[leader]
    assert http(lp, "POST", "/topics", {"topic": "DashTopic", "queues": 2})[0] == 200
    msgs = [{"body": f"dash-{i}", "keys": [f"key-{i}"], "queue_id": i % 2} for i in range(10)]
    assert http(lp, "POST", "/topics/DashTopic/messages", {"messages": msgs})[0] == 200
    assert http(lp, "POST", "/groups/DashGroup/offsets", {"topic": "DashTopic", "queue_id": 0, "offset": 2})[0] == 200
    follower = next(n for n in g.nodes if n != leader)

    drv = open_browser()
    try:
        drv.get(f"http://127.0.0.1:{g.api[follower]}/dashboard")
        assert wait_text(drv, "#leader", lambda t: t == leader) == leader
        wait_text(drv, "#served-by", lambda t: f"node {follower}" in t)
        topics = wait_text(drv, "#topics tbody", lambda t: "DashTopic" in t)
        assert "DashTopic 0 0 5" in topics and "DashTopic 1 0 5" in topics
        # Followers apply the offset commit when the next push/heartbeat carries the commit index.
        groups = wait_text(drv, "#groups tbody", lambda t: "DashGroup DashTopic 0 5 2 3" in t)
        assert "DashGroup DashTopic 1 5 0 5" in groups
        wait_text(drv, "#reports", lambda t: "drill-leader-kill-20260101-000000.json" in t)
        drv.find_element(By.ID, "key-topic").send_keys("DashTopic")
        drv.find_element(By.ID, "key-key").send_keys("key-7")
        drv.find_element(By.CSS_SELECTOR, "#by-key button").click()
        wait_text(drv, "#lookup-result", lambda t: '"body": "dash-7"' in t)

        t0 = time.monotonic()
        g.kill9(leader)
        new = wait_text(drv, "#leader", lambda t: t not in ("", leader, "none", "unknown"), timeout_s=30.0)
        seen_s = time.monotonic() - t0
        assert new in g.alive(), (new, g.alive())
        assert g.leader(among=[new], timeout_s=5.0) == new          # the node itself agrees
        rows = wait_text(drv, "#nodes tbody", lambda t: "UNREACHABLE" in t)
        assert leader in rows
        os.makedirs(os.path.join(ROOT, "reports"), exist_ok=True)
        shot = os.path.join(ROOT, "reports", "dashboard-failover.png")   # the latest run's, overwritten
        assert drv.save_screenshot(shot) and os.path.getsize(shot) > 10_000
        print(f"dashboard showed new leader {new} {seen_s:.2f} s after kill -9 of {leader}; screenshot {shot}")
    finally:
        drv.quit()
