"""bench_tail's step in the simulator: the manager's policy code against the same clairvoyant plan, in seconds.

``bench_tail.py`` runs the real manager over HTTP in front of a simulated fleet (about 20 minutes for 3 seeds);
this runs the same decisions (``makespan`` placement with the length model and the boxes' learned step models,
tail migration, optionally divided rollouts) in ``sim_pool``'s discrete-event pool with bench_tail's fleet
(speeds 1, 1, 0.6 x 3, 0.35 x 3; a step of 6 ms + 0.08 ms a running sequence at speed 1, at most 64 running;
prefill 300x a lone decode) and bench_tail's lengths (a group's median lognormal around 400, sigma 0.9; its
samples sigma 0.35 around it; at most 4,096), and divides each makespan by ``tail_plan.clairvoyant``'s plan
for the same lengths. Several seeds in seconds, so a policy idea is tried here first, then confirmed with
bench_tail. The pool's batch model matches the fleet's step to within one sequence's share; streams are
observed every ``--tick`` (from the chunk size, ``Shape.tick``) rather than per chunk, and moves cost
``--move-overhead`` besides the prefill. ``--fleet`` and the fleet options put the step on another fleet
(``tail_fleet.SWEEP``: speed spreads of 2x to 4x, running caps of 16 to 128, other step shapes, length spreads
and chunk sizes); ``--sweep`` runs every one of them and reports each fleet's median and worst seed.

    .venv/bin/python benchmarks/sim_tail.py                      # 8 seeds x 3 epochs
    .venv/bin/python benchmarks/sim_tail.py --cap 48 --pieces 1024 --no-migration
    .venv/bin/python benchmarks/sim_tail.py --fleet issue-46 --epochs 1
    .venv/bin/python benchmarks/sim_tail.py --sweep --seeds 8 --epochs 1

The last line: ``sim tail: makespan X.XXx of clairvoyant in a first epoch (worst W.WWx), Y.YYx in the last``; with
``--sweep``: ``sim tail sweep: N fleets, first epoch median X.XXx of clairvoyant (...), worst W.WWx``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scheduling
from sim_pool import PiecedMakespan, make_lengths, simulate
from tail_fleet import BENCH, SWEEP, Shape
from tail_plan import Job, clairvoyant, lower_bound

from rollout_manager.placement.box_speed import BoxSpeeds
from rollout_manager.placement.lengths import LengthModel, Prediction, Track
from rollout_manager.placement.makespan import Makespan
from rollout_manager.placement.tail_migration import TailMigration

GROUP = 8
PROMPT = 256


class Oracle(LengthModel):
    """A length model that is told the truth (``exact``: each sequence's length; ``group``: its group's
    median): what the same placement and migration make of perfect knowledge, so the gap that is left to
    clairvoyant is the policy's, and the rest of the manager's gap is what it cannot know in time."""

    def __init__(self, lengths: list[int], kind: str) -> None:
        super().__init__()
        groups = [statistics.median(lengths[g:g + GROUP]) for g in range(0, len(lengths), GROUP)]
        self.truth = lengths if kind == "exact" else [groups[i // GROUP] for i in range(len(lengths))]

    def predict(self, track: Track, made: int | None = None) -> Prediction:
        n = float(max(self.truth[int(track.name)], track.made if made is None else made))
        return Prediction(n, n, n, self.q, 0.0)

    def left(self, track: Track, made: int) -> float:
        return max(self.predict(track, made).median - made, 1.0)

    def high(self, track: Track, made: int) -> float | None:
        return self.left(track, made)  # told the truth, there is no spread to allow for

    @staticmethod
    def informed(track: Track) -> bool:
        return True


def bench_lengths(seed: int, epoch: int, groups: int, shape: Shape = BENCH) -> list[int]:
    """The lengths bench_tail's step has for ``seed`` and ``epoch`` on ``shape`` (``groups`` groups)."""
    import bench_tail
    import tail_fleet

    args = bench_tail.parse_args(["--groups", str(groups), "--samples", str(GROUP), "--prompt-tokens", str(PROMPT)])
    model = tail_fleet.LengthModel(shape.median, shape.group_sigma, shape.sample_sigma, shape.cap)
    return [s.length for s in bench_tail.make_step(seed, epoch, args, model).samples]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3, help="the same prompts again, new draws, the model kept")
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--cap", type=int, default=0, help="the placement's bound per box (0: the boxes' own)")
    p.add_argument("--pieces", type=int, default=0, help="divided rollouts of this many tokens a piece (0: off)")
    p.add_argument("--no-migration", action="store_true")
    p.add_argument("--migrate-interval", type=float, default=1.0)
    p.add_argument("--tail-slowdown", type=float, default=1.3,
                   help="tail_migration_tail_slowdown, as the manager (0: the predicted tail may join any batch)")
    p.add_argument("--tail-share", type=float, default=1.0,
                   help="tail_migration_tail_share (0: tail migration by age alone, as before 2026-11-28)")
    p.add_argument("--swap-queue", type=int, default=1,
                   help="tail_migration_swap_queue: while requests wait, sequences on slower boxes may take this "
                   "many of a faster box's next free slots, as the manager (0: nothing moves while requests wait)")
    p.add_argument("--warm", action="store_true",
                   help="the boxes' speeds learned in one earlier step of other prompts (a manager's second step "
                   "on new data) before the first epoch; the length model starts empty all the same")
    p.add_argument("--affinity", action="store_true",
                   help="a prompt's samples prefer the box its first went to, in every epoch (the manager's "
                   "affinity table, on by default there)")
    p.add_argument("--bench-lengths", action="store_true",
                   help="bench_tail's own lengths (its seeds, its epochs' draws) instead of the simulator's: the "
                   "simulator on the very steps bench_tail ran, seed by seed")
    p.add_argument("--restart", choices=("nothing", "lengths", "all"), default=None,
                   help="the manager restarts before every epoch after the first, keeping nothing, the length "
                   "model only, or the length model and the boxes' speeds (scheduler_state_file)")
    p.add_argument("--oracle", choices=("exact", "group"), default=None,
                   help="predictions told the truth (each length, or its group's median): the policy's own gap")
    fleet = p.add_argument_group("the fleet and its step (default: bench_tail's)")
    fleet.add_argument("--fleet", choices=[s.name for s in SWEEP], default=BENCH.name,
                       help="one of --sweep's fleets; the options below change it")
    fleet.add_argument("--speeds", default=None, help="one box per speed, comma separated")
    fleet.add_argument("--max-running", type=int, default=None, help="per box")
    fleet.add_argument("--base-ms", type=float, default=None, help="decode step at speed 1: base ...")
    fleet.add_argument("--per-seq-ms", type=float, default=None, help="... plus this per running sequence")
    fleet.add_argument("--prefill-ms", type=float, default=None, help="per uncached input token at speed 1")
    fleet.add_argument("--median", type=float, default=None, help="median length of a group's median")
    fleet.add_argument("--group-sigma", type=float, default=None, help="lognormal sigma of the groups' medians")
    fleet.add_argument("--sample-sigma", type=float, default=None, help="lognormal sigma of samples in a group")
    fleet.add_argument("--length-cap", type=int, default=None, help="max_new_tokens, the longest length drawn")
    fleet.add_argument("--chunk-tokens", type=int, default=None, help="tokens a streamed chunk carries")
    fleet.add_argument("--tick", type=float, default=None,
                       help="seconds between two chunks of a stream (default: from --chunk-tokens, Shape.tick)")
    p.add_argument("--sweep", action="store_true",
                   help="every fleet of SWEEP (the fleet options are ignored); the first epoch's median and worst "
                   "per fleet, then over all of them")
    return p.parse_args(argv)


