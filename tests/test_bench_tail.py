"""benchmarks/bench_tail.py: its model continues exactly, its yardsticks hold, and a tiny run through the real
manager gives exact outputs and its report line."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from tail_fleet import EOS, OUTPUT_BASE, BoxSpec, LengthModel, length_of, prompt_key, reference, split_input, tokens  # noqa: E402
from tail_plan import Job, box_time, clairvoyant, lower_bound  # noqa: E402


def test_a_continuation_reads_the_prompt_and_gives_the_same_tokens() -> None:
    model = LengthModel(median=50, cap=300)
    prompt = [random.Random(1).randrange(3, OUTPUT_BASE) for _ in range(20)]
    whole = reference(prompt, 7, 10_000, model)
    key = prompt_key(prompt)
    length = length_of(key, 7, model)
    assert len(whole) == length and whole[-1] == EOS and all(t >= OUTPUT_BASE for t in whole[:-1])
    cut = length // 3
    assert split_input(prompt + whole[:cut]) == len(prompt)
    assert whole[:cut] + tokens(key, 7, cut, length, length) == whole
    assert reference(prompt, 7, cut, model) == whole[:cut]  # a budget ends it early
    assert reference(prompt, 8, 10_000, model) != whole  # another seed samples otherwise


def test_the_clairvoyant_plan_never_beats_the_lower_bound() -> None:
    specs = [BoxSpec(1.0, max_running=4), BoxSpec(0.5, max_running=4), BoxSpec(0.25, max_running=4)]
    rng = random.Random(0)
    jobs = [Job(i, i // 3, 16, rng.randrange(8, 400)) for i in range(30)]
    plan = clairvoyant(specs, jobs)
    assert sorted(j.index for b in plan.boxes for j in b) == list(range(30))
    assert plan.makespan == pytest.approx(max(box_time(s, b) for s, b in zip(specs, plan.boxes)))
    assert lower_bound(specs, jobs) <= plan.makespan
    # one sequence: the bound is the plan (alone on the fastest box)
    one = [Job(0, 0, 16, 100)]
    assert clairvoyant(specs, one).makespan == pytest.approx(lower_bound(specs, one))


@pytest.mark.slow
def test_a_tiny_step_through_the_manager_is_exact_and_reported(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_tail.py"), "--groups", "4", "--samples", "3",
         "--median", "30", "--cap", "120", "--prompt-tokens", "16", "--speeds", "1,0.5,0.25", "--max-running", "4",
         "--seeds", "1", "--epochs", "1", "--no-router", "--no-baseline", "--cache-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "outputs equal to the reference: all" in out.stdout
    rows = [ln for ln in out.stdout.splitlines() if ln.startswith("| 0 | 0 | manager |")]
    assert rows and rows[0].split("|")[11].strip() == "12/12"
    assert re.fullmatch(r"tail: manager \d+\.\d\dx of clairvoyant \(worst \d+\.\d\dx\), router \d+\.\d\dx",
                        out.stdout.splitlines()[-1])


def test_the_simulated_tail_knows_its_yardsticks(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/sim_tail.py: the manager's policies in the simulator against the clairvoyant plan. Told every
    length and the boxes' speeds, placement alone comes within a few percent of it; its report line is there."""
    import sim_tail
    sim_tail.main(["--seeds", "2", "--epochs", "1", "--groups", "16", "--warm", "--oracle", "exact",
                   "--no-migration"])
    out = capsys.readouterr().out
    told = float(re.search(r"sim tail: makespan ([\d.]+)x of clairvoyant in a first epoch", out).group(1))
    assert 0.95 <= told <= 1.15, out
    sim_tail.main(["--seeds", "2", "--epochs", "2", "--groups", "16"])
    out = capsys.readouterr().out
    assert re.search(r"^- epoch 1: makespan / clairvoyant median [\d.]+", out, re.M), out
