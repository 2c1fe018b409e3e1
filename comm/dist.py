"""Start torch.distributed once: torchrun's environment or the seed's legacy per-rank flags.

NCCL when CUDA is available, gloo otherwise (or on GPUs with ``backend="gloo"``); an explicit timeout;
world size 1 needs no process group. Ranks ``d*P .. d*P + P-1`` form pipeline ``d``. The pipeline links
(:func:`comm.p2p.open_channels`) are made here, before loading, so a rank that dies while loading is
seen by its neighbours.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from comm.local import LocalGroup, LocalWorld
from comm.p2p import PeerLost, open_channels

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    pipeline_size: int
    data_size: int
    device: torch.device
    backend: str | None  # None: single process, no process group; "local": every rank in this process
    channels: tuple = field(default=(), compare=False)  # this rank's comm.p2p.Channel links
    cpu_group: object = field(default=None, compare=False)  # gloo over every rank (the default group on CPU),
    # or with every rank in this process the comm.local.LocalGroup
    local: LocalWorld | None = field(default=None, compare=False)  # the in-memory links of an in-process run
    gpu_sharers: int = 1  # ranks on this rank's GPU (more than one over gloo, --dist-backend gloo, or in process)

    @property
    def stage(self) -> int:
        return self.rank % self.pipeline_size

    @property
    def data_rank(self) -> int:
        return self.rank // self.pipeline_size

    def pipeline_rank(self, stage: int) -> int:
        """Global rank of ``stage`` in this process's pipeline."""
        return self.data_rank * self.pipeline_size + stage

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pipeline_size - 1


def resolve_layout(
    rank: int | None,
    world_size: int | None,
    pipeline_group_size: int | None,
    data_group_size: int,
    env: dict[str, str] | None = None,
) -> tuple[int, int, int, int, int, int]:
    """(rank, world, local_rank, local_world, pipeline, data) from flags or torchrun's env."""
    env = os.environ if env is None else env
    if rank is None:
        rank = int(env.get("RANK", 0))
    if world_size is None:
        world_size = int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", rank))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % data_group_size:
        raise ValueError(
            f"world size {world_size} is not a multiple of --data-group-size {data_group_size}: "
            "launch data x pipeline processes"
        )
    pipeline = pipeline_group_size or world_size // data_group_size
    if pipeline * data_group_size != world_size:
        raise ValueError(
            f"--pipeline-group-size {pipeline} x --data-group-size {data_group_size} = "
            f"{pipeline * data_group_size}, but {world_size} processes were launched: make them equal"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"--rank {rank} is outside 0..{world_size - 1}")
    return rank, world_size, local_rank, local_world, pipeline, data_group_size


