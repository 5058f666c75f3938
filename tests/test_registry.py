"""megatron_p2p/_registry.py: the process's live communicators and its one exit hook, whose stages
run in a fixed order whatever the order the modules registered their parts in."""
import subprocess
import sys

from conftest import ROOT

ORDER = ["EXIT_DUMP", "EXIT_CLOSE", "EXIT_STOP"]


def exit_output(registration: list[str]) -> list[str]:
    code = "from megatron_p2p import _registry\n" + "".join(
        f"_registry.at_exit(_registry.{stage}, lambda: print({stage!r}, flush=True))\n" for stage in registration)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return done.stdout.split()


def test_the_exit_hook_dumps_then_closes_then_stops_whatever_the_registration_order():
    assert exit_output(list(reversed(ORDER))) == ORDER


def test_parts_registered_in_the_stages_order_run_in_it_too():
    assert exit_output(ORDER) == ORDER


def test_the_package_puts_its_closes_and_the_watchdogs_stop_in_their_stages():
    import megatron_p2p  # noqa: F401 - registers the package's parts
    from megatron_p2p import _registry, _watchdog, communicator

    assert communicator._close_live in _registry._at_exit[_registry.EXIT_CLOSE]
    assert _watchdog._THE_WATCHDOG.stop in _registry._at_exit[_registry.EXIT_STOP]
