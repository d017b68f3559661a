"""Data-parallel training over NCCL: the launcher's environment, the communicator, and the ZeRO-1
arithmetic (which rank owns which slice of the flat parameter buffer). One process per GPU,
started by a standard launcher; ``andrea train`` finds out from the environment that it is one of N:

    torchrun --standalone --nproc_per_node=4 -m andrea train ...   # RANK, WORLD_SIZE, LOCAL_RANK
    mpirun -np 4 andrea train ...                                  # OMPI_COMM_WORLD_* (mpi4py shares the id)
    srun --ntasks=4 --gpus-per-task=1 andrea train ...             # SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID

    from andrea import dist
    launch = dist.launch_env()               # None: no launcher (the plain single-process path)
    comm = dist.NcclComm.create(launch, rendezvous=Path("runs/x/main"))    # CuPy's cupy.cuda.nccl
    off, n_mine = dist.shard_range(n, comm.size, comm.rank)

What a step does at world size N (andrea/cuda/engine.py ``GpuEngine`` with a comm, andrea/train.py):
  * the curriculum is one curriculum: every rank runs the same seeded one and draws the whole
    microbatch of ``train.batch_size`` rows, keeping rows [r B/N, (r+1) B/N) (``rank_rows``); each
    microbatch's loss is the mean of the ranks' losses in rank order (``global_mean``, all ranks get
    the same float), which every rank's curriculum observes, so the bandit's choices, pulls, rewards
    and coverage are the same on every rank and account for the whole batch. A run at N ranks draws
    the very windows a 1-rank run of the same config draws (``bandit.policy: uniform`` always;
    ``ucb1`` while its choices, from losses that differ only in rounding, agree);
  * ZeRO-1 (``zero1_update``): the fp32 gradients are reduce-scattered (sum, NCCL) over N equal
    shards of the flat buffer padded to ``N * shard_size(n, N)``; each rank owns one shard's m and v
    (optimizer memory per GPU 8 n / N bytes), takes the global gradient norm from every shard's
    partial sums of squares gathered in rank order (so every rank clips by the same float), runs
    AdamW on its shard, and the fp32 weights are all-gathered;
  * held-out loss: each rank scores its share of every eval batch's rows (``rank_share``), the
    sums and token counts added in rank order (``sum_over_ranks``);
  * SIGTERM / SIGUSR1 to any rank: ``agree_flags`` after every step makes it every rank's signal,
    so the job checkpoints once; rank 0 writes the checkpoint (m and v gathered, the seeds' format).

Determinism: a run is a pure function of the config and the world size N (the collectives are
NCCL's ring for a fixed N, ranks and topology; the sums here are in rank order). N = 1 through this
path is byte-identical to the plain engine (tests/test_dist_gpu.py); other N differ from it in the
gradient sum's rounding only, so a resume at another world size is sound but not bit-exact.

Environment kept for every rank: NCCL_NVLS_ENABLE=0 (NVLink multicast off), and on one host
NCCL_SOCKET_IFNAME=lo (the bootstrap binds loopback) unless the caller set them. Tests:
``pytest tests/test_dist.py`` (CPU: the arithmetic, ZeRO-1 against the unsharded update, the bandit
across ranks), ``pytest tests/test_dist_train.py`` (CPU: N trainers in one process: rank 0 writes,
signals, resume), ``pytest -m gpu tests/test_dist_gpu.py``; bench/multi_gpu.py for N = 2, 4, 8.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from andrea.errors import AndreaError, ConfigError

SHARD_ALIGN = 64          # elements: every shard starts 256-byte aligned (float32)
RENDEZVOUS_TIMEOUT_S = 300.0  # how long a rank waits for rank 0's NCCL id (ANDREA_NCCL_TIMEOUT overrides)


@dataclass(frozen=True)
class Launch:
    """This process's place in the job, as the launcher put it in the environment."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    launcher: str          # "torchrun" | "mpi" | "slurm"
    key: str               # names this job's rendezvous file (a stale file of another job never matches)


def _int(env, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"environment {name}={env[name]!r}: expected an integer (set by the launcher)") from None


