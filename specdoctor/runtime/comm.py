"""Moving data between pipeline ranks over torch.distributed, with timeouts and peer-named errors."""

from __future__ import annotations

import contextlib
import pickle
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from specdoctor.errors import SpecdoctorError


class PipelineError(SpecdoctorError):
    """A pipeline rank died, hung past the timeout, or failed."""


class PipelineComm:
    """Hidden states go rank to rank point-to-point; the first rank broadcasts commands, the last
    rank broadcasts each step's decision so every rank keeps positions and KV caches in sync."""

    def __init__(self, rank: int, world_size: int, device: torch.device, timeout_s: float):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.seconds = 0.0  # time spent moving data or waiting for a peer, for the step profile
        if world_size > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))

    @contextlib.contextmanager
    def _talking_to(self, peer: int, what: str):
        start = time.perf_counter()
        try:
            yield
        except Exception as err:  # gloo and NCCL raise several types; the peer is what matters
            detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise PipelineError(f"rank {self.rank}: {what} rank {peer} failed ({detail[:200]})") from None
        finally:
            self.seconds += time.perf_counter() - start

    def send_next(self, tensor: torch.Tensor) -> None:
        with self._talking_to(self.rank + 1, "sending hidden states to"):
            dist.send(tensor.contiguous(), self.rank + 1)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        with self._talking_to(self.rank - 1, "receiving hidden states from"):
            dist.recv(buffer, self.rank - 1)
        return buffer

    def _fan_out(self, source: int, tensor: torch.Tensor, what: str) -> None:
        """Send `tensor` from `source` to every other rank one by one, so a failure names its peer
        (a collective broadcast cannot say which receiver stalled)."""
        if self.rank == source:
            for peer in range(self.world_size):
                if peer != source:
                    with self._talking_to(peer, f"sending {what} to"):
                        dist.send(tensor, peer)
        else:
            with self._talking_to(source, f"waiting for {what} from"):
                dist.recv(tensor, source)

    def broadcast_from_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last rank's tensor, on every rank (others pass a buffer of the right shape)."""
        if self.world_size > 1:
            self._fan_out(self.world_size - 1, tensor, "the step decision")
        return tensor

    def gather(self, tensor: torch.Tensor, root: int, what: str) -> torch.Tensor | None:
        """Every rank's `tensor` stacked [world_size, ...] on `root`; None on the others."""
        if self.rank != root:
            with self._talking_to(root, f"sending {what} to"):
                dist.send(tensor.contiguous(), root)
            return None
        gathered = [tensor if peer == root else torch.empty_like(tensor) for peer in range(self.world_size)]
        for peer in range(self.world_size):
            if peer != root:
                with self._talking_to(peer, f"receiving {what} from"):
                    dist.recv(gathered[peer], peer)
        return torch.stack(gathered)

    def broadcast_command(self, command: object = None) -> object:
        """The first rank's command object, on every rank."""
        if self.world_size == 1:
            return command
        size = torch.zeros(1, dtype=torch.long, device=self.device)
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(command)), dtype=torch.uint8).to(self.device)
            size[0] = data.numel()
        self._fan_out(0, size, "a command")
        if self.rank != 0:
            data = torch.empty(int(size), dtype=torch.uint8, device=self.device)
        self._fan_out(0, data, "a command")
        return command if self.rank == 0 else pickle.loads(data.cpu().numpy().tobytes())

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
