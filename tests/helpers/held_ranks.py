"""A rank entry point that holds one rank while it loads its shard, as a larger stage or a slower disk would, or stops
it there (SIGSTOP, as a debugger does). Engine pickles its target by reference, so a rank process runs this."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from specdoctor.runtime import rank_loading, worker


def held_rank_main(held_rank: int, hold: float | str, pid_file: str, options, rank: int, *rest) -> None:
    """`worker.rank_main`, with rank `held_rank` held `hold` seconds inside its loading, or stopped there ("stop"); it
    writes its pid to `pid_file` first."""
    if rank == held_rank:
        Path(pid_file).write_text(str(os.getpid()))
        build = rank_loading.build_rank

        def held_build(*args, **kwargs):
            if hold == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                time.sleep(hold)
            return build(*args, **kwargs)

        rank_loading.build_rank = held_build
    worker.rank_main(options, rank, *rest)
