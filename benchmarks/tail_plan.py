"""The tail benchmark's yardsticks: a clairvoyant plan, and a lower bound no schedule can beat.

Both know every sequence's length, which the manager never does. The simulator is the fleet's own timing
model (``tail_fleet.BoxSpec``) run in jumps between events: a box admits its sequences in the plan's
order as slots free (at most ``max_running`` at once), a step with admissions also pays their prefill
(a prompt once per box), and each decode step gives every running sequence one token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tail_fleet import BoxSpec


@dataclass(frozen=True)
class Job:
    """One sequence: its index in the step, its prompt (``group``, ``prompt_len``) and its length."""

    index: int
    group: int
    prompt_len: int
    length: int


def box_time(spec: BoxSpec, jobs: Sequence[Job]) -> float:
    """Seconds until ``spec``'s box has run ``jobs`` (admitted in this order as slots free)."""
    t = 0.0
    queue = list(reversed(jobs))
    running: list[int] = []  # tokens left
    seen: set[int] = set()
    while queue or running:
        prefill = 0
        while queue and len(running) < spec.max_running:
            job = queue.pop()
            if job.group not in seen:
                seen.add(job.group)
                prefill += job.prompt_len
            running.append(job.length)
        t += spec.prefill_s(prefill)
        k = min(running)
        t += k * spec.step_s(len(running))
        running = [r - k for r in running if r > k]
    return t


def estimate(spec: BoxSpec, longest: int, tokens: int) -> float:
    """A box's time for ``tokens`` in all, ``longest`` the longest: steps are at least the longest and the
    tokens over a full batch; each step pays the base, each token its per-sequence share."""
    steps = max(longest, tokens / spec.max_running)
    return (spec.base_ms * steps + spec.per_seq_ms * tokens) / spec.speed / 1000.0


@dataclass
class Plan:
    """Each box's jobs, in the order to send them, and the simulated makespan."""

    boxes: list[list[Job]]
    makespan: float


def longest_first(specs: Sequence[BoxSpec], jobs: Sequence[Job], weight: float = 1.0) -> list[list[Job]]:
    """Longest first, each to the box whose :func:`estimate` ends soonest with it (``weight`` scales the
    longest sequence's term, so that the search tries plans that isolate the tail more or less)."""
    order = sorted(jobs, key=lambda j: -j.length)
    boxes: list[list[Job]] = [[] for _ in specs]
    longest = [0] * len(specs)
    tokens = [0] * len(specs)
    for job in order:
        n = job.length
        ends = [estimate(s, round(weight * max(longest[b], n)), tokens[b] + n) for b, s in enumerate(specs)]
        best = ends.index(min(ends))
        boxes[best].append(job)
        longest[best] = max(longest[best], job.length)
        tokens[best] += job.length
    return boxes


def clairvoyant(specs: Sequence[BoxSpec], jobs: Sequence[Job], moves: int = 200) -> Plan:
    """The best longest-first plan found: :func:`longest_first` at a few weights, then moves of single
    jobs off the box that ends last while a move shortens the makespan (each box simulated whole)."""
    best: Plan | None = None
    for weight in (0.8, 1.0, 1.2, 1.5, 2.0):
        boxes = longest_first(specs, jobs, weight)
        times = [box_time(s, b) for s, b in zip(specs, boxes)]
        for _ in range(moves):
            worst = max(range(len(specs)), key=lambda b: times[b])
            improved = False
            for job in sorted(boxes[worst], key=lambda j: j.length):
                rest = [j for j in boxes[worst] if j is not job]
                t_rest = box_time(specs[worst], rest)
                for b in sorted(range(len(specs)), key=lambda b: times[b]):
                    if b == worst:
                        continue
                    cand = sorted([*boxes[b], job], key=lambda j: -j.length)
                    t_b = box_time(specs[b], cand)
                    if max(t_rest, t_b) < times[worst] - 1e-9:
                        boxes[worst], boxes[b] = rest, cand
                        times[worst], times[b] = t_rest, t_b
                        improved = True
                        break
                if improved:
                    break
            if not improved:
                break
        plan = Plan(boxes, max(times))
        if best is None or plan.makespan < best.makespan:
            best = plan
    assert best is not None
    return best


def lower_bound(specs: Sequence[BoxSpec], jobs: Sequence[Job]) -> float:
    """The larger of: the longest sequence alone on the fastest box (its prefill and every step at a batch
    of one), and all the tokens at every box's full-batch throughput at once."""
    longest = max(jobs, key=lambda j: j.length)
    alone = min(s.prefill_s(longest.prompt_len) + longest.length * s.step_s(1) for s in specs)
    rate = sum(s.max_running / s.step_s(s.max_running) for s in specs)
    return max(alone, sum(j.length for j in jobs) / rate)
