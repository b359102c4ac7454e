"""Which blocks a rank reads: the deal.

The training arrays are cut into blocks of block_windows windows of seq_len + 1 tokens (one contiguous read each;
windows never straddle blocks). Every epoch the blocks are shuffled with a generator seeded by (seed, epoch) and
dealt round-robin to the ranks, the remainder dropped: ranks never share a window and no window repeats within an
epoch. A rank whose share is used up starts the next epoch (a new shuffle) instead of stopping.
Staged data (a folder holding STAGED_MANIFEST, written by stage.py): the rest of each file was never copied and reads
as zeros, so the rank reads only the blocks staged for it: epoch 0 is exactly the start of its usual deal; later
epochs repeat those blocks reshuffled, with one warning. A manifest made for another run (shape, world, seed, ranks,
file lengths) is a ValueError. numpy + stdlib only.
"""

import dataclasses
import itertools
import json
import pathlib
import sys

import numpy as np

# Windows per loader block: 131 KB per read at seq_len 1024, ~9 reads/s per rank at the event's ~600K tokens/s, a
# load NFS serves easily; the prefetch, not the read size, is what rides out a slow read.
BLOCK_WINDOWS = 64
STAGED_MANIFEST = "staged.json"  # written by stage.py beside the token files it staged


@dataclasses.dataclass(frozen=True)
class Deal:
    """One rank's seat at the deal: its rank of world_size, the shuffle's seed, the block size in windows."""

    rank: int
    world_size: int
    seed: int = 0
    block_windows: int = BLOCK_WINDOWS

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}.")


def block_layout(lengths, seq_len, block_windows=BLOCK_WINDOWS):
    """(array index, start, end) of every loader block over arrays of these lengths: block_windows windows of
    seq_len + 1 tokens (fewer at an array's end), in the order the deal shuffles."""
    window, block = seq_len + 1, block_windows * (seq_len + 1)
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = [np.arange(0, max(n - window + 1, 0), block, dtype=np.int64) for n in lengths]
    index = np.repeat(np.arange(len(lengths)), [len(s) for s in starts])
    start = np.concatenate(starts)
    return index, start, np.minimum(start + block, lengths[index])


def deal_blocks(n_blocks, rank, world_size, seed, epoch):
    """The blocks rank reads in epoch: all n_blocks shuffled with a generator seeded by (seed, epoch) and dealt
    round-robin, the remainder dropped."""
    order = np.random.default_rng([seed, epoch]).permutation(n_blocks)
    per_rank = n_blocks // world_size
    return order[: per_rank * world_size].reshape(per_rank, world_size)[:, rank]


def staged_blocks(n_blocks, rank, world_size, seed, count):
    """The first count blocks dealt to rank, over as many epochs as that takes: what stage.py copies for it."""
    dealt: list[np.ndarray] = []
    epochs = itertools.count()
    while sum(map(len, dealt)) < count:
        dealt.append(deal_blocks(n_blocks, rank, world_size, seed, next(epochs)))
    return np.concatenate(dealt)[:count]


class Shards:
    """The blocks one rank reads over arrays of these lengths (a list of ints), epoch after epoch; folder: where the
    arrays' files are, when they map files, to find a staged folder's manifest."""

    def __init__(self, lengths, seq_len, deal, folder=None):
        self.deal = deal
        self.index, self.start, self.end = block_layout(lengths, seq_len, deal.block_windows)
        if len(self.start) < deal.world_size:
            raise ValueError(
                f"the training data holds {len(self.start)} blocks of up to {deal.block_windows * (seq_len + 1)} "
                f"tokens, fewer than the {deal.world_size} ranks."
            )
        self.staged = None if folder is None else self._staged_share(pathlib.Path(folder), lengths, seq_len)

    def _staged_share(self, folder, lengths, seq_len):
        """This rank's staged blocks when folder holds a STAGED_MANIFEST made for this run, else None."""
        path, deal = folder / STAGED_MANIFEST, self.deal
        if not path.is_file():
            return None
        staged = json.loads(path.read_text())
        run = {
            "seq_len": seq_len,
            "block_windows": deal.block_windows,
            "world_size": deal.world_size,
            "seed": deal.seed,
            "lengths": lengths,
        }
        if differ := [key for key, value in run.items() if staged[key] != value]:
            raise ValueError(
                f"{path} was staged for another run: its {', '.join(differ)} differ from this run's; stage again "
                f"with this run's flags and world size (--val_tokens sets the last file's length), or read the full "
                f"data folder."
            )
        if deal.rank not in staged["ranks"]:
            raise ValueError(
                f"{path} holds the blocks of ranks {staged['ranks']}, but torchrun made this process rank "
                f"{deal.rank} (stage.py orders the nodes by name, as torchrun's c10d rendezvous does); read the "
                f"full data folder."
            )
        return staged_blocks(len(self.start), deal.rank, deal.world_size, deal.seed, staged["blocks_per_rank"])

    def blocks(self, epoch):
        """The blocks this rank reads in epoch, in order."""
        deal = self.deal
        if self.staged is None:
            return deal_blocks(len(self.start), deal.rank, deal.world_size, deal.seed, epoch)
        if epoch == 0:
            return self.staged
        if epoch == 1:  # once per loader
            print(
                f"warning: rank {deal.rank} has read all {len(self.staged)} blocks staged for it (the run outgrew "
                f"the staging budget); it reads them again, reshuffled (said once).",
                file=sys.stderr,
                flush=True,
            )
        return np.random.default_rng([deal.seed, epoch]).permutation(self.staged)

    def ranges(self, epoch):
        """(array index, start, end) token ranges of the blocks this rank reads in epoch, in order."""
        for block in self.blocks(epoch):
            yield int(self.index[block]), int(self.start[block]), int(self.end[block])
