"""The seconds each xdist group took in a run, so `make test` can start the longest first.

`pytest -n 3 --dist loadgroup` hands whole groups to the workers in the order their tests were
collected; a long group collected late (the multi-host or mesh tests, say) then runs alone at
the end while the other workers sit idle. `tests/conftest.py` sorts the collected tests by
their group's seconds in `tests/group_seconds.json`, longest first (a group it doesn't list
counts 0 and runs among the short ones at the end), keeping the order within each group.

Regenerate after a run with `--junitxml=run.xml`: `python -m tests.group_weights run.xml`.
"""

from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SECONDS_FILE = Path(__file__).with_name("group_seconds.json")


def load() -> dict[str, float]:
    """Group name (xdist's `@group` suffix) -> seconds; empty when the file is missing."""
    try:
        return json.loads(SECONDS_FILE.read_text())
    except (OSError, ValueError):
        return {}


def from_junit(path: str | Path) -> dict[str, int]:
    """Seconds per group (setup, call and teardown of its tests) of a junit XML report written
    by an xdist run, whose test names end in `@group`; groups under a second are left out."""
    seconds: collections.Counter[str] = collections.Counter()
    for case in ET.parse(path).iter("testcase"):
        name = case.get("name", "")
        group = name.rsplit("@", 1)[1] if "@" in name else case.get("classname", "")
        seconds[group] += float(case.get("time", 0.0))
    return {g: round(s) for g, s in seconds.most_common() if s >= 1}


if __name__ == "__main__":
    SECONDS_FILE.write_text(json.dumps(from_junit(sys.argv[1]), indent=0) + "\n")
