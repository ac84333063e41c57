"""A finished run as plain data: what the page's "download this run" button saves."""

from __future__ import annotations

import dataclasses

from skipkey.core.trace import Trace
from skipkey.quality.metrics import agreement, jsonable, rouge_l, trace_record
from skipkey.serving.comparison import side_metrics
from skipkey.serving.request import ComparisonRequest


def side_record(trace: Trace, reference: Trace | None = None, traces: bool = True) -> dict:
    """One column of a run as plain data: its text, its numbers (``side_metrics``) and (``traces``) its trace."""
    numbers = dataclasses.asdict(side_metrics(trace, reference))
    record = dict(label=trace.label, text=trace.text(), tokens=trace.tokens(), metrics=jsonable(numbers))
    return dict(record, trace=trace_record(trace)) if traces else record


def run_record(full: Trace, accelerated: Trace, request: ComparisonRequest, traces: bool = True) -> dict:
    """The whole run as JSON-ready data: what was asked, both texts, their metrics, their agreement and
    (``traces``) each step's event.

    What the page's "download this run" button saves (the API's ``/metrics`` leaves the traces out);
    ``json.dumps(..., allow_nan=False)`` takes it as is.
    """
    match = agreement(full.tokens(), accelerated.tokens())
    return dict(model=request.model, prompt=request.prompt, settings=request.describe(),
                generation=jsonable(dataclasses.asdict(request.settings)), stopped=accelerated.stopped,
                full=side_record(full, traces=traces), skipkey=side_record(accelerated, full, traces),
                agreement=dict(jsonable(match.as_dict()), rouge_l=rouge_l(full.text(), accelerated.text())))