def shape_of(own: argparse.Namespace) -> Shape:
    """``--fleet``'s shape with the fleet options given."""
    shape = next(s for s in SWEEP if s.name == own.fleet)
    changes: dict[str, object] = {k: v for k, v in (
        ("max_running", own.max_running), ("base_ms", own.base_ms), ("per_seq_ms", own.per_seq_ms),
        ("prefill_ms", own.prefill_ms), ("median", own.median), ("group_sigma", own.group_sigma),
        ("sample_sigma", own.sample_sigma), ("cap", own.length_cap), ("chunk_tokens", own.chunk_tokens))
        if v is not None}
    if own.speeds:
        changes["speeds"] = tuple(float(x) for x in own.speeds.split(","))
    return replace(shape, name=shape.name + ("*" if changes else ""), **changes)  # type: ignore[arg-type]


def sim_args(own: argparse.Namespace, shape: Shape) -> argparse.Namespace:
    """The pool's arguments in ``shape``'s terms: a lone sequence at speed 1 makes 1000 / (base + per_seq) tokens
    a second and half that beside (base + per_seq) / per_seq others, which is ``base + per_seq x n`` a step;
    prefill runs 1000 / prefill_ms tokens a second; the group holds its share of the log variance."""
    lone_ms = shape.base_ms + shape.per_seq_ms
    var = shape.group_sigma ** 2 + shape.sample_sigma ** 2
    return bench_scheduling.parse_args([
        "--speeds", ",".join(str(s) for s in shape.speeds), "--base-rate", str(1000.0 / lone_ms),
        "--batch-half", str(lone_ms / shape.per_seq_ms if shape.per_seq_ms > 0 else 1e9),
        "--max-running", str(shape.max_running), "--prompt-tokens", str(PROMPT), "--median-tokens", str(shape.median),
        "--sigma", str(math.sqrt(var)), "--group-size", str(GROUP),
        "--group-share", str(shape.group_sigma ** 2 / var if var else 0.0), "--max-new-tokens", str(shape.cap),
        "--requests", str(own.groups * GROUP), "--preempt", "none",
        "--prefill-factor", str(lone_ms / shape.prefill_ms), "--migrate-interval", str(own.migrate_interval),
        "--tick", str(own.tick or shape.tick), "--tm-tail-share", str(own.tail_share),
        "--tm-batch-half", "64",  # the manager's tail_migration_batch_half: it is not told the fleet's
        "--tm-tail-slowdown", str(own.tail_slowdown)])


