"""Processes started by a launcher (torchrun, or anything that sets its environment): which rank
this process is, how many there are, and where rank 0's store listens. One world is one
tensor-parallel decoder's group: rank 0 serves (the manager, the server), every other rank runs
the plans rank 0 sends it (exec/tensor_launch.py). Plain Python: the CLI reads it before torch."""
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Launch:
    rank: int
    size: int
    local_rank: int  # this host's ranks count from 0: a GPU rank runs on cuda:local_rank
    master_addr: str  # rank 0's host, as the others reach it
    master_port: int
    agent_store: bool  # torchrun's agent already serves the store on master_port: connect, do not bind

    def device(self, kind: str) -> str:
        """This rank's device when rank 0's is of `kind` ("cuda" or "cpu")."""
        return f"cuda:{self.local_rank}" if kind == "cuda" else "cpu"


def launched(environ=os.environ) -> Launch | None:
    """This process's place in a launched world of more than one process, else None."""
    try:
        size = int(environ.get("WORLD_SIZE", "1"))
        if size < 2:
            return None
        return Launch(int(environ["RANK"]), size, int(environ.get("LOCAL_RANK", environ["RANK"])),
                      environ["MASTER_ADDR"], int(environ["MASTER_PORT"]),
                      environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")
    except (KeyError, ValueError) as e:
        raise ValueError(f"WORLD_SIZE={environ.get('WORLD_SIZE')}: a launched world also needs RANK, MASTER_ADDR "
                         f"and MASTER_PORT as integers/addresses ({type(e).__name__}: {e})") from None
