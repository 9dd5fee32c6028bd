"""prefill-accel glue: report the applied prefill-accel patch series when the engine starts.

Placed by the prefill-accel overlay. `prefill-accel apply` writes the build stamp
(prefill_accel_series.json) beside this file; the engine's startup log calls log_series().
"""

import json
from importlib import metadata
from pathlib import Path

STAMP = Path(__file__).with_name("prefill_accel_series.json")


def series_banner() -> str:
    """One line: runtime version, series hash, target and patch count."""
    try:
        stamp = json.loads(STAMP.read_text())
    except (OSError, ValueError):
        stamp = {}
    try:
        version = metadata.version("prefill-accel")
    except metadata.PackageNotFoundError:
        version = "(runtime package not installed)"
    return (
        f"prefill-accel {version} patch series {stamp.get('series_hash', 'unknown')} applied "
        f"({stamp.get('target', 'unknown target')}, {len(stamp.get('patches', []))} patch(es))"
    )


def log_series(logger) -> None:
    logger.info("%s", series_banner())
