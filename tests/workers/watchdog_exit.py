"""A process that exits while a daemon thread is inside a store call that released the GIL, the
call returning while the interpreter finalizes (a garbage cycle whose finalizer sleeps holds
finalization open). argv[1] is "watchdog" (the call is the watchdog's poll of the abort relay)
or "bare" (the same call on a plain daemon thread: the control, which shows that the window is
reached). Run without torchrun; the caller asserts on the exit status."""
import datetime
import gc
import os
import sys
import threading
import time

import torch.distributed as dist

from megatron_p2p import _watchdog

CALL_SECONDS = 0.5  # the store call in flight at exit
FINALIZER_SECONDS = 1.0  # longer, so the call returns during finalization

store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
entered = threading.Event()


def store_call():
    entered.set()
    try:
        store.wait(["never set"], datetime.timedelta(seconds=CALL_SECONDS))
    except dist.DistError:
        pass


class Comm:
    """What the watchdog reads of a communicator: a live one with nothing pending."""
    closed = False

    def watchdog_check(self):
        return None


class SlowFinalizer:
    self: "SlowFinalizer"  # set below: a reference cycle

    def __del__(self, sleep=time.sleep):
        sleep(FINALIZER_SECONDS)  # releases the GIL, so the daemon thread can try to take it back


class Relay:
    """What the watchdog asks of an abort relay: its poll blocks in a store call."""

    def relayed(self):
        store_call()


comm = Comm()
if sys.argv[1] == "watchdog":
    _watchdog.watch(comm, Relay())  # type: ignore[arg-type]  # stand-ins for a communicator and a relay
else:
    threading.Thread(target=store_call, daemon=True).start()
entered.wait()
gc.disable()  # the cycle is collected by finalization's own collection, not before
cycle = SlowFinalizer()
cycle.self = cycle
del cycle
os.write(1, b"body done\n")
