"""prefill-accel adapter: the engine's startup log names the applied patch series (the build stamp that
`prefill-accel apply` writes beside this file); the banner itself is prefill_accel.engine.banner's."""

from pathlib import Path

from prefill_accel.engine.banner import STAMP_NAME, series_banner


def log_series(logger) -> None:
    logger.info("%s", series_banner(Path(__file__).with_name(STAMP_NAME)))
