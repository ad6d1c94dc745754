"""The Report as one strict-JSON document (no NaN, no inf)."""

from __future__ import annotations

import json

from rlscope.reader import run_provenance
from rlscope.report import Report


def render_json(report: Report) -> str:
    doc = report.to_dict()
    if isinstance(doc.get("run"), dict):  # how the importer derived fields (run.json)
        doc["run"]["provenance"] = run_provenance(report.run.meta)
    # ASCII-only: C1 controls and bidi overrides in data cannot reach a terminal raw.
    return json.dumps(doc, indent=2, ensure_ascii=True, allow_nan=False)
