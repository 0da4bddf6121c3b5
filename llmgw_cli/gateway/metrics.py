"""Prometheus text exposition of the gateway's counters (no client library: a few dicts).

Contract: counters are plain ints bumped on the event loop; ``render`` reads them on the
same loop, so no lock is needed.
"""

from __future__ import annotations

from collections import Counter

from llmgw_cli.core.routing import Pool


def _labels(**labels: str) -> str:
    inner = ",".join(
        f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for k, v in labels.items()
    )
    return "{" + inner + "}"


class Metrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()  # (model, status)
        self.prompt_tokens: Counter[str] = Counter()
        self.completion_tokens: Counter[str] = Counter()
        self.retries: Counter[str] = Counter()
        self.latency_sum: dict[str, float] = {}

    def observe(self, model: str, status: int, prompt: int, completion: int, seconds: float) -> None:
        self.requests[(model, status)] += 1
        self.prompt_tokens[model] += prompt
        self.completion_tokens[model] += completion
        self.latency_sum[model] = self.latency_sum.get(model, 0.0) + seconds

    def render(self, pool: Pool, queued: dict[str, int]) -> str:
        lines = [
            "# HELP llmgw_requests_total Requests answered, by model and HTTP status.",
            "# TYPE llmgw_requests_total counter",
        ]
        lines += [
            f"llmgw_requests_total{_labels(model=m, status=str(s))} {n}"
            for (m, s), n in sorted(self.requests.items())
        ]
        for name, counter, help_text in (
            ("llmgw_prompt_tokens_total", self.prompt_tokens, "Prompt tokens reported by the engines."),
            (
                "llmgw_completion_tokens_total",
                self.completion_tokens,
                "Completion tokens reported by the engines.",
            ),
            (
                "llmgw_upstream_retries_total",
                self.retries,
                "Requests retried on another replica after a connection failure.",
            ),
            ("llmgw_request_seconds_sum", self.latency_sum, "Total time spent answering requests."),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
            lines += [f"{name}{_labels(model=m)} {v}" for m, v in sorted(counter.items())]
        lines += [
            "# HELP llmgw_replica_up 1 when the replica is in rotation.",
            "# TYPE llmgw_replica_up gauge",
        ]
        lines += [
            f"llmgw_replica_up{_labels(model=r.model, address=r.address, health=r.health.value)} {int(r.health.value == 'ready')}"
            for r in pool.all()
        ]
        lines += [
            "# HELP llmgw_replica_outstanding Requests in flight to the replica.",
            "# TYPE llmgw_replica_outstanding gauge",
        ]
        lines += [
            f"llmgw_replica_outstanding{_labels(model=r.model, address=r.address)} {r.outstanding}"
            for r in pool.all()
        ]
        lines += [
            "# HELP llmgw_queued Requests waiting for a slot of the model.",
            "# TYPE llmgw_queued gauge",
        ]
        lines += [f"llmgw_queued{_labels(model=m)} {n}" for m, n in sorted(queued.items())]
        return "\n".join(lines) + "\n"
