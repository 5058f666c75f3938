"""atheris target: the program-file parser (megatron_p2p.program.loads) and, for every program
it accepts, the text round trip and the simulator (csrc/core/simulate.c) behind
megatron_p2p.simulate. A ProgramError (a ValueError) is the only way to refuse an input;
anything else raised, or a crash, is a finding.

    python tests/fuzz/fuzz_program_file.py -max_total_time=60 WORK_DIR tests/fuzz/corpus/program_file
"""
from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["megatron_p2p.program", "megatron_p2p.simulate"]):
    from megatron_p2p import program, simulate

# Programs the simulator runs in a moment; larger ones only go through the parser.
MAX_SIMULATED_OPS = 4096


@atheris.instrument_func
def check(data: bytes) -> None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return
    try:
        parsed = program.loads(text)
    except program.ProgramError:
        return
    again = program.loads(program.dumps(parsed))
    if again != parsed:
        raise AssertionError("loads(dumps(p)) != p")
    if parsed.num_ops() <= MAX_SIMULATED_OPS:
        verdict = simulate.simulate(parsed)
        if verdict.verdict not in ("ok", "deadlock", "mismatch"):
            raise AssertionError(f"unknown verdict {verdict.verdict!r}")


def main() -> None:
    atheris.Setup(sys.argv, check)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
