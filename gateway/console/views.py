"""What the console's templates draw, computed from the API's answers: a lifecycle job's stages
as a progress line (docs/console.md) and an allocation's timeline on a time axis."""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from contracts.lifecycle import Action, JobStatus, expected_job_status
from gateway.lifecycle_jobs import JobEventView
from gateway.schemas import Timeline, TimelineTaskItem


@dataclass
class StageLine:
    """One stage of a job: whether it ran, how often, how long, and its events (oldest first)."""

    name: str
    state: str  # pending | running | succeeded | failed | skipped | compensated
    attempts: int = 0
    started_at: dt.datetime | None = None
    ended_at: dt.datetime | None = None
    events: list[JobEventView] = field(default_factory=list)

    @property
    def duration_seconds(self) -> float | None:
        if self.started_at is None or self.ended_at is None:
            return None
        return (self.ended_at - self.started_at).total_seconds()


def stage_line(
    order: Sequence[str], events: Iterable[JobEventView], current_stage: str
) -> list[StageLine]:
    """The job's stages in execution order, each with its attempts, duration and events; a
    stage outside the main line (a deploy-recovery stage) is placed where it was entered."""
    lines: dict[str, StageLine] = {name: StageLine(name, "pending") for name in order}
    for event in sorted(events, key=lambda e: e.occurred_at):
        line = lines.setdefault(event.stage, StageLine(event.stage, "pending"))
        line.events.append(event)
        line.attempts = max(line.attempts, event.attempt)
        if event.status == "started":
            line.started_at = line.started_at or event.occurred_at
            line.state = "running"
        else:
            line.ended_at = event.occurred_at
            line.state = event.status
    if current_stage in lines and lines[current_stage].state == "pending":
        lines[current_stage].state = "running"
    return list(lines.values())


@dataclass(frozen=True)
class ActionButton:
    """An operator action the job's state allows, as the console offers it."""

    path: str  # how the admin API spells it in the URL (retry, mark-manual-intervention, ...)
    action: str  # the workflow's name for it
    expected_status: str  # where the job goes when it succeeds


def allowed_actions(
    paths: Mapping[str, Action],
    allowed: Mapping[Action, Collection[JobStatus]],
    status: str,
) -> list[ActionButton]:
    """The job kind's actions its workflow would admit from `status` (the update's validator
    uses the same table)."""
    try:
        job_status = JobStatus(status)
    except ValueError:
        return []
    return [
        ActionButton(path, action.value, expected_job_status(action).value)
        for path, action in paths.items()
        if job_status in allowed.get(action, frozenset())
    ]


@dataclass(frozen=True)
class Bar:
    """One item of a timeline on the time axis: offsets in percent of the axis."""

    label: str
    kind: str  # allocation_state | node_task | phase
    status: str
    left: float
    width: float
    at: dt.datetime
    detail: str = ""


@dataclass(frozen=True)
class TimeAxis:
    start: dt.datetime
    end: dt.datetime
    bars: list[Bar]

    @property
    def span_seconds(self) -> float:
        return (self.end - self.start).total_seconds()


def time_axis(timeline: Timeline, now: dt.datetime) -> TimeAxis | None:
    """Lifecycle items as marks and host tasks as bars, with their phases as marks under them;
    a running task runs to `now`."""
    if not timeline.items:
        return None
    points: list[dt.datetime] = []
    for item in timeline.items:
        points.append(item.started_at)
        if isinstance(item, TimelineTaskItem):
            points.append(item.completed_at or now)
            points += [p.at for p in item.phases if p.at is not None]
    start, end = min(points), max(points)
    span = max((end - start).total_seconds(), 1.0)

    def offset(at: dt.datetime) -> float:
        return round(100 * (at - start).total_seconds() / span, 2)

    bars: list[Bar] = []
    for item in timeline.items:
        left = offset(item.started_at)
        if isinstance(item, TimelineTaskItem):
            width = max(offset(item.completed_at or now) - left, 0.5)
            bars.append(
                Bar(
                    item.name,
                    "node_task",
                    item.status,
                    left,
                    width,
                    item.started_at,
                    item.summary or "",
                )
            )
            bars += [
                Bar(p.phase, "phase", p.status, offset(p.at), 0.0, p.at, p.message or "")
                for p in item.phases
                if p.at is not None
            ]
        else:
            detail = " ".join(x for x in (item.state, item.actor, item.reason) if x)
            bars.append(
                Bar(item.name, "allocation_state", item.status, left, 0.0, item.started_at, detail)
            )
    return TimeAxis(start, end, bars)
