"""Stage-to-stage transport of hidden states: a `StageChannel` per link between consecutive stages.

`InProcChannel` hands tensors over in memory (every stage in one process); `TorchP2PChannel` sends them
over torch.distributed point-to-point (gloo on CPU, NCCL on GPU). Hidden states never travel through
the Ray object store or the control plane.
"""

from ppserve.comm.channel import InProcChannel, StageChannel
from ppserve.comm.p2p import TorchP2PChannel

__all__ = ["InProcChannel", "StageChannel", "TorchP2PChannel"]