@dataclass
class Runs:
    """Makespan / clairvoyant (and / the lower bound) by epoch, over seeds; moves per step."""

    ratios: list[list[float]]
    bounds: list[list[float]]
    moves: list[int]


def mover_of(own: argparse.Namespace, args: argparse.Namespace) -> TailMigration:
    """The manager's tail migration with the pool's settings and ``--swap-queue``."""
    return TailMigration(**bench_scheduling.migration_kwargs(args), swap_queue=own.swap_queue)  # type: ignore[arg-type]


def run_shape(own: argparse.Namespace, shape: Shape) -> Runs:
    sim = sim_args(own, shape)
    specs = shape.specs()
    cap = own.cap or shape.max_running
    out = Runs([[] for _ in range(own.epochs)], [[] for _ in range(own.epochs)], [])
    for seed in range(own.seeds):
        args = argparse.Namespace(**{**vars(sim), "seed": seed})
        model, speeds = LengthModel(), BoxSpeeds()  # kept from one epoch to the next, as the manager keeps them
        table: dict[int, str] | None = {} if own.affinity else None
        if own.warm:
            other = argparse.Namespace(**{**vars(args), "seed": 10_000 + seed})
            simulate("warm-up", Makespan(max_in_flight=cap), make_lengths(other, 0), other, None, None,
                     None if own.no_migration else mover_of(own, args),
                     LengthModel(), 0, speeds)
        for epoch in range(own.epochs):
            lengths = bench_lengths(seed, epoch, own.groups, shape) if own.bench_lengths else make_lengths(args, epoch)
            if own.oracle:
                model = Oracle(lengths, own.oracle)
            jobs = [Job(i, i // GROUP, PROMPT, n) for i, n in enumerate(lengths)]
            best = clairvoyant(specs, jobs).makespan
            policy: Makespan = PiecedMakespan(max_in_flight=cap, pieces=own.pieces) if own.pieces \
                else Makespan(max_in_flight=cap)
            mover = None if own.no_migration else mover_of(own, args)
            if epoch and own.restart:  # what a restarted manager starts from: the curves it saved, seeded
                kept, speeds = speeds.models()[0], BoxSpeeds()
                for iid, curve in kept.items() if own.restart == "all" else ():
                    speeds.seed(iid, curve)
                if own.restart == "nothing" and not own.oracle:
                    model = LengthModel()
            r = simulate("manager", policy, lengths, args, None, None, mover, model, epoch, speeds, table)
            out.ratios[epoch].append(r.makespan / best)
            out.bounds[epoch].append(r.makespan / lower_bound(specs, jobs))
            out.moves.append(r.migrations)
    return out


def settings(own: argparse.Namespace) -> str:
    return (f"{own.seeds} seeds x {own.epochs} epochs, {own.groups} groups x {GROUP}; placement cap "
            f"{own.cap or 'the boxes own'}, pieces {own.pieces or 'off'}, tail migration "
            f"{'off' if own.no_migration else 'on'}, predictions "
            f"{'told the ' + own.oracle + ' truth' if own.oracle else 'learned'}, speeds "
            f"{'learned in a step before' if own.warm else 'unknown at the start'}"
            f"{'; restarted before each later epoch keeping ' + own.restart if own.restart else ''}")


def sweep(own: argparse.Namespace) -> int:
    """Every fleet of :data:`SWEEP`: per fleet the first epoch's median and worst seed, then the median of the
    fleets' medians and the worst seed of any."""
    print(f"sim tail sweep: {settings(own)}")
    medians, worst = [], []
    for shape in SWEEP:
        runs = run_shape(own, shape)
        first = runs.ratios[0]
        medians.append(statistics.median(first))
        worst.append(max(first))
        later = "; ".join(f"epoch {e} {statistics.median(rs):.2f}x (worst {max(rs):.2f})"
                          for e, rs in enumerate(runs.ratios) if e)
        print(f"- {shape.describe()}: first epoch median {medians[-1]:.2f}x, worst {worst[-1]:.2f}x"
              f"{'; ' + later if later else ''}; moves per step median {statistics.median(runs.moves):.0f}")
    print(f"sim tail sweep: {len(SWEEP)} fleets, first epoch median {statistics.median(medians):.2f}x of "
          f"clairvoyant (fleets' medians {min(medians):.2f}-{max(medians):.2f}), worst {max(worst):.2f}x")
    return 0


def main(argv: list[str] | None = None) -> int:
    own = parse(argv)
    if own.sweep:
        return sweep(own)
    shape = shape_of(own)
    runs = run_shape(own, shape)
    print(f"sim tail: {settings(own)}; moves per step median {statistics.median(runs.moves):.0f}")
    print(f"fleet {shape.describe()}")
    for epoch, (rs, bs) in enumerate(zip(runs.ratios, runs.bounds)):
        print(f"- epoch {epoch}: makespan / clairvoyant median {statistics.median(rs):.2f} "
              f"(worst {max(rs):.2f}, best {min(rs):.2f}); / lower bound {statistics.median(bs):.2f}; per seed "
              + " ".join(f"{x:.2f}" for x in rs))
    print(f"sim tail: makespan {statistics.median(runs.ratios[0]):.2f}x of clairvoyant in a first epoch "
          f"(worst {max(runs.ratios[0]):.2f}x), {statistics.median(runs.ratios[-1]):.2f}x in the last")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
