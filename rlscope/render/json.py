"""The Report as one strict-JSON document (no NaN, no inf)."""

from __future__ import annotations

import json

from rlscope.report import Report


def render_json(report: Report) -> str:
    doc = report.to_dict()
    # ASCII-only: C1 controls and bidi overrides in data cannot reach a terminal raw.
    return json.dumps(doc, indent=2, ensure_ascii=True, allow_nan=False)
