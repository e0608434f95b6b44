"""Commitlog retention: RocketMQ's CleanCommitLogService as a pure decision plus a thin apply.

`decide` is pure: given the time, the segments (base, end, mtime) and the disk usage
ratio it says which head segments to delete and whether writes must be refused.
RocketMQ's rules:
- a segment expires `fileReservedTime` hours after its file was last modified;
- expired segments are deleted when the hour is one of `deleteWhen` ("04", or "04;16"),
  or at any hour once the disk is above `diskMaxUsedSpaceRatio` (75 %);
- above the clean-forcibly ratio (85 %) segments are deleted even if not expired;
- above `diskSpaceWarningLevelRatio` (90 %) writes are refused (DiskFull);
- deletion goes from the head, stops at the first segment that may not go (no holes),
  takes at most `delete_files_batch_max` per run, and never the segment being written;
- an admin's `deleteExpiredCommitLog` (executeDeleteFilesManually) makes the next
  MAX_MANUAL_DELETE_PASSES runs delete expired segments at any hour (`manual`).
`apply` feeds a CommitLog's real segments and mtimes into `decide` and deletes.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Callable, Sequence

from node.store.errors import InvalidMessage

if TYPE_CHECKING:
    from node.store.commitlog import CommitLog

log = logging.getLogger(__name__)

MAX_MANUAL_DELETE_PASSES = 20     # RocketMQ's MAX_MANUAL_DELETE_FILE_TIMES


class RetentionConfigError(InvalidMessage):
    code = "CONFIG_ERROR"


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    file_reserved_time_hours: int = 72          # fileReservedTime: age after last modification
    delete_when: str = "04"                     # deleteWhen: local hours of day, ";"-separated
    disk_max_used_space_ratio: int = 75         # %: above it expired files go at any hour
    disk_space_clean_forcibly_ratio: int = 85   # %: above it files go even if not expired
    disk_space_warning_level_ratio: int = 90    # %: at or above it writes are refused
    delete_files_batch_max: int = 10            # DELETE_FILES_BATCH_MAX: files per run

    def validate(self) -> None:
        if self.file_reserved_time_hours <= 0:
            raise RetentionConfigError("fileReservedTime must be > 0 hours")
        self.delete_hours()
        ratios = (self.disk_max_used_space_ratio, self.disk_space_clean_forcibly_ratio,
                  self.disk_space_warning_level_ratio)
        if not all(10 <= r <= 95 for r in ratios):
            raise RetentionConfigError(f"disk ratios must be within 10..95 %, got {ratios}")
        if not ratios[0] <= ratios[1] <= ratios[2]:
            raise RetentionConfigError("need diskMaxUsedSpaceRatio <= clean-forcibly ratio <= "
                                       "diskSpaceWarningLevelRatio")
        if self.delete_files_batch_max <= 0:
            raise RetentionConfigError("delete_files_batch_max must be > 0")

    def delete_hours(self) -> frozenset[int]:
        hours: set[int] = set()
        for part in self.delete_when.split(";"):
            part = part.strip()
            if not part.isdigit() or not 0 <= int(part) <= 23:
                raise RetentionConfigError(f"deleteWhen {self.delete_when!r}: {part!r} is not an hour 00..23")
            hours.add(int(part))
        return frozenset(hours)


@dataclass(frozen=True, slots=True)
class SegmentAge:
    base: int           # first offset of the file
    end: int            # one past its last data byte
    mtime_s: float      # last modification, seconds since the epoch


@dataclass(frozen=True, slots=True)
class RetentionDecision:
    delete_bases: tuple[int, ...]   # head segments to delete, in order
    delete_upto: int                # delete_head(delete_upto) removes exactly those
    refuse_writes: bool             # disk at or above the warning level
    reason: str                     # "time", "disk", "forced", "manual", or "none"


def decide(policy: RetentionPolicy, now: datetime, segments: Sequence[SegmentAge], disk_ratio: float,
           safe_upto: int | None = None, manual: bool = False) -> RetentionDecision:
    """Which head segments go now, and whether writes are refused. Pure.

    `disk_ratio` is used/total in 0..1. `safe_upto`: segments ending past it are kept
    (the caller passes its flushed and committed end). The last segment is never deleted.
    `manual`: an admin asked (deleteExpiredCommitLog): expired segments go whatever the hour.
    """
    percent = disk_ratio * 100.0
    refuse = percent >= policy.disk_space_warning_level_ratio
    forced = percent >= policy.disk_space_clean_forcibly_ratio
    space = percent >= policy.disk_max_used_space_ratio
    time_up = now.hour in policy.delete_hours()
    if not (time_up or space or forced or manual):
        return RetentionDecision((), _upto(segments, ()), refuse, "none")
    expire_before = now.timestamp() - policy.file_reserved_time_hours * 3600
    chosen: list[int] = []
    for seg in segments[:-1]:                     # never the segment being written
        if len(chosen) >= policy.delete_files_batch_max:
            break
        if safe_upto is not None and seg.end > safe_upto:
            break
        if not (forced or seg.mtime_s <= expire_before):
            break                                 # no holes: stop at the first one that stays
        chosen.append(seg.base)
    reason = "none" if not chosen else ("forced" if forced else "disk" if space and not time_up else
                                        "time" if time_up else "manual")
    return RetentionDecision(tuple(chosen), _upto(segments, chosen), refuse, reason)


def _upto(segments: Sequence[SegmentAge], chosen: Sequence[int]) -> int:
    """The offset delete_head needs to remove exactly `chosen` (the end of the last chosen file)."""
    if not chosen:
        return segments[0].base if segments else 0
    i = len(chosen)
    return segments[i].base if i < len(segments) else segments[i - 1].end


def segment_ages(segments: Sequence[tuple[int, str]], segment_size: int, end: int,
                 mtime_of: Callable[[str], float]) -> list[SegmentAge]:
    """A SegmentAge per (base, path) of a log's files in order: each full but the last, which
    ends at `end`, aged by `mtime_of(path)`."""
    last = len(segments) - 1
    return [SegmentAge(base, base + segment_size if i < last else end, mtime_of(path))
            for i, (base, path) in enumerate(segments)]


def file_mtime_s(path: str) -> float:
    """mtime straight from the OS, for callers without a FileSystem."""
    return os.stat(path).st_mtime


def apply(commitlog: "CommitLog", policy: RetentionPolicy, now: datetime, disk_ratio: float,
          safe_upto: int | None = None, mtime_of: Callable[[str], float] | None = None,
          manual: bool = False) -> RetentionDecision:
    """Decide for `commitlog`'s segments and delete the chosen head files. File ages come
    from the commitlog's FileSystem (`fs.mtime`) unless `mtime_of` is given."""
    if mtime_of is None:
        mtime_of = commitlog.fs.mtime
    infos = commitlog.segment_infos()
    ages = segment_ages([(s.base, s.path) for s in infos], commitlog.segment_size, infos[-1].end if infos else 0,
                        mtime_of)
    decision = decide(policy, now, ages, disk_ratio, safe_upto, manual)
    if decision.delete_bases:
        removed = commitlog.delete_head(decision.delete_upto)
        assert len(removed) == len(decision.delete_bases), "delete_head must remove exactly the chosen files"
        log.info("retention deleted %d commitlog files", len(removed),
                 extra={"reason": decision.reason, "files": removed, "min_offset": commitlog.min_offset,
                        "disk_ratio": round(disk_ratio, 3)})
    return decision
