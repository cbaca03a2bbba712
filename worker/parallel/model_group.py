"""``ModelGroup``: one rank's handle on its parallel worker's ``torch.distributed`` group.

Data moves over NCCL on CUDA and gloo on the CPU: the tensor-parallel all-reduce and
all-gather inside a stage, the residual stream from one stage to the next, the sampled tokens
from the last stage back to the first. Control moves over gloo on the host whatever the
device: rank 0's per-step message to every other rank (one fixed-size buffer to each, sent
without waiting; a second only for a message that does not fit), the last stage's tokens to
rank 0 the same way, and the agreement on the KV cache's size. Each rank's runner is built
over it as the engine's ``RankGroup`` (``tidegate.worker.engine.step_runner``).
"""

from __future__ import annotations

import datetime
import os
import pickle
from typing import Any

import torch
import torch.distributed as dist

from tidegate.worker.engine.sampler import SamplerOutput
from tidegate.worker.parallel.layout import RankPlace

# NVLink multicast stays off in every rank (the device README: it can take a shared host's
# GPUs out of service); an operator's own setting is kept.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}

# Bytes of the control broadcast: a decode step of hundreds of sequences fits, a long prompt
# chunk takes a second broadcast.
MESSAGE_BYTES = 64 * 1024
_HEADER = 8
IDLE_FOREVER = datetime.timedelta(days=365)


def is_peer_lost(exc: BaseException) -> bool:
    """Whether a collective failed because another rank's process is gone."""
    text = str(exc)
    return any(s in text for s in ("closed by peer", "Connection reset", "Broken pipe",
                                   "NCCL communicator was aborted", "remote process exited"))


def multicast_off() -> None:
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)


class ModelGroup:
    def __init__(self, place: RankPlace, device: torch.device, init_method: str,
                 timeout_s: float = 600.0) -> None:
        """Join the group (every rank calls this; it returns once all have)."""
        multicast_off()
        self.place = place
        self.device = device
        layout = place.layout
        backend = "nccl" if device.type == "cuda" else "gloo"
        # gloo waits carry no deadline: the other ranks wait for rank 0's next step however
        # long the worker idles, and a rank that dies is noticed by the processes watching it
        # (``rank_processes``), not by a timeout. NCCL's watchdog bounds a collective in
        # flight (``timeout_s``).
        timeout = datetime.timedelta(seconds=timeout_s) if backend == "nccl" else IDLE_FOREVER
        dist.init_process_group(backend, init_method=init_method, rank=place.rank,
                                world_size=layout.world, timeout=timeout)
        # Every rank creates every group, in the same order (new_group is collective).
        self._tp_group: Any = None
        for stage in range(layout.pp):
            group = dist.new_group(place.stage_ranks(stage), backend=backend)
            if stage == place.pp_rank:
                self._tp_group = group
        self._control: Any = (dist.new_group(backend="gloo", timeout=IDLE_FOREVER)
                              if backend != "gloo" else dist.group.WORLD)
        self._buffer = torch.empty(MESSAGE_BYTES, dtype=torch.uint8)
        self._sending: tuple[Any, torch.Tensor] | None = None  # the last stream sent on
        self._posted: list[tuple[Any, torch.Tensor]] = []  # control messages under way

    # ------------------------------------------------------------------ place

    @property
    def rank(self) -> int:
        return self.place.rank

    @property
    def tp_rank(self) -> int:
        return self.place.tp_rank

    @property
    def tp(self) -> int:
        return self.place.layout.tp

    @property
    def pp(self) -> int:
        return self.place.layout.pp

    # ------------------------------------------------------------------ tensor parallel

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the stage's shards, in place."""
        if self.tp > 1:
            dist.all_reduce(x, group=self._tp_group)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] on each shard -> [N, tp * C] (shard order)."""
        if self.tp == 1:
            return x
        x = x.contiguous()
        if self.device.type == "cuda":
            out = torch.empty((self.tp, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self._tp_group)
            parts = list(out.unbind(0))
        else:
            parts = [torch.empty_like(x) for _ in range(self.tp)]
            dist.all_gather(parts, x, group=self._tp_group)
        return torch.cat(parts, dim=1)

    # ------------------------------------------------------------------ pipeline

    def send_next(self, x: torch.Tensor) -> None:
        """The residual stream to the next stage's rank of the same shard. Asynchronous: the
        stage goes on with the next step while the next stage is busy; the tensor is kept
        until the send completes (waited for before the following send)."""
        if self._sending is not None:
            self._sending[0].wait()
        x = x.contiguous()
        self._sending = (dist.isend(x, self.rank + self.tp), x)

    def recv_previous(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(x, self.rank - self.tp)
        return x

    @property
    def sends_tokens(self) -> bool:
        return self.place.last_stage and self.tp_rank == 0

    @property
    def receives_tokens(self) -> bool:
        return self.rank == 0

    def send_tokens(self, out: SamplerOutput) -> None:
        """The last stage's sampled tokens (and logprobs) to rank 0, over the host."""
        self._post(out, [0])

    def recv_tokens(self) -> SamplerOutput:
        out = self._take(self.place.layout.world - self.tp)
        assert isinstance(out, SamplerOutput)
        return out

    # ------------------------------------------------------------------ control

    def broadcast(self, message: object | None = None) -> Any:
        """Rank 0 sends ``message`` to every rank; the others get it back (in order)."""
        if self.rank == 0:
            self._post(message, range(1, self.place.layout.world))
            return message
        return self._take(0)

    def _post(self, message: object, to: range | list[int]) -> None:
        """Send ``message`` to ranks ``to`` without waiting for them to take it: a rank
        that is busy (a later stage still on the step before) does not hold the sender up.
        One fixed-size buffer each (its header the message's length), a second one only for
        what does not fit."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        head = min(len(data), MESSAGE_BYTES - _HEADER)
        buf = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        buf[:_HEADER] = torch.tensor(list(len(data).to_bytes(_HEADER, "little")),
                                     dtype=torch.uint8)
        if head:
            buf[_HEADER : _HEADER + head] = torch.frombuffer(bytearray(data[:head]),
                                                             dtype=torch.uint8)
        parts = [buf]
        if len(data) > head:
            parts.append(torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8))
        # Sends still under way keep their buffers alive; finished ones are dropped.
        self._posted = [(w, t) for w, t in self._posted if not w.is_completed()]
        for dst in to:
            for part in parts:
                self._posted.append((dist.isend(part, dst, group=self._control), part))

    def _take(self, src: int) -> Any:
        buf = self._buffer
        dist.recv(buf, src, group=self._control)
        size = int.from_bytes(bytes(buf[:_HEADER].tolist()), "little")
        head = min(size, MESSAGE_BYTES - _HEADER)
        data = buf[_HEADER : _HEADER + head].numpy().tobytes()
        if size > head:
            rest = torch.empty(size - head, dtype=torch.uint8)
            dist.recv(rest, src, group=self._control)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (the KV cache all ranks can hold)."""
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._control)
        return int(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
