"""Runs `python -m megatron_p2p.replay --json FILE...` inside the test harness; params: files,
timeout. Rank 0 prints one verdict per file on standard output."""
import harness


def body(params):
    from megatron_p2p import replay

    return replay.main(["--json", "--timeout", str(params["timeout"]), *params["files"]])


harness.run(body)