def init_distributed(
    rank: int | None = None,
    world_size: int | None = None,
    pipeline_group_size: int | None = None,
    data_group_size: int = 1,
    dist_url: str | None = None,
    cuda_id: int | None = None,
    timeout_s: int = 1800,
    backend: str = "auto",
) -> DistInfo:
    """The one place that starts distributed. Safe to call with nothing set (single process).
    ``backend``: auto (NCCL on GPUs, gloo on CPUs), gloo (also on GPUs: activations through host
    memory, so ranks may share a GPU) or nccl (GPUs required)."""
    rank, world, local_rank, local_world, pipeline, data = resolve_layout(
        rank, world_size, pipeline_group_size, data_group_size
    )
    device, backend = choose_backend(backend, torch.cuda.device_count() if torch.cuda.is_available() else 0,
                                     cuda_id, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world == 1:
        return DistInfo(rank, 1, 0, 1, 1, 1, device, None)

    init_method = dist_url or "env://"
    if init_method == "env://" and "MASTER_ADDR" not in os.environ:
        raise ValueError(
            "no rendezvous: launch with torchrun, or pass --dist-url tcp://HOST:PORT with --rank and --world-size"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    # no device_id: NCCL communicators start lazily, at a link's first payload, so the one-rank-per-GPU
    # check below speaks before NCCL could fail (or hang) on two ranks of one device
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout,
                                                                          group_desc="cpu")
    sharers = 1
    if device.type == "cuda":
        sharers = gpu_sharers(device, cpu_group, refuse=backend == "nccl")
    channels = open_channels(rank, pipeline, data, backend, timeout)
    log.info("process group up: backend=%s rank=%d/%d pipeline=%d data=%d device=%s%s", backend, rank, world, pipeline,
             data, device, f" (shared by {sharers} ranks)" if sharers > 1 else "")
    return DistInfo(rank, world, local_rank, local_world, pipeline, data, device, backend, channels, cpu_group,
                    gpu_sharers=sharers)


def choose_backend(wanted: str, gpus: int, cuda_id: int | None, local_rank: int) -> tuple[torch.device, str]:
    """(this rank's device, the process group's backend) for ``--dist-backend`` ``wanted`` with ``gpus``
    CUDA devices visible (0: none): GPU ``--cuda-id``, else ``LOCAL_RANK`` modulo the GPUs."""
    if wanted not in ("auto", "gloo", "nccl"):
        raise ValueError(f"--dist-backend {wanted}: choose auto, gloo or nccl")
    if not gpus:
        if wanted == "nccl":
            raise ValueError("--dist-backend nccl needs CUDA GPUs and none is visible: use auto or gloo on CPUs")
        return torch.device("cpu"), "gloo"
    device = torch.device("cuda", cuda_id if cuda_id is not None else local_rank % gpus)
    return device, "gloo" if wanted == "gloo" else "nccl"


def local_infos(pipeline: int, data: int = 1) -> list[DistInfo]:
    """Every rank of a ``data`` x ``pipeline`` grid in this process (``--in-process``), joined by one
    :class:`comm.local.LocalWorld`: stage ``s`` on GPU ``s % device_count`` (several stages may share a
    GPU here), else on the CPU."""
    world, gpus = pipeline * data, torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = LocalWorld(world) if world > 1 else None
    return [DistInfo(rank, world, rank, world, pipeline, data,
                     torch.device("cuda", rank % gpus) if gpus else torch.device("cpu"), "local" if local else None,
                     cpu_group=local.group if local else None, local=local,
                     gpu_sharers=len(range(rank % gpus, world, gpus)) if gpus else 1) for rank in range(world)]


def agree_min(value: int, group) -> int:
    """The least ``value`` over the ranks of ``group`` (a collective every rank calls; None: this rank alone)."""
    if group is None:
        return value
    if isinstance(group, LocalGroup):
        return group.agree_min(value)
    mine = torch.tensor([value], dtype=torch.int64)
    try:
        dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=group)
    except RuntimeError as e:
        raise PeerLost(-1, e) from None
    return int(mine)


def gpu_sharers(device: torch.device, cpu_group, refuse: bool) -> int:
    """How many ranks are placed on this rank's GPU (a collective over ``cpu_group``). ``refuse``
    (NCCL): more than one is an error (``LOCAL_RANK % device_count`` would hide it): each would hold a
    full stage, and NCCL does not support two ranks of a communicator on one device."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (socket.gethostname(), device.index), group=cpu_group)
    shared = sharing_a_gpu(everyone, dist.get_rank())
    if shared and refuse:
        raise ValueError(f"ranks {shared} would share GPU {device.index} of {everyone[shared[0]][0]}: launch at most "
                         f"{torch.cuda.device_count()} processes per node (torchrun --nproc-per-node), give each "
                         "legacy rank its own --cuda-id, or make more GPUs visible (CUDA_VISIBLE_DEVICES); "
                         "--dist-backend gloo lets ranks share a GPU (messages through host memory, slower)")
    return max(1, len(shared))


def sharing_a_gpu(placements: list[tuple[str, int]], rank: int) -> list[int]:
    """The ranks placed on ``rank``'s (host, GPU), when more than one is; else []."""
    shared = [r for r, p in enumerate(placements) if p == placements[rank]]
    return shared if len(shared) > 1 else []


def free_port() -> int:
    """A TCP port free on the loopback now (a rendezvous for ranks started from here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown(info: DistInfo | None = None, clean: bool = True) -> None:
    """After a clean run: wait for this device's work, meet every rank on the CPU group (so nobody
    tears down a link a neighbour is still reading the last message from), then destroy the groups.
    After an error only destroy (a dead peer would never reach the barrier)."""
    if (info is not None and info.backend == "local") or not (dist.is_available() and dist.is_initialized()):
        return  # in-process ranks: their links are queues, nothing to tear down
    if clean and info is not None and info.cpu_group is not None:
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)
        try:
            dist.barrier(group=info.cpu_group)
        except RuntimeError as e:  # e.g. another data-parallel pipeline failed and left: our work is done
            log.warning("rank %d: a rank left before the final barrier (%s)", info.rank, str(e).splitlines()[0][:200])
            return
    dist.destroy_process_group()
