"""Stage to node-local disk only what this node's ranks can read, so the wall is not spent copying the whole data
folder (at the event 49 files x 2 GB = 98 GB per node; the arithmetic is in README, "SLURM and several nodes").

BatchLoader deals shuffled blocks of shards.BLOCK_WINDOWS windows round-robin to the ranks, so each rank reads blocks
scattered over every file. For a token budget (the run plan's tokens x --margin) this writes files of the same names
and sizes (sparse: what is not staged is never written) holding, at their own offsets:
- the blocks dealt first to each of this node's ranks, budget / world_size tokens' worth each (shards.staged_blocks);
- the validation range, the last --val_tokens of the last file (unless --val_file names another file);
- the slices the start-up check samples (data.sample_slices), so the staged folder passes the same check;
and then shards.STAGED_MANIFEST, from which BatchLoader deals only these blocks (and repeats them, with a warning, if
the run outgrows the budget): an unstaged range, which would read as zeros, is never read.

This node's ranks: torchrun's c10d rendezvous numbers the nodes in the sorted order of their socket.getfqdn() names,
each node's ranks following on; --nodes lists every node's name. Staged for other ranks, the run stops before its
clock with one message, never silently.

    python stage.py SRC DST --plan "$(python train.py --dry_run ... | tail -n 1)" --nodes a,b --nproc 8 -- FLAGS
"""

import argparse
import concurrent.futures
import json
import math
import os
import pathlib
import socket
import sys
import time

from data import find_token_files, sample_slices
from shards import BLOCK_WINDOWS, STAGED_MANIFEST, block_layout, staged_blocks
from train import parse_args

COPY_BYTES = 1 << 26  # one read and write at most; ranges are block-sized (131 KB at the event) or merged ones


def merged(ranges):
    """Sorted (start, end) ranges with overlapping and touching ones joined."""
    out = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def copy_ranges(src, dst, ranges):
    """dst: a file of src's size holding src's bytes in the token ranges, the rest a hole. Returns bytes copied."""
    copied = 0
    with open(src, "rb") as source, open(dst, "wb") as target:
        target.truncate(os.fstat(source.fileno()).st_size)
        for start, end in merged(ranges):
            for offset in range(2 * start, 2 * end, COPY_BYTES):
                size = min(COPY_BYTES, 2 * end - offset)
                chunk = os.pread(source.fileno(), size, offset)
                if len(chunk) != size:
                    raise ValueError(f"{src} ended at byte {offset + len(chunk):,}: it shrank while being staged.")
                os.pwrite(target.fileno(), chunk, offset)
                copied += size
    return copied


def stage(src, dst, tokens, world_size, margin, nodes, nproc, hp, workers=8):
    """Copy this node's share of src into dst and write the manifest; returns one line for the log."""
    me = socket.getfqdn()
    if len(set(nodes)) != len(nodes) or me not in nodes:
        raise ValueError(f"this node is {me!r}; the job's nodes are {nodes}: each must appear once, by its fqdn.")
    node, world = sorted(nodes).index(me), len(nodes) * nproc
    if world != world_size:
        raise ValueError(f"the plan is for {world_size} ranks, not the {len(nodes)} x {nproc} of this job.")
    ranks = list(range(node * nproc, (node + 1) * nproc))
    files = find_token_files(src)
    sizes = [path.stat().st_size // 2 for path in files]
    val_tokens = 0 if hp.val_file != "auto" else hp.val_tokens
    lengths = [*sizes[:-1], sizes[-1] - val_tokens]  # the training views load_token_data makes
    if lengths[-1] < hp.seq_len + 1:
        raise ValueError(f"{files[-1]} holds too few tokens for --val_tokens {val_tokens} and one window.")
    index, start, end = block_layout(lengths, hp.seq_len, BLOCK_WINDOWS)
    per_rank = math.ceil(tokens * margin / world / (BLOCK_WINDOWS * hp.seq_len))
    ranges = sample_slices(sizes)
    ranges[-1].append((lengths[-1], sizes[-1]))
    for rank in ranks:
        for block in staged_blocks(len(start), rank, world, hp.seed, per_rank):
            ranges[index[block]].append((int(start[block]), int(end[block])))
    dst = pathlib.Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # several reads in flight: NFS latency, not bandwidth
        copied = sum(pool.map(copy_ranges, files, [dst / path.name for path in files], ranges))
    manifest = {
        "source": str(src),
        "seq_len": hp.seq_len,
        "block_windows": BLOCK_WINDOWS,
        "world_size": world,
        "seed": hp.seed,
        "lengths": lengths,
        "ranks": ranks,
        "blocks_per_rank": per_rank,
        "tokens": tokens,
        "margin": margin,
    }
    (dst / f"{STAGED_MANIFEST}.tmp").write_text(json.dumps(manifest))
    (dst / f"{STAGED_MANIFEST}.tmp").rename(dst / STAGED_MANIFEST)  # last: a half-staged folder has no manifest
    return (
        f"stage {me}: ranks {ranks[0]}-{ranks[-1]} of {world}, {per_rank:,} blocks each ({margin} x the plan's "
        f"{tokens:,} tokens / {world}) + validation + check slices: {copied / 1e9:.3f} of "
        f"{2 * sum(sizes) / 1e9:.3f} GB"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="stage.py",
        description=__doc__.split("\n\n")[0],
        epilog="After --: the run's train.py flags (--seq_len, --val_tokens, --val_file and --seed matter here).",
    )
    parser.add_argument("src", help="the shared data folder (chunk_*.bin)")
    parser.add_argument("dst", help="this node's local folder")
    parser.add_argument("--plan", required=True, help="the JSON line `python train.py --dry_run` prints last")
    parser.add_argument("--margin", type=float, default=1.5, help="tokens staged / the plan's tokens (%(default)s)")
    parser.add_argument("--nodes", required=True, help="every node's fqdn, comma-separated")
    parser.add_argument("--nproc", type=int, required=True, help="ranks per node")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    hp, _, _ = parse_args(argv[split + 1 :])
    plan = json.loads(args.plan)
    start = time.perf_counter()
    try:
        line = stage(
            args.src, args.dst, plan["tokens"], plan["world_size"], args.margin, args.nodes.split(","), args.nproc, hp
        )
    except (FileNotFoundError, ValueError) as error:
        sys.exit(f"error: {error}")
    print(f"{line} in {time.perf_counter() - start:.1f} s -> {args.dst}", flush=True)


if __name__ == "__main__":
    main()
