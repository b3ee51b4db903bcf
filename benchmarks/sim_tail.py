"""bench_tail's step in the simulator: the manager's policy code against the same clairvoyant plan, in seconds.

``bench_tail.py`` runs the real manager over HTTP in front of a simulated fleet (about 20 minutes for 3 seeds);
this runs the same decisions (``makespan`` placement with the length model and the boxes' learned step models,
tail migration, optionally divided rollouts) in ``sim_pool``'s discrete-event pool with bench_tail's fleet
(speeds 1, 1, 0.6 x 3, 0.35 x 3; a step of 6 ms + 0.08 ms a running sequence at speed 1, at most 64 running;
prefill 300x a lone decode) and bench_tail's lengths (a group's median lognormal around 400, sigma 0.9; its
samples sigma 0.35 around it; at most 4,096), and divides each makespan by ``tail_plan.clairvoyant``'s plan
for the same lengths. Several seeds in seconds, so a policy idea is tried here first, then confirmed with
bench_tail. The pool's batch model matches the fleet's step to within one sequence's share; streams are
observed every ``--tick`` rather than per chunk, and moves cost ``--move-overhead`` besides the prefill.

    .venv/bin/python benchmarks/sim_tail.py                      # 8 seeds x 3 epochs
    .venv/bin/python benchmarks/sim_tail.py --cap 48 --pieces 1024 --no-migration

The last line: ``sim tail: makespan X.XXx of clairvoyant in a first epoch, Y.YYx in the last``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scheduling
from sim_pool import PiecedMakespan, make_lengths, simulate
from tail_fleet import BoxSpec
from tail_plan import Job, clairvoyant, lower_bound

from rollout_manager.rollout.box_speed import BoxSpeeds
from rollout_manager.rollout.lengths import LengthModel, Prediction, Track
from rollout_manager.rollout.makespan import Makespan
from rollout_manager.rollout.scheduling import TailMigration

SPEEDS = "1,1,.6,.6,.6,.35,.35,.35"
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


def bench_lengths(seed: int, epoch: int, groups: int) -> list[int]:
    """The lengths of bench_tail's step for ``seed`` and ``epoch`` (its defaults, ``groups`` groups)."""
    import bench_tail
    import tail_fleet

    args = bench_tail.parse_args(["--groups", str(groups), "--samples", str(GROUP), "--prompt-tokens", str(PROMPT)])
    return [s.length for s in bench_tail.make_step(seed, epoch, args, tail_fleet.LengthModel()).samples]


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3, help="the same prompts again, new draws, the model kept")
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--cap", type=int, default=64, help="the placement's bound per box (64: the boxes' own)")
    p.add_argument("--pieces", type=int, default=0, help="divided rollouts of this many tokens a piece (0: off)")
    p.add_argument("--no-migration", action="store_true")
    p.add_argument("--migrate-interval", type=float, default=1.0)
    p.add_argument("--tick", type=float, default=0.25)
    p.add_argument("--tail-slowdown", type=float, default=1.3,
                   help="tail_migration_tail_slowdown, as the manager (0: the predicted tail may join any batch)")
    p.add_argument("--tail-share", type=float, default=1.0,
                   help="tail_migration_tail_share (0: tail migration by age alone, as before 2026-11-28)")
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
    own = p.parse_args(argv)
    # The pool's own arguments, in bench_tail's shape: lone rate 1000 / 6.08 tok/s at speed 1, half speed at
    # 76 beside it, (6 + 0.08 n) ms a step; the group holds 0.81 / (0.81 + 0.35^2) of the log variance.
    sim = bench_scheduling.parse_args([
        "--speeds", SPEEDS, "--base-rate", "164", "--batch-half", "76", "--max-running", "64",
        "--prompt-tokens", str(PROMPT), "--median-tokens", "400", "--sigma", "0.966", "--group-size", str(GROUP),
        "--group-share", "0.869", "--requests", str(own.groups * GROUP), "--preempt", "none",
        "--prefill-factor", "300", "--migrate-interval", str(own.migrate_interval), "--tick", str(own.tick),
        "--tm-tail-share", str(own.tail_share), "--tm-tail-slowdown", str(own.tail_slowdown)])
    return own, sim


def main(argv: list[str] | None = None) -> int:
    own, sim = parse(argv)
    specs = [BoxSpec(float(s), 64) for s in SPEEDS.split(",")]
    ratios: list[list[float]] = [[] for _ in range(own.epochs)]
    bounds: list[list[float]] = [[] for _ in range(own.epochs)]
    moves: list[int] = []
    for seed in range(own.seeds):
        args = argparse.Namespace(**{**vars(sim), "seed": seed})
        model, speeds = LengthModel(), BoxSpeeds()  # kept from one epoch to the next, as the manager keeps them
        table: dict[int, str] | None = {} if own.affinity else None
        if own.warm:
            other = argparse.Namespace(**{**vars(args), "seed": 10_000 + seed})
            simulate("warm-up", Makespan(max_in_flight=own.cap), make_lengths(other, 0), other, None, None,
                     None if own.no_migration else TailMigration(**bench_scheduling.migration_kwargs(args)),  # type: ignore[arg-type]
                     LengthModel(), 0, speeds)
        for epoch in range(own.epochs):
            lengths = bench_lengths(seed, epoch, own.groups) if own.bench_lengths else make_lengths(args, epoch)
            if own.oracle:
                model = Oracle(lengths, own.oracle)
            jobs = [Job(i, i // GROUP, PROMPT, n) for i, n in enumerate(lengths)]
            best = clairvoyant(specs, jobs).makespan
            policy: Makespan = PiecedMakespan(max_in_flight=own.cap, pieces=own.pieces) if own.pieces \
                else Makespan(max_in_flight=own.cap)
            mover = None if own.no_migration else TailMigration(**bench_scheduling.migration_kwargs(args))  # type: ignore[arg-type]
            if epoch and own.restart:  # what a restarted manager starts from: the curves it saved, seeded
                kept, speeds = speeds.models()[0], BoxSpeeds()
                for iid, curve in kept.items() if own.restart == "all" else ():
                    speeds.seed(iid, curve)
                if own.restart == "nothing" and not own.oracle:
                    model = LengthModel()
            r = simulate("manager", policy, lengths, args, None, None, mover, model, epoch, speeds, table)
            ratios[epoch].append(r.makespan / best)
            bounds[epoch].append(r.makespan / lower_bound(specs, jobs))
            moves.append(r.migrations)
    print(f"sim tail: {own.seeds} seeds x {own.epochs} epochs, {own.groups} groups x {GROUP}; placement cap {own.cap}, "
          f"pieces {own.pieces or 'off'}, tail migration {'off' if own.no_migration else 'on'}, "
          f"predictions {'told the ' + own.oracle + ' truth' if own.oracle else 'learned'}, "
          f"speeds {'learned in a step before' if own.warm else 'unknown at the start'}"
          f"{'; restarted before each later epoch keeping ' + own.restart if own.restart else ''}; "
          f"moves per step median {statistics.median(moves):.0f}")
    for epoch, (rs, bs) in enumerate(zip(ratios, bounds)):
        print(f"- epoch {epoch}: makespan / clairvoyant median {statistics.median(rs):.2f} "
              f"({min(rs):.2f}-{max(rs):.2f}); / lower bound {statistics.median(bs):.2f}; per seed "
              + " ".join(f"{x:.2f}" for x in rs))
    print(f"sim tail: makespan {statistics.median(ratios[0]):.2f}x of clairvoyant in a first epoch, "
          f"{statistics.median(ratios[-1]):.2f}x in the last")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
