"""Runs `python -m megatron_p2p.demo` on one rank with params["argv"]; a non-zero exit fails the
rank. With params["nudge"], one gradient is scaled by (1 + nudge) on its way upstream, so the
demo's own check against the single-process run must fail."""
import runpy
import sys

import harness


def body(params):
    argv = list(params.get("argv", []))
    code: str | int | None  # main's status, or SystemExit's code
    if params.get("nudge"):
        import megatron_p2p.demo as demo

        original = demo.Stage.send_backward_recv_forward
        scale = 1.0 + params["nudge"]

        def nudged(self, input_grad):
            return original(self, None if input_grad is None else input_grad * scale)

        demo.Stage.send_backward_recv_forward = nudged  # type: ignore[method-assign]  # patched on purpose
        code = demo.main(argv)
    else:
        sys.argv = ["megatron_p2p.demo", *argv]
        try:
            runpy.run_module("megatron_p2p.demo", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code
    if code not in (0, None):
        raise RuntimeError(f"the demo exited with status {code}")


harness.run(body)
