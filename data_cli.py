"""The data CLI, `python data_cli.py ...` (it imports data.py, never the reverse):
check DIR [--full] validates a folder of token files and summarises it; synth OUT_DIR --tokens N writes the
synthetic Markov data in the event format; bench DIR measures the loader's tokens/s and its cost to a concurrent
compute loop; prepare INPUT... --tokenizer FILE --out DIR tokenizes text, JSON lines or Parquet into token files
(prepare.py).
"""

import argparse
import math
import os
import sys
import time
from typing import NoReturn

import torch

from data import BatchLoader, check_token_files, find_token_files, load_token_data, open_file_room
from prepare import Options, prepare
from shards import Deal
from synthetic import SYNTH_STATES, synthetic_entropy_nats, write_synthetic
from windows import RAW_DTYPES, WindowSpec


def _cli_check(args):
    start = time.perf_counter()
    files = find_token_files(args.data_dir)
    if note := open_file_room(len(files)):  # as a run would: its limit, raised or refused alike
        print(f"a run here: {note}")
    s = check_token_files(
        files, args.vocab_size, args.seq_len, full=args.full, token_dtype=args.token_dtype, bos_id=args.bos_id
    )
    gib = sum(path.stat().st_size for path in files) / 2**30
    print(f"ok: {s['files']} files ({s['format']}), {s['tokens']:,} tokens ({gib:.2f} GiB) in {args.data_dir}")
    checked = "every token" if args.full else f"sampled {s['checked_tokens']:,} tokens"
    print(f"{checked}: ids {s['min_id']}..{s['max_id']} (--vocab_size {args.vocab_size})")
    mean_doc = f", ~{1 / s['bos_rate']:,.0f} tokens per document" if s["bos_rate"] else ""
    found = "detected" if s["has_bos"] else "not detected"
    print(f"document marker (--bos_id) {s['bos_id']}: rate {s['bos_rate']:.2e}{mean_doc}: {found}")
    print(f"checked in {time.perf_counter() - start:.2f} s")


def _cli_synth(args):
    start = time.perf_counter()
    paths = write_synthetic(
        args.out_dir,
        args.tokens,
        args.chunk_tokens,
        args.vocab_size,
        args.seed,
        args.n_states,
        args.n_successors,
        args.doc_len,
    )
    print(
        f"wrote {args.tokens:,} tokens in {len(paths)} files to {args.out_dir} in {time.perf_counter() - start:.1f}"
        f" s; entropy rate {synthetic_entropy_nats(args.n_successors, args.doc_len):.4f} nats/token"
    )


def _cli_bench(args):
    torch.set_num_threads(1)  # the compute loop gets one core, the loader thread another
    data = load_token_data(
        args.data_dir, args.vocab_size, args.seq_len, 0, token_dtype=args.token_dtype, bos_id=args.bos_id
    )
    a = torch.randn(args.matmul, args.matmul)

    def timed(loader, compute):
        """Seconds for args.batches iterations of (next batch, matmul), and the part spent in next()."""
        waited, start = 0.0, time.perf_counter()
        for _ in range(args.batches):
            if loader is not None:
                asked = time.perf_counter()
                next(loader)
                waited += time.perf_counter() - asked
            if compute:
                a @ a
        return time.perf_counter() - start, waited

    def with_loader(compute):
        spec = WindowSpec(args.seq_len, doc_aligned=args.doc_aligned, bos_id=data.bos_id)
        with BatchLoader(data.train, spec, args.batch_size, Deal(0, 1)) as loader:
            return timed(loader, compute)

    for label in ("first pass", "page cache"):  # the first pass reads exactly the windows the second one times
        seconds, _ = with_loader(compute=False)
        print(
            f"loader ({label}): {args.batches * args.batch_size * args.seq_len / seconds / 1e6:.1f}M tokens/s "
            f"({1e3 * seconds / args.batches:.2f} ms/batch of {args.batch_size} x {args.seq_len})"
        )
    alone, shared = [], []
    for _ in range(3):  # alternate and keep the best of each: other processes share this machine
        alone.append(timed(None, compute=True)[0])
        shared.append(with_loader(compute=True))
    alone, (shared, waited) = min(alone) / args.batches, [t / args.batches for t in min(shared)]
    print(
        f"compute loop ({args.matmul}^2 matmul + one batch per iteration, best of 3): alone {1e3 * alone:.2f} "
        f"ms/iter, with loader {1e3 * shared:.2f} ms/iter ({100 * (shared / alone - 1):+.1f}%, of which "
        f"{1e3 * waited:.3f} ms/iter in next())"
    )


