"""Every seed of tests/fuzz/corpus/ through its atheris target once (no fuzzing), so the corpus
stays valid: program files the parser accepts, plan inputs the plan handles."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TARGETS = ("program_file", "plan")


@pytest.mark.parametrize("target", TARGETS)
def test_seed_corpus_passes_its_fuzz_target(target):
    seeds = sorted((HERE / "corpus" / target).iterdir())
    assert seeds, f"no seeds for {target}"
    # libFuzzer with files (not directories) runs each once and exits non-zero on a finding.
    run = subprocess.run([sys.executable, str(HERE / f"fuzz_{target}.py"), *map(str, seeds)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stderr.count("Running: ") == len(seeds), run.stderr[-4000:]


def test_corpus_program_files_are_accepted_by_the_parser():
    from megatron_p2p import program

    for path in sorted((HERE / "corpus" / "program_file").iterdir()):
        program.load(path)  # a ProgramError here: the seed itself is malformed
