"""megatron-core's 1F1B schedule on the CPU, with megatron_p2p's P2PCommunicator over shm:

    torchrun --standalone --nproc-per-node 2 examples/megatron_on_cpu.py

Pure pipeline parallelism: each rank holds one stage; tensor and context parallelism are off, so
their groups in pg_collection hold this rank alone. The last rank prints the losses, and each
rank checks its gradients against the same model run in one process."""
import torch
import torch.distributed as dist
from megatron.core.enums import ModelType
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving
from megatron.core.process_groups_config import ProcessGroupCollection

import megatron_p2p as mp

HIDDEN, MICROBATCHES, SEQ, BATCH = 8, 4, 3, 2


class Stage(torch.nn.Module):
    def __init__(self, index: int, config: ModelParallelConfig):
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
        with torch.no_grad():  # the same weights on every rank, for the check
            gen = torch.Generator().manual_seed(index)
            self.linear.weight.copy_(torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5)
            self.linear.bias.zero_()
        self.config, self.model_type, self.input_tensor = config, ModelType.encoder_or_decoder, None

    def set_input_tensor(self, tensors):  # megatron-core hands a stage its received activation
        self.input_tensor = tensors[0] if isinstance(tensors, list) else tensors

    def forward(self, x):
        return self.linear(torch.tanh(x))


def loss_func(out):
    loss = (out**2).mean()
    return loss, {"loss": loss.detach()}


def main():
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    pp_group = dist.new_group(list(range(pp)))
    alone = [dist.new_group([r]) for r in range(pp)][rank]  # every rank creates every group
    config = ModelParallelConfig(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)
    config.hidden_size = HIDDEN
    model = Stage(rank, config)
    data = [torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(m)) for m in range(MICROBATCHES)]

    def forward_step(data_iterator, stage):
        return stage(next(data_iterator) if rank == 0 else stage.input_tensor), loss_func

    with mp.init_communicator(pp_group) as comm, mp.megatron_on_cpu():
        losses = forward_backward_pipelining_without_interleaving(
            forward_step_func=forward_step, data_iterator=iter(data), model=model,
            num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=BATCH,
            p2p_communicator=mp.P2PCommunicator(pp_group, config, comm=comm),
            pg_collection=ProcessGroupCollection(tp=alone, cp=alone))

    # The check: the whole model in this process, the loss scaled by 1 / microbatches as the schedule does.
    stages = [Stage(i, config) for i in range(pp)]
    for x in data:
        for stage in stages:
            x = stage(x)
        (loss_func(x)[0] / MICROBATCHES).backward()
    same = all(torch.allclose(p.grad, q.grad) for p, q in zip(model.parameters(), stages[rank].parameters()))
    if rank == pp - 1:
        print(f"losses: {[round(float(d['loss']), 6) for d in losses]}", flush=True)  # one write: ranks interleave
    print(f"rank {rank}: gradients equal the one-process run: {same}", flush=True)
    dist.destroy_process_group()
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