def launch_env(env=None) -> Launch | None:
    """The launcher's view of this process, or None for a plain single process. Read in this order:
    torchrun's RANK/WORLD_SIZE/LOCAL_RANK (any world size, 1 included: that is how one rank runs
    through the NCCL path), Open MPI's OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK, SLURM's
    SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID (only with more than one task: every batch job has them)."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" in env and "RANK" in env:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        lw = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
        key = env.get("TORCHELASTIC_RUN_ID") or f"{env.get('MASTER_ADDR', 'local')}-{env.get('MASTER_PORT', '0')}"
        out = Launch(rank, world, local, lw, "torchrun", key)
    elif "OMPI_COMM_WORLD_SIZE" in env and "OMPI_COMM_WORLD_RANK" in env:
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env else rank
        lw = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") if "OMPI_COMM_WORLD_LOCAL_SIZE" in env else world
        out = Launch(rank, world, local, lw, "mpi", env.get("OMPI_MCA_orte_jobfam_session_dir", "mpi").replace("/", "_"))
    elif "SLURM_NTASKS" in env and "SLURM_PROCID" in env and _int(env, "SLURM_NTASKS") > 1:
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        lw = int(per_node) if per_node.isdigit() else world
        out = Launch(rank, world, local, lw, "slurm", f"{env.get('SLURM_JOB_ID', '0')}.{env.get('SLURM_STEP_ID', '0')}")
    else:
        return None
    if world < 1 or not 0 <= out.rank < world or not 0 <= out.local_rank:
        raise ConfigError(f"launcher environment ({out.launcher}): rank {out.rank} of world size {world} is not a "
                          "valid place in the job")
    return out


def check_world(gpus: int, launch: Launch | None) -> int:
    """The world size this run trains at: the launcher's, which must be ``train.gpus``."""
    world = 1 if launch is None else launch.world
    if world != gpus:
        how = "no launcher (one process)" if launch is None else f"the {launch.launcher} launcher started {world}"
        raise ConfigError(f"train.gpus={gpus} but {how}: start one process per GPU with e.g. "
                          f"`torchrun --standalone --nproc_per_node={gpus} -m andrea train ...`, or set train.gpus={world}")
    return world


