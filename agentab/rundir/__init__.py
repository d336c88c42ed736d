"""agentab.rundir: the run dir's format, written by replay and read by analysis.

A run dir is `manifest.json`, `records/*.arrow` (one row per request) and `metrics/*.arrow`
(scraped server metrics), each table in atomic part files (docs/interfaces.md, "run dir"). The
format sits below replay and analysis so that analysis reads a run without importing the code
that sent the traffic, and replay writes it without knowing how it will be analysed.
"""

from agentab.rundir.manifest import is_run_dir, read_manifest, write_manifest
from agentab.rundir.parts import part_files
from agentab.rundir.read import scan_metrics, scan_records
from agentab.rundir.schema import (
    MANIFEST,
    METRICS_DIR,
    METRICS_SCHEMA,
    RECORD_SCHEMA,
    RECORDS_DIR,
)
from agentab.rundir.writer import PartWriter

__all__ = [
    "MANIFEST",
    "METRICS_DIR",
    "METRICS_SCHEMA",
    "RECORDS_DIR",
    "RECORD_SCHEMA",
    "PartWriter",
    "is_run_dir",
    "part_files",
    "read_manifest",
    "scan_metrics",
    "scan_records",
    "write_manifest",
]
