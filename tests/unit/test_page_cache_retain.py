"""pageCacheRetainBytes: a file set's flush drops the page cache of its flushed bytes beyond
the retained tail, and only those.

Method: real files in a temp dir, opened through a FileSystem whose handles record every
drop_cache call (and pass it on to the real descriptor); the byte spans are scaled down by
setting cold_reads' process-wide spans for the test.
"""

from __future__ import annotations

import pytest

from node.store import cold_reads
from node.store.fileio import FileSystem
from node.store.segment import SegmentedFile

SEG = 100


class _Recording(FileSystem):
    def __init__(self):
        self.drops: list[tuple[int, int]] = []      # (absolute offset, size)
        self.fail = False

    def open(self, path):
        handle, fs = super().open(path), self
        base = int(path.rsplit("/", 1)[1])

        class Handle:
            def __getattr__(self, name):
                return getattr(handle, name)

            def drop_cache(self, offset, size):
                if fs.fail:
                    raise OSError(22, "injected EINVAL")
                fs.drops.append((base + offset, size))
                handle.drop_cache(offset, size)
        return Handle()


@pytest.fixture
def spans(monkeypatch):
    monkeypatch.setattr(cold_reads, "HOT_BYTES", 50)
    monkeypatch.setattr(cold_reads, "RETAIN_BYTES", 150)
    monkeypatch.setattr(cold_reads, "DROP_STEP_BYTES", 100)


def _write(sf: SegmentedFile, n: int, fill: bytes = b"x") -> None:
    for _ in range(n // 10):
        sf.ensure_writable().append(fill * 10)


def test_a_flush_drops_the_flushed_pages_beyond_the_retained_tail_a_step_at_a_time(tmp_path, spans):
    fs = _Recording()
    sf = SegmentedFile(fs, str(tmp_path), SEG)
    _write(sf, 500)
    assert fs.drops == []                                  # nothing is dropped before it is flushed
    sf.flush()
    assert fs.drops == [(0, 100), (100, 100), (200, 100), (300, 50)]    # up to 500 - 150
    _write(sf, 30)
    sf.flush()
    assert len(fs.drops) == 4                              # 30 more past the tail: less than a step (150 / 4)
    _write(sf, 120)
    sf.flush()
    assert fs.drops[4:] == [(350, 50), (400, 100)]         # up to 650 - 150
    assert sf.read(0, 100) == b"x" * 100                   # dropped bytes read back from the disk


def test_the_retained_tail_is_never_shorter_than_what_reads_take_as_cached(tmp_path, spans, monkeypatch):
    monkeypatch.setattr(cold_reads, "HOT_BYTES", 300)
    fs = _Recording()
    sf = SegmentedFile(fs, str(tmp_path), SEG)
    _write(sf, 500)
    sf.flush()
    assert fs.drops == [(0, 100), (100, 100)]              # up to 500 - 300, not 500 - 150


def test_nothing_is_dropped_with_the_default_of_zero(tmp_path, monkeypatch):
    monkeypatch.setattr(cold_reads, "RETAIN_BYTES", 0)
    fs = _Recording()
    sf = SegmentedFile(fs, str(tmp_path), SEG)
    _write(sf, 500)
    sf.flush()
    assert fs.drops == []


def test_a_truncation_below_the_dropped_bytes_drops_the_rewritten_ones_again(tmp_path, spans):
    fs = _Recording()
    sf = SegmentedFile(fs, str(tmp_path), SEG)
    _write(sf, 500)
    sf.flush()
    sf.truncate(200)
    fs.drops.clear()
    _write(sf, 300, b"y")
    sf.flush()
    assert fs.drops == [(200, 100), (300, 50)]             # from the cut up to 500 - 150
    assert sf.read(200, 10) == b"y" * 10


def test_a_failing_drop_is_logged_once_and_the_flush_still_succeeds(tmp_path, spans, caplog):
    fs = _Recording()
    fs.fail = True
    sf = SegmentedFile(fs, str(tmp_path), SEG)
    _write(sf, 500)
    assert sf.flush() == 500
    _write(sf, 200)
    assert sf.flush() == 700
    assert [r.levelname for r in caplog.records if "page cache" in r.getMessage()] == ["WARNING"]


def test_bytes_rewritten_in_place_behind_the_tail_are_dropped_again_after_their_flush(tmp_path, spans):
    fs = _Recording()
    sf = SegmentedFile(fs, str(tmp_path), SEG)
    _write(sf, 500)
    sf.flush()
    fs.drops.clear()
    sf.segment_for(100).handle.pwrite(b"r" * 10, 20)      # a repair in place at 120
    sf.mark_unflushed(120)
    sf.flush()
    assert fs.drops == [(120, 80), (200, 100), (300, 50)]
    assert sf.read(120, 10) == b"r" * 10
