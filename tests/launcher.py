"""torchrun, started warm. The torchrun command is torch.distributed.run's main(); starting it as a
new interpreter costs a job about 2 s of CPU for torch's import alone, and the suite runs about
a hundred jobs. So each job's launcher is forked from a process that has imported
torch.distributed.run already (multiprocessing's forkserver, with it preloaded), takes the job's
environment, working directory and arguments, and runs main() as the command would: every rank
is still a new process that main() starts."""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch.distributed.run"])


def _main(args: list[str], env: dict[str, str], cwd: str, output: str) -> None:
    """In the forked launcher: a session of its own (so that killing its group reaches no test),
    its output in `output`, then torchrun's main()."""
    os.setsid()
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for std in (1, 2):
        os.dup2(fd, std)
    os.close(fd)
    # Line-buffered, so that a job killed on its limit leaves what it printed (a new interpreter
    # would take PYTHONUNBUFFERED); logging's handlers, which hold the old streams, flush each record.
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # the process's streams, never closed
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    from torch.distributed.run import main

    main(args)


class Launch:
    """One torchrun command, running: `args` as the command's own arguments. With a `prefix` (a
    command that execs the rest, such as one that enters a mount namespace first) torchrun starts
    cold, as a new interpreter under it: a fork cannot pass through an exec."""

    def __init__(self, args: list[str], env: dict[str, str], output: Path, prefix: list[str] | None = None) -> None:
        self._output = output
        self._process: multiprocessing.process.BaseProcess | None = None
        self._command: subprocess.Popen[bytes] | None = None
        if prefix:
            with open(output, "wb") as out:
                self._command = subprocess.Popen([*prefix, sys.executable, "-m", "torch.distributed.run", *args],
                                                 env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        else:
            self._process = _CONTEXT.Process(target=_main, args=(args, env, os.getcwd(), str(output)))
            self._process.start()

    @property
    def pid(self) -> int | None:
        return self._command.pid if self._command else self._process.pid if self._process else None

    def wait(self, timeout: float) -> int | None:
        """Its exit status (1 when main() raised, as the command's), or None while it runs past `timeout`."""
        if self._command:
            try:
                return self._command.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
        assert self._process
        self._process.join(timeout)
        return self._process.exitcode

    def kill(self) -> None:
        """Kills the launcher and its process group; ranks in sessions of their own are the caller's to find."""
        pid = self.pid
        if pid:
            for kill in (os.killpg, os.kill):  # the group; the process alone if it had not made one yet
                try:
                    kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self._command:
            self._command.wait()
        elif self._process:
            self._process.join()

    def output(self) -> str:
        return self._output.read_text(errors="replace") if self._output.exists() else ""