# ----------------------------------------------------------------------------- shard arithmetic
def shard_size(n: int, world: int) -> int:
    """Elements of one rank's shard of a flat buffer of ``n``: n itself for one rank, else
    ceil(n / world) rounded up to SHARD_ALIGN. The padded buffer is ``world * shard_size``."""
    if world == 1:
        return int(n)
    per = -(-int(n) // int(world))
    return -(-per // SHARD_ALIGN) * SHARD_ALIGN


def shard_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """(offset, valid length) of rank ``rank``'s shard of the n real elements; the shard's tail past
    n (the last ranks') is padding, zero in every buffer and never updated."""
    s = shard_size(n, world)
    off = int(rank) * s
    return off, max(0, min(s, int(n) - off))


def decay_in_shard(n_decay: int, off: int, length: int) -> int:
    """Weight decay covers the prefix [0, n_decay) of the flat layout; the part of it inside the
    shard [off, off + length), as a prefix length of the shard."""
    return max(0, min(int(length), int(n_decay) - int(off)))


def rank_rows(a: np.ndarray, rank: int, world: int) -> np.ndarray:
    """This rank's rows of a microbatch of the whole batch: [rank b, (rank + 1) b), b = rows / world."""
    b = a.shape[0] // world
    return a[rank * b:(rank + 1) * b]


def rank_share(a: np.ndarray, rank: int, world: int) -> np.ndarray:
    """This rank's share of rows that need not split evenly (a held-out batch, the last one short):
    [rank b // world, (rank + 1) b // world); a rank's share may be empty."""
    b = a.shape[0]
    return a[rank * b // world:(rank + 1) * b // world]


def sum_over_ranks(comm, values) -> list[float]:
    """The ranks' host values summed element-wise in rank order (float64): the same list on every rank."""
    rows = comm.all_gather_host(np.asarray(values, dtype=np.float64))
    total = np.zeros(rows.shape[1], dtype=np.float64)
    for row in rows:
        total += row
    return [float(t) for t in total]


def local_batch(batch_size: int, world: int) -> int:
    """Rows per rank of a ``train.batch_size`` microbatch; refused when it does not split evenly."""
    if batch_size % world:
        raise ConfigError(f"train.batch_size={batch_size} does not split over {world} GPUs: it is the whole "
                          f"microbatch of every step, so it must be a multiple of the world size")
    return batch_size // world


def global_mean(values) -> float:
    """The mean of the ranks' values, summed in rank order in float64 (the same float on every rank)."""
    vals = [float(v) for v in values]
    return sum(vals) / len(vals)              # sum() adds left to right: rank order; one value is itself


def agree_flags(comm, flags: list[int]) -> list[int]:
    """Every rank's flags or-ed together (an all-reduce max): a signal one rank caught is everybody's."""
    if comm is None or comm.size == 1:
        return list(flags)
    return [int(x) for x in comm.allreduce_max(np.asarray(flags, dtype=np.int32))]


def zero1_update(comm, k, n: int, n_decay: int) -> None:
    """One ZeRO-1 optimizer step over the flat buffers of ``k`` (the engine's kernels: the GPU engine's
    in andrea/cuda/engine.py, NumPy twins in tests/test_dist.py):
      k.g, k.w   the padded flat gradient (each rank's local sum) and weights, world * shard_size(n);
      k.m, k.v   this rank's shards of the moments, shard_size(n);
      k.part     this rank's partial sums of squares, k.part_all every rank's, in rank order;
      k.sumsq(g_shard, length) -> fills k.part;  k.finish() -> global norm / clip / ok from k.part_all;
      k.adamw(w_shard, g_shard, length, n_decay_in_shard);  k.refresh() -> the compute copy of w.
    After it every rank holds the same updated w; its m and v shards are its own."""
    off, length = shard_range(n, comm.size, comm.rank)
    s = shard_size(n, comm.size)
    g_mine, w_mine = k.g[off:off + s], k.w[off:off + s]
    comm.reduce_scatter(k.g, g_mine)                  # in place: the rank's slice holds the sum over ranks
    k.sumsq(g_mine, length)
    comm.all_gather(k.part, k.part_all)
    k.finish()
    k.adamw(w_mine, g_mine, length, decay_in_shard(n_decay, off, length))
    comm.all_gather(w_mine, k.w)                      # in place
    k.refresh()


# ----------------------------------------------------------------------------- NCCL
def nccl_env(launch: Launch, env=None) -> None:
    """The NCCL settings every rank starts with (unless the caller set them)."""
    env = os.environ if env is None else env
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    if launch.local_world == launch.world:           # one host: the bootstrap binds loopback
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")


def device_of(launch: Launch, n_visible: int) -> int:
    """This rank's GPU: its local rank among the visible devices, or the one device a launcher that
    binds a GPU per task (srun --gpus-per-task=1: CUDA_VISIBLE_DEVICES of one) left visible."""
    if n_visible == 1:
        return 0
    if not 0 <= launch.local_rank < n_visible:
        raise AndreaError(f"rank {launch.rank}: local rank {launch.local_rank} but this process sees {n_visible} "
                          "GPU(s): start at most one process per GPU")
    return launch.local_rank


def rendezvous_path(folder: Path, launch: Launch) -> Path:
    folder = Path(folder)
    return folder.parent / f".{folder.name}.nccl-{''.join(c if c.isalnum() or c in '-_.' else '_' for c in launch.key)}"


def _share_id(launch: Launch, uid, path: Path):
    """Rank 0's NCCL unique id to every rank: through mpi4py when MPI launched us and it imports,
    else through a file beside the run folder (written atomically by rank 0, read by the others)."""
    if launch.launcher == "mpi":
        try:
            from mpi4py import MPI  # noqa: PLC0415
        except ImportError:
            MPI = None
        if MPI is not None:
            return MPI.COMM_WORLD.bcast(uid, root=0)
    from andrea.fsutil import atomic_write_text  # noqa: PLC0415

    if launch.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(list(uid)))
        return uid
    try:
        timeout = float(os.environ.get("ANDREA_NCCL_TIMEOUT", RENDEZVOUS_TIMEOUT_S))
    except ValueError:
        raise ConfigError(f"environment ANDREA_NCCL_TIMEOUT={os.environ['ANDREA_NCCL_TIMEOUT']!r}: expected "
                          "seconds") from None
    t0 = time.monotonic()
    while True:
        try:
            return tuple(json.loads(path.read_text(encoding="utf-8")))
        except (FileNotFoundError, ValueError):
            if time.monotonic() - t0 > timeout:
                raise AndreaError(f"{path}: rank 0's NCCL id did not appear within {timeout:.0f} s "
                                  "(is rank 0 running, with the same --out? ANDREA_NCCL_TIMEOUT sets the wait)") from None
            time.sleep(0.05)


class NcclComm:
    """The collectives a step needs, over CuPy's NCCL bindings (``cupy.cuda.nccl``), on the current
    CUDA stream; float32 device arrays. ``size == 1`` still goes through NCCL."""

    def __init__(self, nccl_comm, rank: int, size: int, launch: Launch | None = None):
        import cupy  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415

        self.cp, self.nccl, self.comm, self.rank, self.size, self.launch = cupy, nccl, nccl_comm, rank, size, launch
        self._flags = cupy.zeros(64, dtype=np.int32)

    @classmethod
    def create(cls, launch: Launch, rendezvous: Path) -> "NcclComm":
        """Pick this rank's GPU (LOCAL_RANK), agree on rank 0's unique id, make the communicator."""
        nccl_env(launch)
        try:
            import cupy  # noqa: PLC0415
            from cupy.cuda import nccl  # noqa: PLC0415
        except ImportError as e:
            raise AndreaError(f"train.gpus={launch.world}: CuPy with NCCL is needed ({e})") from None
        if not getattr(nccl, "available", False):
            raise AndreaError(f"train.gpus={launch.world}: CuPy was built without NCCL (cupy.cuda.nccl.available "
                              "is False; install nvidia-nccl for the CuPy's CUDA)")
        cupy.cuda.Device(device_of(launch, cupy.cuda.runtime.getDeviceCount())).use()
        path = rendezvous_path(rendezvous, launch)
        uid = _share_id(launch, nccl.get_unique_id() if launch.rank == 0 else None, path)
        comm = cls(nccl.NcclCommunicator(launch.world, uid, launch.rank), launch.rank, launch.world, launch)
        comm.barrier()                                   # every rank has read the id
        if launch.rank == 0:
            path.unlink(missing_ok=True)
        return comm

    def _stream(self) -> int:
        return self.cp.cuda.get_current_stream().ptr

    def reduce_scatter(self, full, shard) -> None:
        """shard (size,) = the sum over ranks of full[rank * size:(rank + 1) * size]; shard may be that slice."""
        self.comm.reduceScatter(full.data.ptr, shard.data.ptr, shard.size, self.nccl.NCCL_FLOAT32,
                                self.nccl.NCCL_SUM, self._stream())

    def all_gather(self, shard, full) -> None:
        """full = every rank's shard in rank order; shard may be this rank's slice of full."""
        self.comm.allGather(shard.data.ptr, full.data.ptr, shard.size, self.nccl.NCCL_FLOAT32, self._stream())

    def allreduce_max(self, host: np.ndarray) -> np.ndarray:
        buf = self._flags[:host.size]
        buf.set(host.astype(np.int32))
        self.comm.allReduce(buf.data.ptr, buf.data.ptr, host.size, self.nccl.NCCL_INT32, self.nccl.NCCL_MAX,
                            self._stream())
        return buf.get()

    def all_gather_host(self, host: np.ndarray) -> np.ndarray:
        """(size, k) float64: every rank's k host values, in rank order."""
        src = self.cp.asarray(np.ascontiguousarray(host, dtype=np.float64).reshape(-1))
        dst = self.cp.empty(self.size * src.size, dtype=np.float64)
        self.comm.allGather(src.data.ptr, dst.data.ptr, src.size, self.nccl.NCCL_FLOAT64, self._stream())
        return dst.get().reshape(self.size, src.size)

    def barrier(self) -> None:
        self.allreduce_max(np.zeros(1, dtype=np.int32))
