"""The device script's dry run: tests/gpu/run_device_checks.sh --model runs every two-process step
the GPU run takes, on the model of libcuda and libnccl (tests/fakes/), so that when a GPU is lent
nothing in the script is untried and only the libraries change. Its results stay in
build/device-dry-run/, which travels with the tree to a GPU machine, where the script sets them
beside the GPU's verdicts."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_in_session

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "gpu" / "run_device_checks.sh"
DRY_RUN = ROOT / "build" / "device-dry-run"
sys.path.append(str(ROOT / "tests" / "gpu"))
import two_process_checks  # noqa: E402

CHECKS = two_process_checks.MAIN_PARTS + two_process_checks.FAULT_PARTS[1:] + ["watchdog_end"]
LIMIT_S = 360  # the script's own step limit on the model is 270 s
torchrun = pytest.mark.torchrun  # the tests of the dry run: it launches torchrun jobs


@pytest.fixture(scope="module")
def dry_run() -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = run_in_session([str(SCRIPT), "--model"], LIMIT_S, merge_stderr=True, cwd=ROOT, env=env)
    return done, json.loads((DRY_RUN / "two_process.json").read_text())


@torchrun
def test_the_dry_run_passes_and_says_so(dry_run):
    proc, _ = dry_run
    assert proc.returncode == 0, proc.stdout[-8000:]
    assert "PASS two_process" in proc.stdout, proc.stdout[-3000:]


@torchrun
def test_the_dry_run_runs_two_processes_on_the_model(dry_run):
    _, summary = dry_run
    assert summary["target"] == "model" and summary["ranks"] == 2 and summary["path"] == "2 rank(s)", summary


@torchrun
@pytest.mark.parametrize("check", CHECKS)
def test_every_two_process_check_passes_on_the_model_with_two_ranks(dry_run, check):
    result = dry_run[1]["checks"][check]
    assert result["ok"] and not result.get("skipped"), result


@torchrun
def test_the_steps_only_a_gpu_can_run_are_named_as_not_run(dry_run):
    proc, _ = dry_run
    for step in ("build", "gpu_checks", "gpu_exchange"):
        assert f"GPU ONLY {step} (" in proc.stdout, proc.stdout[-3000:]


@torchrun
def test_the_script_ends_with_every_checks_verdict_in_a_table(dry_run):
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")[1:]]
            for line in dry_run[0].stdout.splitlines() if line.count("|") == 2}
    for check in CHECKS:
        assert rows.get(check) == ["PASS", "-"], (check, rows.get(check))


def test_the_table_marks_a_check_whose_verdicts_differ_and_not_one_that_agrees(tmp_path):
    def run(path: str, **verdicts: bool) -> str:
        checks = {name: {"ok": ok} for name, ok in verdicts.items()}
        (tmp_path / path).write_text(json.dumps({"ranks": 2, "path": "2 rank(s)", "checks": checks}))
        return str(tmp_path / path)

    lines = two_process_checks.table(run("model.json", agree=True, differ=True),
                                     run("gpu.json", agree=True, differ=False)).splitlines()
    assert next(line for line in lines if line.startswith("differ")).endswith("<- differ"), lines
    assert not next(line for line in lines if line.startswith("agree")).endswith("<- differ"), lines
