"""Lower bounds on the makespan of a batch on the simulated pool of ``bench_scheduling.py``: what no
schedule can beat, even one that knows every length."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np


def fluid_bound(total_tokens: float, peak_all: float, peak_after: float, t_p: float | None) -> float:
    """Time to make all tokens at peak pool throughput, losing one instance's share at t_p."""
    if t_p is None or total_tokens <= peak_all * t_p:
        return total_tokens / peak_all
    return t_p + (total_tokens - peak_all * t_p) / peak_after


def longest_alone_bound(longest: int, args: argparse.Namespace, victim: int | None,
                        t_p: float | None) -> float:
    """The longest sequence alone on the fastest instance (after its prompt's prefill there); if
    that instance is preempted first, the rest on the next fastest (re-prefill not counted)."""
    speeds: list[float] = [args.base_rate * s for s in args.speeds]
    order = sorted(range(len(speeds)), key=lambda k: -speeds[k])
    fast = order[0]
    t: float = args.prompt_tokens / (speeds[fast] * args.prefill_factor)
    if victim != fast or t_p is None or t + longest / speeds[fast] <= t_p or len(order) < 2:
        return t + longest / speeds[fast]
    made = max(0.0, (t_p - t) * speeds[fast])
    return max(t, t_p) + (longest - made) / speeds[order[1]]


def opt_lower_bound(lengths: Sequence[int], args: argparse.Namespace, victim: int | None,
                    t_p: float | None) -> float | None:
    """A makespan no schedule of this batch on this pool can beat, even one that knows the lengths;
    None without scipy (``pip install -e .[bench]``).

    Linear relaxation of the simulator: instance ``i`` spends time ``x[i,n]`` running a batch of
    ``n <= max_running`` sequences, each decoding at ``rate[i,n] = speed_i / (1 + (n-1)/batch_half)``;
    sequence ``j`` spends ``y[j,i,n]`` of its time in such a batch. Every schedule with makespan ``T``
    satisfies:

    - ``sum_n x[i,n] <= T`` (``<= t_p`` for the preempted instance);
    - ``sum_j y[j,i,n] <= n x[i,n]`` (n slots) and ``y[j,i,n] <= x[i,n]`` (one slot per sequence:
      a long sequence in a small batch holds the whole instance at that batch for its time);
    - ``sum y[j,..] <= T - pre`` (none decodes before one prompt prefill at the fastest rate);
    - ``sum rate * y[j,..] >= L_j``.

    Moves, re-prefills, whole tokens and the order of events only add to a real schedule, so the
    least such ``T`` (solved by HiGHS) bounds the optimum from below; it combines both terms of the
    tight bound (a long sequence needs a small batch, a small batch costs throughput). To keep the LP
    small, sequences whose lengths lie within a factor ``1.1`` are pooled (their constraints summed:
    a relaxation, so still a bound; pooling within 1.03 gave the same value on the
    workload checked, seed 0 without preemption).
    """
    try:
        import scipy.sparse as sparse  # type: ignore[import-untyped]
        from scipy.optimize import linprog  # type: ignore[import-untyped]
    except ImportError:
        return None
    speeds = [args.base_rate * s for s in args.speeds]
    k, nmax = len(speeds), args.max_running
    rate = np.array([s / (1 + (n - 1) / args.batch_half) for s in speeds for n in range(1, nmax + 1)])
    batch = np.tile(np.arange(1, nmax + 1, dtype=float), k)
    modes = k * nmax
    pools: list[list[int]] = []
    for length in sorted(lengths):
        if pools and length <= 1.1 * pools[-1][0]:
            pools[-1].append(length)
        else:
            pools.append([length])
    g = len(pools)
    count = np.array([len(q) for q in pools], dtype=float)
    tokens = np.array([sum(q) for q in pools], dtype=float)
    pre = args.prompt_tokens / (args.prefill_factor * max(speeds))
    # Variables: x[m] (m = i * nmax + n - 1), y[q, m] for pool q (at nmax*k + q*modes + m), then T.
    col_t = modes + g * modes
    ym = modes + np.arange(g * modes).reshape(g, modes)
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    rhs: list[np.ndarray] = []
    r0 = 0

    def add(r: np.ndarray, c: np.ndarray, v: np.ndarray, b: np.ndarray) -> None:
        nonlocal r0
        rows.append(r + r0)
        cols.append(c)
        vals.append(v)
        rhs.append(b)
        r0 += len(b)

    inst = np.repeat(np.arange(k), nmax)
    add(np.concatenate([inst, np.arange(k)]), np.concatenate([np.arange(modes), np.full(k, col_t)]),
        np.concatenate([np.ones(modes), -np.ones(k)]), np.zeros(k))  # instance time <= T
    if victim is not None and t_p is not None:
        add(np.zeros(nmax, dtype=int), victim * nmax + np.arange(nmax), np.ones(nmax), np.array([t_p]))
    add(np.concatenate([np.tile(np.arange(modes), g), np.arange(modes)]),
        np.concatenate([ym.ravel(), np.arange(modes)]),
        np.concatenate([np.ones(g * modes), -batch]), np.zeros(modes))  # n slots
    add(np.concatenate([np.arange(g * modes)] * 2), np.concatenate([ym.ravel(), np.tile(np.arange(modes), g)]),
        np.concatenate([np.ones(g * modes), -np.repeat(count, modes)]), np.zeros(g * modes))  # one slot each
    add(np.concatenate([np.repeat(np.arange(g), modes), np.arange(g)]),
        np.concatenate([ym.ravel(), np.full(g, col_t)]),
        np.concatenate([np.ones(g * modes), -count]), -pre * count)  # decode time <= T - pre
    add(np.repeat(np.arange(g), modes), ym.ravel(), -np.tile(rate, g), -tokens)  # tokens made
    a_ub = sparse.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                             shape=(r0, col_t + 1))
    cost = np.zeros(col_t + 1)
    cost[col_t] = 1.0
    res = linprog(cost, A_ub=a_ub, b_ub=np.concatenate(rhs), bounds=(0, None), method="highs-ipm")
    if res.status != 0:
        raise RuntimeError(f"the bound's LP failed: {res.message}")
    return float(res.fun)
