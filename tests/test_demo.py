"""`make demo`: 1F1B pipeline training over the communicator reproduces a single-process run
bit for bit, and says so; when it does not, it says that and fails."""


def test_demo_matches_single_process_training_on_four_ranks(torchrun):
    job = torchrun("demo_job.py", 4, params={"argv": ["--steps", "3"]}, timeout=180)
    job.ok()
    assert "losses match the single-process reference (bitwise) over 3 steps" in job.output
    assert job.output.count("bitwise equal") == 3  # one line per step from the last stage
    assert "p2p statistics per rank" in job.output


def test_demo_batched_mode_with_fewer_microbatches_than_stages(torchrun):
    argv = ["--steps", "2", "--microbatches", "1", "--mode", "batched", "--hidden", "64"]
    job = torchrun("demo_job.py", 2, params={"argv": argv}, timeout=120)
    job.ok()
    assert "losses match the single-process reference (bitwise) over 2 steps" in job.output


def test_demo_fails_when_a_gradient_is_perturbed(torchrun):
    job = torchrun("demo_job.py", 2, params={"argv": ["--steps", "2"], "nudge": 1e-6}, timeout=120)
    assert job.ranks[0] is not None and not job.ranks[0]["ok"]
    assert "exited with status 1" in job.ranks[0]["error"]
    assert "FAILED: the pipeline run does not reproduce the single-process reference" in job.output
    assert "losses match" not in job.output
