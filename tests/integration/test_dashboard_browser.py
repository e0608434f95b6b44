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
import tempfile
import time
import weakref

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
    # Chromium's own temp files go to a directory of ours: its singleton-socket directory
    # (/tmp/org.chromium.Chromium.*) outlives quit(), four of them left by every test run.
    tmp = tempfile.mkdtemp(prefix="mqstore-chromium-")
    drv = webdriver.Chrome(service=Service(executable_path=driver, env={**os.environ, "TMPDIR": tmp}), options=opts)
    weakref.finalize(drv, shutil.rmtree, tmp, True)
    return drv


def wait_text(drv, css: str, pred, timeout_s: float = PAGE_TIMEOUT_S) -> str:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        try:
            text = drv.find_element(By.CSS_SELECTOR, css).text
        except StaleElementReferenceException:   # the poll replaced it between find and read
            continue
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


# --- signed requests (aclEnable=true) ---------------------------------------------------------------
SIGN_JS = os.path.join(ROOT, "node", "dashboard", "static", "sign.js")
# (path, query) pairs that exercise the canonicalisation: spaces, "+", UTF-8, an encoded "/",
# malformed and non-UTF-8 escapes, the kept characters "|@:~%", repeated and valueless keys.
TARGET_VECTORS = [
    ("/topics", ""),
    ("/topics/a b/messages", "key=a+b&max=32"),
    ("/topics/%E4%BD%A0%E5%A5%BD/queues/0/messages", "offset=7&max=8"),
    ("/groups/g%2Fx/progress", "b=2&a=1&a=0"),
    ("/a%ZZb/%FF/%", "flag&x=&=v"),
    ("/x|y@z:w~%7E", "k=%E4%BD%A0&k=%C3%A9&k=z&K=1"),
    ("/transactions/pending", "producer_group=pg%2B1&n=1%252"),
    ("/topics/%F0%9F%98%80", "e=%F0%9F%98%80&d=%EF%BF%BF"),
]


def _static_server():
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=os.path.dirname(SIGN_JS)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_sign_js_matches_acl_py_on_vectors():
    """The page's signing code run in Chromium gives node/acl.py's canonical target and headers."""
    from node.acl import canonical_target, sign_headers
    chromium_paths()
    srv = _static_server()
    drv = open_browser()
    try:
        drv.get(f"http://127.0.0.1:{srv.server_address[1]}/")     # an http://127.0.0.1 page: a secure context
        drv.execute_script(open(SIGN_JS, encoding="utf-8").read())
        assert drv.execute_script("return window.isSecureContext && typeof MQSign.headers") == "function"
        got = drv.execute_script(
            "return arguments[0].map(([p, q]) => MQSign.canonicalTarget(p, MQSign.parseQsl(q)))", TARGET_VECTORS)
        assert got == [canonical_target(p, q) for p, q in TARGET_VECTORS]
        drv.set_script_timeout(10)
        cases = [("GET", "/topics", "", 1_790_000_000_000, "n" * 16),
                 ("post", "/topics/orders/messages", '{"messages":[{"body":"héllo"}]}', 1_790_000_000_123,
                  "abcDEF_-0123456789xyz"),
                 ("GET", "/groups/g%20x/progress?topic=a+b&z=%E4%BD%A0", "", 1_790_000_000_999, "Q" * 64)]
        for method, url, body, now, nonce in cases:
            js = drv.execute_async_script(
                "const done = arguments[arguments.length - 1];"
                "MQSign.headers('ops-admin', 's3cret:key@1', arguments[0], arguments[1], arguments[2], arguments[3],"
                " arguments[4]).then(done, e => done({error: String(e)}));", method, url, body, now, nonce)
            assert js == sign_headers("ops-admin", "s3cret:key@1", method, url, None, body.encode(), now, nonce), url
        # what the browser sends for a URL it normalises is what the node rebuilds
        assert drv.execute_script("return MQSign.targetOf('/topics/a b/messages?key=a+b&max=1')") \
            == canonical_target("/topics/a%20b/messages", "key=a+b&max=1")
        fresh = drv.execute_script("return [MQSign.newNonce(), MQSign.newNonce()]")
        assert fresh[0] != fresh[1] and all(len(n) == 24 and n.replace("-", "").replace("_", "").isalnum()
                                            for n in fresh)
    finally:
        drv.quit()
        srv.shutdown()
        srv.server_close()


