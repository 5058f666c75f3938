"""A rank that never finishes: the harness must kill it and show where it was."""
import time

import harness


def sleep_forever():
    while True:
        time.sleep(0.1)


harness.run(lambda params: sleep_forever())
