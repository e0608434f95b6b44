"""The controller's dashboard in a real headless Chromium: three controllers and a classic
group (master + slave) reporting to them.

Method: start three `python -m ha` controllers and brokers 0 and 1 of broker-b (SYNC_MASTER,
controllerAddr listing all three) on free loopback ports, wait until the controllers put both
brokers in the SyncStateSet, then open `/dashboard` served by a controller that is not the
Raft leader. The page must name itself a controller, the Raft leader and its term, and show
broker-b with master 0, the master's address, its epoch and SyncStateSet "0,1" — the values
GET /groups answers. Then kill -9 the master and wait until the still-open page shows broker 1
as master with a higher epoch and SyncStateSet "1". Screenshot to reports/.
Regression: the page read the Raft term from `health.raft.term`, which a controller does not
send (it sends `raft_term`), so the term always showed "-".
Needs Debian's `chromium` and `chromium-driver`; without them the test fails and says so.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.integration.test_dashboard_browser import chromium_paths, open_browser, wait_text
from tests.integration.test_ha_controllers3 import Group3
from tests.integration.test_ha_processes import ROOT, http, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def group3(tmp_path):
    g = Group3(str(tmp_path))
    yield g
    g.stop_all()


def first_row(drv) -> list[str]:
    """The cells of the groups table's first row, read in one step (the page re-renders every second)."""
    return drv.execute_script("return Array.from(document.querySelectorAll("
                              "'#nodes tbody tr:first-child td'), td => td.textContent)")


def groups_doc(g: Group3, ctl: int) -> dict:
    st, doc = http("GET", f"http://127.0.0.1:{g.ctl_api[ctl]}/groups", timeout=2)
    assert st == 200, doc
    return next(x for x in doc["groups"] if x["broker_name"] == "broker-b")


def test_controller_dashboard_shows_groups_master_epoch_and_sync_state_set(group3):
    from selenium.webdriver.common.by import By
    chromium_paths()
    g = group3
    g.start_controllers()
    g.start_broker(0)
    g.wait_role(0, "MASTER")
    g.start_broker(1)
    g.wait_role(1, "SLAVE")
    wait_for(lambda: g.sss(g.leader_controller() or 0) == [0, 1], timeout=30, what="slave joins the SyncStateSet")
    (leader,) = wait_for(lambda: (lambda c: None if c is None else (c,))(g.leader_controller()), timeout=10,
                         what="one leader controller")   # (c,): controller 0 is a leader too
    follower = next(i for i in range(3) if i != leader)
    wait_for(lambda: g.sss(follower) == [0, 1], timeout=10, what="the follower controller agrees")
    before = groups_doc(g, follower)

    drv = open_browser()
    try:
        drv.get(f"http://127.0.0.1:{g.ctl_api[follower]}/dashboard")
        # The roles as they are when the page is read: CI saw leadership move between the
        # start-up and these checks (once to the controller this page is served by); the page
        # must then show the new roles.
        def shows_its_own_role(text: str) -> bool:
            now = g.leader_controller()
            return now is not None and text == f"controller · {'LEADER' if now == follower else 'FOLLOWER'}"
        wait_text(drv, "#served-by", shows_its_own_role)
        def shows_the_leader(text: str) -> bool:
            now = g.leader_controller()
            return now is not None and text == f"127.0.0.1:{g.ctl_api[now]}"
        wait_text(drv, "#leader", shows_the_leader)
        term = wait_text(drv, "#term", lambda t: t.isdigit())
        assert int(term) >= 1
        head = drv.find_element(By.CSS_SELECTOR, "#nodes thead").text
        assert "Master epoch" in head and "SyncStateSet" in head
        row = wait_text(drv, "#nodes tbody", lambda t: "broker-b" in t and " 0,1 " in f" {t} ")
        cells = first_row(drv)
        assert cells[:6] == ["broker-b", "classic", "0", f"127.0.0.1:{g.api[0]}", str(before["master_epoch"]),
                             "0,1"], (cells, row)
        assert f"0=127.0.0.1:{g.api[0]}" in cells[8] and f"1=127.0.0.1:{g.api[1]}" in cells[8]
        # the page hides what only a node has
        assert not drv.find_element(By.ID, "topics-section").is_displayed()
        assert drv.find_element(By.ID, "signin").get_attribute("hidden") is not None   # no ACL here

        t0 = time.monotonic()
        g.procs["b0"].send_signal(signal.SIGKILL)
        g.procs["b0"].wait()
        deadline = time.monotonic() + 45.0
        while first_row(drv)[2:4] != ["1", f"127.0.0.1:{g.api[1]}"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert first_row(drv)[2:4] == ["1", f"127.0.0.1:{g.api[1]}"], first_row(drv)
        seen_s = time.monotonic() - t0
        cells = first_row(drv)
        after = groups_doc(g, follower)
        assert cells[2] == "1" and int(cells[4]) > before["master_epoch"], cells
        assert int(cells[4]) == after["master_epoch"]
        deadline = time.monotonic() + 20.0
        while first_row(drv)[5] != "1" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert first_row(drv)[5] == "1", first_row(drv)          # the SyncStateSet is the new master
        os.makedirs(os.path.join(ROOT, "reports"), exist_ok=True)
        shot = os.path.join(ROOT, "reports", "controller-dashboard.png")
        assert drv.save_screenshot(shot) and os.path.getsize(shot) > 10_000
        print(f"\ncontroller dashboard showed master 1 (epoch {cells[4]}) {seen_s:.2f} s after kill -9 of "
              f"master 0; load {os.getloadavg()[0]:.2f}; screenshot {shot}")
    finally:
        drv.quit()
