"""Write a run's JSON, Markdown report and plots into a folder."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from speculative.bench.plots import write_plots
from speculative.bench.report import ResultRow, markdown_report, payload
from speculative.bench.runner import BenchRun


def write_outputs(run: BenchRun, rows: Sequence[ResultRow], folder: Path) -> list[Path]:
    """bench.json, report.md and the PNG plots; returns the written paths."""
    folder.mkdir(parents=True, exist_ok=True)
    json_path = folder / "bench.json"
    json_path.write_text(json.dumps(payload(run, rows), indent=2) + "\n")
    plots = write_plots(rows, folder)
    report_path = folder / "report.md"
    report_path.write_text(markdown_report(run, rows, plots))
    return [json_path, report_path, *(folder / p for p in plots)]
