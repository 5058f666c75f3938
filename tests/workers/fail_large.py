"""One message of 1 GiB + 1 byte (uint8) from rank 0 to rank 1.

The payload tiles random bytes with a prime period (so no offset error repeats it exactly),
with distinctive first and last bytes; both ranks report a SHA-256 of what they hold."""
import hashlib
import time

import harness

PERIOD = 1_000_003  # prime


def body(params):
    import torch

    import megatron_p2p as mp

    nbytes = params["nbytes"]
    comm = mp.init_communicator(timeout=params["timeout"])
    peer = comm.next_rank
    if comm.rank == 0:
        tile = torch.randint(0, 256, (PERIOD,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
        buf = tile.repeat(nbytes // PERIOD + 1)[:nbytes]
        del tile
        buf[0], buf[-1] = 0xAB, 0xCD
        start = time.monotonic()
        comm.isend(buf, peer).wait()
    else:
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        start = time.monotonic()
        comm.irecv(buf, peer).wait()
    elapsed = time.monotonic() - start
    out = {
        "nbytes": buf.nbytes,
        "contiguous": buf.is_contiguous(),
        "sha256": hashlib.sha256(buf.numpy().data).hexdigest(),
        "first": int(buf[0]),
        "last": int(buf[-1]),
        "sample": buf[:: 64 << 20].tolist(),
        "seconds": elapsed,
        "single_copy": comm.single_copy(peer),
    }
    comm.close()
    return out


harness.run(body)
