"""Issue #26.6, the `elastic-predictor` items: `plan` with `gpus` above the partition prints the error, not a
traceback; `evaluate` shows progress on stderr, its stdout unchanged. Each test fails before its fix."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from click.testing import CliRunner

from predictor.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_plan_with_gpus_above_the_partition_is_a_one_line_error(tmp_path):
    db = str(tmp_path / "p.db")
    runner = CliRunner()
    assert runner.invoke(main, ["profile", "resnet50", "--db", db]).exit_code == 0
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH -N 1\n#ELASTIC model=resnet50 gpus=64-128 per_gpu_batch=64\nsrun true\n")
    result = runner.invoke(main, ["plan", str(script), "--db", db])
    assert isinstance(result.exception, SystemExit), result.exception   # before: planner.DirectiveProblem raised
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    # the file's line (3, not the planner's directive count), the field, the partition and the line itself
    assert lines[0].startswith(f"Error: {script}:3: gpus: minimum 64 exceeds the 16 GPUs of partition debug: ")
    assert lines[0].endswith("'#ELASTIC model=resnet50 gpus=64-128 per_gpu_batch=64'")


FAKE_BENCH = """\
import sys, time
names = sys.argv[sys.argv.index("--datasets") + 1].split(",")
for name in names:
    time.sleep(0.2)
    print(f"{name}: done at 0 s", file=sys.stderr, flush=True)
print("| dataset | error |")
print("| " + " | ".join(names) + " |")
raise SystemExit(0)
"""


def _evaluate(checkout: Path, *extra: str) -> subprocess.CompletedProcess:
    """`elastic-predictor evaluate` in a process of its own (the bench's stdout is the process's own), run from
    a checkout whose bench/accuracy.py is FAKE_BENCH, saying every 0.05 s that it still runs."""
    code = textwrap.dedent(f"""
        import pathlib, sys
        from predictor import cli
        cli.REPO_ROOT = pathlib.Path({str(checkout)!r})
        cli.PROGRESS_EVERY_S = 0.05
        sys.argv = ["elastic-predictor", "evaluate", "--datasets", "pollux-t4,morphling-a800", *{list(extra)!r}]
        cli.main()
    """)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_evaluate_shows_progress_on_stderr_and_leaves_stdout_alone(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "accuracy.py").write_text(FAKE_BENCH)
    done = _evaluate(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "| dataset | error |\n| pollux-t4 | morphling-a800 |\n"   # the bench's, untouched
    err = done.stderr
    for line in ("evaluate: running bench/accuracy.py on 2 dataset(s) (pollux-t4, morphling-a800)",
                 "evaluate: [1/2] pollux-t4", "pollux-t4: done at 0 s", "evaluate: [2/2] morphling-a800",
                 "morphling-a800: done at 0 s", "evaluate: still running: pollux-t4", "evaluate: finished after"):
        assert line in err, err
    assert err.index("[1/2] pollux-t4") < err.index("pollux-t4: done") < err.index("[2/2] morphling-a800") \
        < err.index("morphling-a800: done") < err.index("finished after")


def test_evaluate_is_quick_by_default_and_full_on_request(tmp_path):
    """The default runs the bench's leave-one-model-out protocol (a few minutes) and says so; --full hands the
    bench --full (protocols A and B) and says it takes half an hour or more."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "accuracy.py").write_text(FAKE_BENCH.replace('print("| dataset | error |")',
                                                                        'print("argv", sys.argv[1:])'))
    quick, full = _evaluate(tmp_path), _evaluate(tmp_path, "--full")
    assert quick.returncode == 0 and full.returncode == 0, (quick.stderr, full.stderr)
    assert "'--full'" not in quick.stdout and "'--full'" in full.stdout
    assert "a few minutes (--full for protocols A and B)" in quick.stderr
    assert "--full adds about a hundred fits (half an hour or more)" in full.stderr


def test_evaluate_says_when_the_bench_fails_and_keeps_its_status(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "accuracy.py").write_text(FAKE_BENCH.replace("SystemExit(0)", "SystemExit(3)"))
    failed = _evaluate(tmp_path)
    assert failed.returncode == 3
    assert "evaluate: failed (exit status 3) after" in failed.stderr


def test_evaluate_fit_errors_says_what_it_fits_on_stderr(tmp_path):
    db = str(tmp_path / "p.db")
    runner = CliRunner()
    assert runner.invoke(main, ["profile", "resnet50", "--db", db]).exit_code == 0
    result = runner.invoke(main, ["evaluate", "--fit-errors", "--db", db])
    assert result.exit_code == 0, result.output
    assert f"evaluate: fitting the model on {db} ..." in result.stderr
    assert "evaluate:" not in result.stdout and "step model" in result.stdout
