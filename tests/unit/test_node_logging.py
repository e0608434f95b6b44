"""Structured node logs: DLedger nodes stamp each JSON line with the Raft term.

Method: the node's JsonFormatter on a string stream, with the TermFilter of a stand-in
log whose term changes between two lines.
"""

from __future__ import annotations

import io
import json
import logging
from types import SimpleNamespace

from node.server import JsonFormatter, TermFilter, add_term_to_logs


def test_json_lines_carry_the_current_term():
    rlog = SimpleNamespace(mode="dledger", term=4)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("n1", "broker-a"))
    handler.addFilter(TermFilter(rlog))
    logger = logging.getLogger("test.node.logging")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.info("first")
        rlog.term = 5
        logger.info("second", extra={"term": 99})    # an explicit term is not overwritten
        rlog.term = 6
        logger.info("third")
    finally:
        logger.removeHandler(handler)
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert [(d["msg"], d["term"], d["node"]) for d in lines] == [("first", 4, "n1"), ("second", 99, "n1"),
                                                                ("third", 6, "n1")]


def test_only_dledger_nodes_get_the_filter():
    root = logging.getLogger()
    handler = logging.StreamHandler(io.StringIO())
    root.addHandler(handler)
    try:
        add_term_to_logs(SimpleNamespace(log=SimpleNamespace(mode="standalone")))
        assert not handler.filters
        add_term_to_logs(SimpleNamespace(log=SimpleNamespace(mode="dledger", term=1)))
        assert any(isinstance(f, TermFilter) for f in handler.filters)
    finally:
        root.removeHandler(handler)