ACL_TOPIC = "SignedTopic"
ACL_DOC = {"accounts": [
    {"accessKey": "ops-admin", "secretKey": "admin-secret-1", "admin": True},
    {"accessKey": "reader01", "secretKey": "read-secret", "defaultTopicPerm": "DENY"},
]}


def test_dashboard_signs_its_requests_on_an_acl_node(tmp_path):
    """aclEnable=true: the page asks to sign in, a wrong key shows the 401, right keys show the topics."""
    from selenium.webdriver.common.by import By
    from tests.integration.test_acl_node import request
    from tests.integration.test_node_process import NodeProcess, free_port, write_conf
    chromium_paths()
    acl_path = tmp_path / "acl.json"
    acl_path.write_text(json.dumps(ACL_DOC))
    port = free_port()
    conf = write_conf(tmp_path, port, f"aclEnable=true\naclFile={acl_path}\n")
    node = NodeProcess(conf, port, str(tmp_path / "node.log"))
    node.start()
    drv = None
    try:
        status, doc, _, _ = request(port, "POST", "/topics", {"topic": ACL_TOPIC, "queues": 2}, headers=_signed(
            port, "POST", "/topics", {"topic": ACL_TOPIC, "queues": 2}))
        assert status == 200, doc
        drv = open_browser()
        drv.get(f"http://127.0.0.1:{port}/dashboard")
        wait_text(drv, "#auth-state", lambda t: "sign in required" in t)
        assert drv.find_element(By.ID, "signin").is_displayed()
        assert drv.find_element(By.CSS_SELECTOR, "#topics tbody").text == ""

        def sign_in(ak: str, sk: str) -> None:
            drv.find_element(By.ID, "access-key").clear()
            drv.find_element(By.ID, "access-key").send_keys(ak)
            drv.find_element(By.ID, "secret-key").send_keys(sk)
            drv.find_element(By.ID, "signin-button").click()

        sign_in("ops-admin", "wrong-secret")
        refused = wait_text(drv, "#auth-state", lambda t: "401" in t)
        assert "UNAUTHENTICATED" in refused and "signature does not match" in refused, refused
        assert drv.find_element(By.CSS_SELECTOR, "#topics tbody").text == ""

        sign_in("ops-admin", "admin-secret-1")
        topics = wait_text(drv, "#topics tbody", lambda t: ACL_TOPIC in t)
        assert f"{ACL_TOPIC} 0 0 0" in topics and f"{ACL_TOPIC} 1 0 0" in topics
        wait_text(drv, "#auth-state", lambda t: t == "signed in as ops-admin")
        wait_text(drv, "#leader", lambda t: t not in ("", "unknown", "none"))
        # a query string through the browser's URL encoding: the node rebuilds the same target
        send = {"messages": [{"body": "signed-body", "keys": ["k+1/é&x=y"], "queue_id": 1}]}
        status, doc, _, _ = request(port, "POST", f"/topics/{ACL_TOPIC}/messages", send,
                                    headers=_signed(port, "POST", f"/topics/{ACL_TOPIC}/messages", send))
        assert status == 200, doc
        drv.find_element(By.ID, "key-topic").send_keys(ACL_TOPIC)
        drv.find_element(By.ID, "key-key").send_keys("k+1/é&x=y")
        drv.find_element(By.CSS_SELECTOR, "#by-key button").click()
        wait_text(drv, "#lookup-result", lambda t: '"body": "signed-body"' in t)
        stored = drv.execute_script("return [sessionStorage.getItem('mqstore.accessKey'), localStorage.length,"
                                    " document.cookie]")
        assert stored == ["ops-admin", 0, ""]          # sessionStorage only

        # an account without permission on the topic sees that, not an error page
        drv.find_element(By.ID, "signout").click()
        sign_in("reader01", "read-secret")
        denied = wait_text(drv, "#topics tbody", lambda t: "NO_PERMISSION" in t)
        assert "403" in denied and ACL_TOPIC in denied
        os.makedirs(os.path.join(ROOT, "reports"), exist_ok=True)
        assert drv.save_screenshot(os.path.join(ROOT, "reports", "dashboard-acl.png"))
    finally:
        if drv is not None:
            drv.quit()
        assert node.terminate() == 0


def _signed(port: int, method: str, path: str, doc) -> dict:
    from node.acl import sign_headers
    body = json.dumps(doc).encode() if doc is not None else b""
    return {"Content-Type": "application/json",
            **sign_headers("ops-admin", "admin-secret-1", method, path, None, body, int(time.time() * 1000))}
