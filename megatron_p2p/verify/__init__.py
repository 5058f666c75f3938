"""The verification tools, apart from the runtime: the program format (program), the simulator and
checker (simulate, check), the schedule generators (schedules, torch_schedules,
megatron_recording), replay on a real backend (replay), and the post-mortem analyser of flight
recorder dumps with its timelines (trace, timeline). `import megatron_p2p` loads none of them; the
runtime's NCCL stall analysis imports trace once a stall is analysed.

    python -m megatron_p2p.verify.check FILE...     (or python -m megatron_p2p.check, as before)
"""
