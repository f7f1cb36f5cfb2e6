"""Moving data between pipeline ranks over torch.distributed, with timeouts and peer-named errors.

Ranks are laid out as vLLM lays them out: tensor-parallel ranks inner, pipeline stages outer (global rank
= stage * TP + TP rank). Hidden states go from each TP rank to the same TP rank of the next stage."""

from __future__ import annotations

import contextlib
import pickle
import random
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from specdoctor.errors import PipelineError
from specdoctor.runtime import tensor_parallel
from specdoctor.runtime.liveness import Liveness, PeerStuck
from specdoctor.runtime.tensor_parallel import TensorParallel


class PipelineComm:
    """Hidden states go rank to rank point-to-point; the first rank broadcasts commands, the last
    rank broadcasts each step's decision so every rank keeps positions and KV caches in sync."""

    def __init__(self, rank: int, pp: int, tp: int, device: torch.device, timeout_s: float):
        self.rank, self.world_size, self.device = rank, pp * tp, device
        self.stage, self.tp_rank, self.tp = divmod(rank, tp) + (tp,)
        self.seconds = 0.0  # time spent moving data or waiting for a peer, for the step profile
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL's object collectives (gather_tp) use the current device
        if self.world_size > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, rank=rank, world_size=self.world_size, timeout=timedelta(seconds=timeout_s)
            )
        store = dist.distributed_c10d._get_default_store() if self.world_size > 1 else None
        self.liveness = Liveness(store, rank, self.world_size, timeout_s)
        group = None
        for stage in range(pp) if tp > 1 else ():  # every rank creates every group, in the same order
            ranks = list(range(stage * tp, (stage + 1) * tp))
            created = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
            group = created if stage == self.stage else group
        tensor_parallel.use(TensorParallel(self.tp_rank, tp, group))
        self.last = (pp - 1) * tp  # TP rank 0 of the last stage: it speaks for the stage

    def peer(self, stage: int) -> int:
        """The global rank of this TP rank's peer on pipeline stage `stage`."""
        return stage * self.tp + self.tp_rank

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

    def working(self, phase: str):
        """A block of long work (loading, compiling): peers waiting at `wait_for_peers` wait for it."""
        return self.liveness.working(phase)

    def wait_for_peers(self, what: str) -> None:
        """Meet every rank after long work, before the collective that would otherwise time out on a working peer."""
        try:
            self.liveness.wait_for_peers(what)
        except PeerStuck as err:
            raise PipelineError(f"rank {self.rank}: {err}") from None
        except Exception as err:  # the store lives in rank 0's process: stopped or gone, it answers no one
            detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise PipelineError(f"rank {self.rank}: waiting for its peers {what} failed ({detail[:200]})") from None

    def send_next(self, tensor: torch.Tensor) -> None:
        with self._talking_to(self.peer(self.stage + 1), "sending hidden states to"):
            dist.send(tensor.contiguous(), self.peer(self.stage + 1))

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        with self._talking_to(self.peer(self.stage - 1), "receiving hidden states from"):
            dist.recv(buffer, self.peer(self.stage - 1))
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
        """The last stage's tensor (its TP rank 0's), on every rank (others pass a buffer of the right shape;
        the last stage's other TP ranks computed the same, or under sampling their own draw, which this replaces)."""
        if self.world_size > 1:
            self._fan_out(self.last, tensor, "the step decision")
        return tensor

    def gather(self, tensor: torch.Tensor, root_stage: int, what: str) -> torch.Tensor | None:
        """Every stage's `tensor` stacked [stages, ...] on stage `root_stage`, between the ranks of one TP rank;
        None on the others."""
        stages, root = self.world_size // self.tp, self.peer(root_stage)
        if self.rank != root:
            with self._talking_to(root, f"sending {what} to"):
                dist.send(tensor.contiguous(), root)
            return None
        gathered = [tensor if stage == root_stage else torch.empty_like(tensor) for stage in range(stages)]
        for stage in range(stages):
            if stage != root_stage:
                with self._talking_to(self.peer(stage), f"receiving {what} from"):
                    dist.recv(gathered[stage], self.peer(stage))
        return torch.stack(gathered)

    def gather_tp(self, answer: object, what: str) -> list | None:
        """Every TP rank's `answer` of this stage, in TP order, on its TP rank 0; None on the others."""
        if self.tp == 1:
            return [answer]
        gathered = [None] * self.tp if self.tp_rank == 0 else None
        with self._talking_to(self.peer(self.stage) - self.tp_rank, f"gathering {what} with"):
            dist.gather_object(answer, gathered, dst=self.stage * self.tp, group=tensor_parallel.current().group)
        return gathered

    def shared_seed(self) -> int:
        """A random seed the same on every rank (rank 0's), so TP ranks that sample draw alike."""
        seed = torch.tensor([random.getrandbits(62)], device=self.device)
        if self.world_size > 1:
            self._fan_out(0, seed, "the sampling seed")
        return int(seed)

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
