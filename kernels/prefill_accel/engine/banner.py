"""The startup banner of a patched engine: the prefill-accel series it carries, from its build stamp.

`prefill-accel apply` writes the stamp (STAMP_NAME) beside the adapter module that logs the banner.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

STAMP_NAME = "prefill_accel_series.json"


def series_banner(stamp: Path) -> str:
    """One line: runtime version, series hash, target and patch count ('unknown' where the stamp is unreadable)."""
    try:
        record = json.loads(Path(stamp).read_text())
    except (OSError, ValueError):
        record = {}
    try:
        version = metadata.version("prefill-accel")
    except metadata.PackageNotFoundError:
        version = "(runtime package not installed)"
    return (
        f"prefill-accel {version} patch series {record.get('series_hash', 'unknown')} applied "
        f"({record.get('target', 'unknown target')}, {len(record.get('patches', []))} patch(es))"
    )
