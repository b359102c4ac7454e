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

from data import find_token_files, sample_slices, token_layouts
from shards import BLOCK_WINDOWS, STAGED_MANIFEST, block_layout, staged_blocks
from config import check_flags, parse_args

COPY_BYTES = 1 << 26  # one read and write at most; ranges are block-sized (131 KB at the event) or merged ones


def merged(ranges):
    """Sorted (start, end) ranges with overlapping and touching ones joined."""
    out: list[list[int]] = []  # lists: a range's end grows as ranges join it
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def copy_ranges(src, dst, layout, ranges):
    """dst: a file of src's size holding src's header (windows.TokenLayout) and its bytes in the token ranges, the rest
    a hole. Returns bytes copied. Written under a temporary name and renamed over dst: a link at dst (to a source
    chunk, say) is replaced, never written through, and a copy that fails leaves no partial file that looks staged."""
    copied, tmp = 0, dst.with_name(f".{dst.name}.staging")
    width, header = layout.dtype.itemsize, layout.header
    tmp.unlink(missing_ok=True)
    try:
        with open(src, "rb") as source, open(tmp, "xb") as target:
            target.truncate(os.fstat(source.fileno()).st_size)
            spans = [(0, header)] if header else []  # bytes: the header, then each range's tokens
            spans += [(header + width * start, header + width * end) for start, end in merged(ranges)]
            for first, last in spans:
                for offset in range(first, last, COPY_BYTES):
                    size = min(COPY_BYTES, last - offset)
                    chunk = os.pread(source.fileno(), size, offset)
                    if len(chunk) != size:
                        raise ValueError(f"{src} ended at byte {offset + len(chunk):,}: it shrank while being staged.")
                    os.pwrite(target.fileno(), chunk, offset)
                    copied += size
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return copied


def file_id(path):
    """A file's identity, (device, inode), through symlinks: the same for every path that reaches it (a hard link,
    a symlink, a bind mount)."""
    info = os.stat(path)
    return info.st_dev, info.st_ino


def check_destination(src, dst, files, val_file=None):
    """Refuse a destination through which staging would write to its source: the source folder by another path
    (itself, a symlink, a bind mount), or a folder whose files are source files (hard or symbolic links); and one
    that is not a folder."""
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"the destination {dst} is a file, not a folder; name the node-local folder to stage into.")
    if dst.is_dir() and file_id(dst) == file_id(src):
        raise ValueError(f"the destination {dst} is the source folder {src}; staging would overwrite the source data.")
    sources = {file_id(path): path for path in [*files, *([val_file] if val_file and os.path.isfile(val_file) else [])]}
    for path in files:
        target = dst / path.name
        if target.exists() and file_id(target) in sources:
            raise ValueError(
                f"{target} is the source file {sources[file_id(target)]} (a link to it); staging would overwrite it: "
                f"stage into an empty folder."
            )


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
    layouts = token_layouts(files, hp.token_dtype)
    sizes = [layout.count for layout in layouts]
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
    check_destination(pathlib.Path(src), dst, files, None if hp.val_file == "auto" else hp.val_file)
    dst.mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # several reads in flight: NFS latency, not bandwidth
        copied = sum(pool.map(copy_ranges, files, [dst / path.name for path in files], layouts, ranges))
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
    tmp = dst / f".{STAGED_MANIFEST}.staging"
    tmp.unlink(missing_ok=True)
    with open(tmp, "x") as file:
        file.write(json.dumps(manifest))
    tmp.replace(dst / STAGED_MANIFEST)  # last: a half-staged folder has no manifest
    return (
        f"stage {me}: ranks {ranks[0]}-{ranks[-1]} of {world}, {per_rank:,} blocks each ({margin} x the plan's "
        f"{tokens:,} tokens / {world}) + validation + check slices: {copied / 1e9:.3f} of "
        f"{sum(path.stat().st_size for path in files) / 1e9:.3f} GB"
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
    start = time.perf_counter()
    try:
        check_flags(hp)
        tokens, world_size = read_plan(args.plan)
        if not (math.isfinite(args.margin) and args.margin > 0):
            raise ValueError(
                f"--margin must be a finite number above 0 (tokens staged / the plan's), not {args.margin}."
            )
        if args.nproc < 1:
            raise ValueError(f"--nproc must be at least 1, not {args.nproc}.")
        line = stage(args.src, args.dst, tokens, world_size, args.margin, args.nodes.split(","), args.nproc, hp)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(f"{line} in {time.perf_counter() - start:.1f} s -> {args.dst}", flush=True)


def read_plan(text):
    """(tokens, world size) from the JSON line `python train.py --dry_run` prints last."""
    try:
        plan = json.loads(text)
        tokens, world_size = plan["tokens"], plan["world_size"]
    except (ValueError, KeyError, TypeError):
        plan, tokens, world_size = None, None, None
    if not (type(tokens) is int and tokens > 0 and type(world_size) is int and world_size > 0):
        raise ValueError(
            f"--plan {text[:80]!r} is not the plan's JSON line (with positive integer tokens and world_size) that "
            f"`python train.py --dry_run ...` prints last."
        )
    return tokens, world_size


if __name__ == "__main__":
    main()
