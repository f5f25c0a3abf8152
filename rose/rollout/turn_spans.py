"""A worker's spans: one `process {stream}` (kind CONSUMER) per task it takes that carries trace
context (`Task.traceparent`: a gateway request's), from the take to where the task leaves the
worker (completed, handed on as a continuation, lost, dead-lettered). The span is a child of and
linked to the task's context, so a turn continued after a revoke has one span per worker in its
request's trace; and it links to the lease decision that granted the worker's GPU
(`WorkerConfig.lease_traceparent`: the grant command's context), whose trace and span ids it
also carries as attributes. A task without trace context costs no span. docs/rollout.md.
"""

from __future__ import annotations

from opentelemetry.trace import Link, Span, Status, StatusCode

from rose.obs.tracing import queue_process_span, span_context_of, tracer
from rose.rollout.launcher import WorkerConfig


def versions_made(ep) -> list[int]:
    """The policy version of every token the episode's worker sampled itself (its last
    `decoded` action tokens)."""
    vs = [v for t in ep.turns for v in (t.versions or [t.version] * len(t.action))] + list(ep.action_versions)
    return vs[len(vs) - ep.decoded :] if ep.decoded else []


class TurnSpans:
    def __init__(self, config: WorkerConfig, engine: str, group: str):
        self._tr = tracer("rose.rollout.worker")
        self._group = group
        self._open: dict[str, Span] = {}
        lease = span_context_of(config.lease_traceparent)
        self._base: dict = {
            "rose.worker_id": config.worker_id,
            "rose.gpu": config.gpu,
            "rose.dedicated": config.dedicated,
            "rose.engine": engine,
            "rose.device": config.device,
        }
        if config.lease_id:
            self._base["rose.lease_id"] = config.lease_id
        self._links: list[Link] = []
        if lease.is_valid:
            self._base["rose.lease.trace_id"] = format(lease.trace_id, "032x")
            self._base["rose.lease.span_id"] = format(lease.span_id, "016x")
            self._links = [Link(lease, {"rose.link": "lease.grant", "rose.lease_id": config.lease_id})]

    def start(self, key: str, c, ep) -> None:
        """Open the span of claimed task `c` (its episode `ep`), under the worker's key for it."""
        t = c.task
        attrs = {
            **self._base,
            "messaging.message.id": c.entry_id,
            "rose.task_id": t.task_id,
            "rose.moves": t.moves,
            "rose.turn": len(ep.turns),
            "rose.tokens_resumed": ep.resumed_tokens,
            "rose.stream": t.stream,
        }
        span = queue_process_span(self._tr, c.stream, self._group, t.traceparent, self._links, attrs)
        if span is not None:
            self._open[key] = span

    def end(self, key: str, ep, outcome: str, error: str = "") -> None:
        """Close the span: the tokens the worker sampled, their policy versions, and the outcome."""
        span = self._open.pop(key, None)
        if span is None:
            return
        made = versions_made(ep) if ep is not None else []
        span.set_attributes(
            {
                "rose.outcome": outcome,
                "gen_ai.usage.output_tokens": len(made),
                "rose.policy_versions": sorted(set(made)),
            }
        )
        if made:
            span.set_attributes({"rose.policy_version.first": made[0], "rose.policy_version.last": made[-1]})
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()