def _cli_prepare(args):
    start = time.perf_counter()
    fields = {name: getattr(args, name) for name in Options.__dataclass_fields__}
    meta = prepare(args.inputs, args.tokenizer, args.out, Options(**fields))
    seconds, tokens, docs = time.perf_counter() - start, meta["tokens"], meta["documents"]
    read = sum(source["bytes"] for source in meta["sources"])
    print(
        f"wrote {tokens['train']:,} training tokens ({docs['train']:,} documents) in {meta['chunks']} chunks and "
        f"{tokens['val']:,} validation tokens ({docs['val']:,} documents) to {args.out} ({meta['format']}), "
        f"{docs['empty']:,} empty documents skipped, in {seconds:.1f} s: {read / seconds / 1e6:.2f} MB/s of input, "
        f"{(tokens['train'] + tokens['val']) / seconds / 1e3:,.0f}K tokens/s on {args.workers} workers"
    )
    print(f"train on it: python train.py {meta['train_flags']}")


def count(low=1, high=None):
    """An argparse type: a whole number (1e8 is allowed) from low up to high, else one sentence."""

    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value == int(value) and value >= low and (high is None or value <= high)):
            top = f" and at most {high}" if high is not None else ""
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least {low}{top}")
        return int(value)

    return parse


def main(argv=None):
    parser = OneSentenceParser(prog="data_cli.py", description="Check, synthesise or benchmark token data.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate a folder of chunk_*.bin files and summarise it")
    check.add_argument("data_dir")
    check.add_argument("--full", action="store_true", help="read every token, not a sample (minutes on NFS)")
    synth = commands.add_parser("synth", help="write the synthetic Markov data in the event format")
    synth.add_argument("out_dir")
    synth.add_argument("--tokens", type=count(), required=True, help="e.g. 1e8")
    synth.add_argument("--chunk_tokens", type=count(), default=1 << 24)
    synth.add_argument("--seed", type=count(0, 2**32 - 1), default=0)
    for name, default in (("n_states", SYNTH_STATES), ("n_successors", 8), ("doc_len", 256)):
        synth.add_argument(f"--{name}", type=count(), default=default)
    bench = commands.add_parser("bench", help="loader tokens/s and its cost to a concurrent compute loop")
    bench.add_argument("data_dir")
    bench.add_argument("--batch_size", type=count(), default=64)
    bench.add_argument("--batches", type=count(), default=300)
    bench.add_argument("--matmul", type=count(), default=512, help="matrix size of the compute loop")
    bench.add_argument("--doc_aligned", action="store_true")
    prep = commands.add_parser("prepare", help="tokenize text, JSON lines or Parquet into token files (prepare.py)")
    prepare_flags(prep)
    for sub in (check, synth, bench):
        sub.add_argument("--vocab_size", type=count(2, 65536) if sub is synth else count(2, 2**32), default=32000)
    for sub in (check, bench):
        sub.add_argument("--seq_len", type=count(), default=1024)
        sub.add_argument("--token_dtype", choices=tuple(RAW_DTYPES), default="uint16", help="ids of headerless files")
        sub.add_argument("--bos_id", type=count(0), default=None, help="document marker; default: the format's")
    args = parser.parse_args(argv)
    try:
        {"check": _cli_check, "synth": _cli_synth, "bench": _cli_bench, "prepare": _cli_prepare}[args.command](args)
    except (OSError, ValueError) as error:  # a user's folder, file or disk: one sentence, exit 2 (flags: argparse's)
        _refuse(error)


def prepare_flags(prep):
    """prepare's flags: one per field of prepare.Options, with its default."""
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help=".txt/.md, .jsonl/.json/.ndjson, .parquet, or folders")
    prep.add_argument("--tokenizer", required=True, help="a SentencePiece .model or a Hugging Face tokenizer.json")
    prep.add_argument("--out", required=True, help="a new folder, or one without token files")
    prep.add_argument("--field", default="text", help="the JSON lines' text field (%(default)s)")
    prep.add_argument("--column", default="text", help="the Parquet files' text column (%(default)s)")
    prep.add_argument("--text_docs", choices=("file", "blank", "line"), default="file", help="a text file's documents")
    prep.add_argument(
        "--chunk_tokens", type=count(1, 2**31 - 1), default=1 << 24, help="ids per chunk file (%(default)s)"
    )
    prep.add_argument(
        "--val_tokens", type=count(0, 2**31 - 1), default=1 << 20, help="val.bin: at least this many (%(default)s)"
    )
    prep.add_argument(
        "--val_every", type=count(), default=100, help="every Nth document goes to val.bin until full (%(default)s)"
    )
    prep.add_argument("--token_dtype", choices=tuple(RAW_DTYPES), default="uint16")
    prep.add_argument("--header", action="store_true", help="llm.c's 1,024-byte header on every file")
    prep.add_argument("--doc_marker", default="auto", help="the id or token opening each document; auto: BOS")
    prep.add_argument("--workers", type=count(), default=os.cpu_count() or 1, help="tokenizing processes (%(default)s)")


def _refuse(message) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


class OneSentenceParser(argparse.ArgumentParser):
    """argparse whose error (a flag it cannot read) is _refuse's one sentence; --help still shows the usage. Its
    subcommands' parsers are of its class too (add_subparsers' default)."""

    def error(self, message: str) -> NoReturn:
        _refuse(message)


if __name__ == "__main__":
    main()
