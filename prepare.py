"""Text to token files the trainer reads: `python data_cli.py prepare INPUT... --tokenizer FILE --out DIR`.

Inputs, in the order given (a folder: its files of these kinds, in name order): text files (.txt, .md; each file one
document, or one per blank-line-separated block or per line: text_docs), JSON lines (.jsonl, .json, .ndjson; each
line an object whose `field` holds a document) and Parquet files (.parquet; each row's `column`; pyarrow). Tokenizer:
a SentencePiece .model or a Hugging Face tokenizer.json (eval.load_tokenizer). Each document is written as [marker] +
its ids, documents running on across chunk boundaries as in the event's data and llm.c's: chunk_0001.bin, ... of
chunk_tokens ids (the last one shorter), raw (the event's format) or with llm.c's header, and every val_every-th
document goes whole to val.bin until that holds val_tokens; meta.json says what was written from what.

Deterministic: documents are batched by size alone and tokenized by `workers` processes, their results taken in
order, so any worker count writes the same bytes. Streaming: at most 2 batches per worker in flight and one chunk in
memory, whatever the input size. Every file is written under a hidden temporary name and renamed; meta.json comes
last; a run that fails (bad input, a full disk) or is interrupted removes what it wrote; a failure is one sentence
(a ValueError).
"""

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import pathlib
from multiprocessing.pool import AsyncResult
from typing import Any

import numpy as np
from tqdm import tqdm

from eval import HFTokenizer, load_tokenizer
from windows import BOS_ID, HEADER_BYTES, LLMC_HEADERS, RAW_DTYPES

KINDS = {".txt": "text", ".md": "text", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
BATCH_CHARS = 1 << 20  # text per tokenizing task: ~250K ids, large enough that sending it costs little
MAX_CHUNKS = 9999  # chunk_NNNN.bin: beyond it, name order would no longer be file order
WORKER: dict[str, Any] = {}  # a worker process's tokenizer and document marker, set once by _start_worker


def input_files(inputs):
    """(path, kind) of every input, folders expanded; an unknown kind or an unreadable file is a ValueError."""
    files = []
    for given in map(pathlib.Path, inputs):
        found = sorted(p for p in given.rglob("*") if p.suffix in KINDS and p.is_file()) if given.is_dir() else [given]
        if given.is_dir() and not found:
            raise ValueError(f"input folder {given} holds no {', '.join(sorted(KINDS))} files.")
        files += found
    for path in files:
        if path.suffix not in KINDS:
            raise ValueError(f"input {path} is none of the kinds prepare reads ({', '.join(sorted(KINDS))}).")
        if not path.is_file() or not os.access(path, os.R_OK):
            raise ValueError(f"input {path} is not a readable file.")
    return [(path, KINDS[path.suffix]) for path in files]


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def _text_docs(path, text_docs):
    """(document, bytes read) of a text file."""
    if text_docs == "file":
        yield _decoded(path.read_bytes(), path, "its text"), path.stat().st_size
        return
    block, size = [], 0
    with open(path, "rb") as file:
        for number, raw in enumerate(file, 1):
            line, size = _decoded(raw, path, f"line {number}"), size + len(raw)
            if text_docs == "line":
                yield line.rstrip("\n"), size
                size = 0
            elif line.strip():
                block.append(line)
            elif block:
                yield "".join(block).rstrip("\n"), size
                block, size = [], 0
    if block:
        yield "".join(block).rstrip("\n"), size


def _jsonl_docs(path, field):
    with open(path, "rb") as file:
        for number, raw in enumerate(file, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except ValueError:  # not JSON, or not UTF-8
                raise ValueError(f"input {path} line {number} is not a JSON object in UTF-8.") from None
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                raise ValueError(f"input {path} line {number} has no {field!r} field holding text (--field).")
            yield row[field], len(raw)


def _parquet_docs(path, column):
    try:
        import pyarrow.parquet
    except ImportError:
        raise ValueError("Parquet inputs need the pyarrow package: pip install pyarrow") from None
    try:
        table = pyarrow.parquet.ParquetFile(path)
    except Exception:  # pyarrow's own errors, for any file that is not Parquet
        raise ValueError(f"input {path} is not a Parquet file.") from None
    if column not in table.schema_arrow.names:
        raise ValueError(f"input {path} has no {column!r} column (--column); it has {table.schema_arrow.names}.")
    per_row, row = path.stat().st_size / max(table.metadata.num_rows, 1), 0
    for batch in table.iter_batches(batch_size=1024, columns=[column]):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise ValueError(f"input {path} row {row} has no text in its {column!r} column (--column).")
            yield text, per_row


def _decoded(raw, path, where):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"input {path} is not UTF-8 text ({where}).") from None


def documents(files, field, column, text_docs):
    """(input index, document, input bytes it stands for) of every document, in input order."""
    for index, (path, kind) in enumerate(files):
        try:
            if kind == "text":
                docs = _text_docs(path, text_docs)
            else:
                docs = _jsonl_docs(path, field) if kind == "jsonl" else _parquet_docs(path, column)
            for text, size in docs:
                yield index, text, size
        except OSError as error:  # unreadable part-way: one sentence too
            raise ValueError(f"input {path} could not be read ({error.strerror or error}).") from None


def batches(docs):
    """Lists of (input index, document, bytes) of about BATCH_CHARS characters: the same cut for any worker count."""
    batch, chars = [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc[1])
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _start_worker(tokenizer_path, marker):
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: --workers is the parallelism
    WORKER.update(tokenizer=load_tokenizer(tokenizer_path), marker=marker)


def _encode(texts):
    """[marker] + each text's ids, all in one uint32 array, and each document's length: arrays, not lists of ints,
    cross from a worker cheaply."""
    tokenizer, marker = WORKER["tokenizer"], WORKER["marker"]
    docs = [[marker, *tokenizer.encode(text)] for text in texts]
    lengths = np.array([len(doc) for doc in docs], dtype=np.int64)
    return np.fromiter(itertools.chain.from_iterable(docs), dtype=np.uint32, count=int(lengths.sum())), lengths


def encoded(batch_stream, tokenizer_path, marker, workers):
    """(batch, its documents' ids as _encode gives them) in order, tokenized on workers processes with at most 2
    batches each in flight."""
    if workers == 1:
        _start_worker(tokenizer_path, marker)
        for batch in batch_stream:
            yield batch, _encode([text for _, text, _ in batch])
        return
    # spawn, not fork: nothing of this process (threads, a tokenizer's thread pool) is copied into the workers
    with multiprocessing.get_context("spawn").Pool(workers, _start_worker, (tokenizer_path, marker)) as pool:
        pending: collections.deque[tuple[list, AsyncResult]] = collections.deque()
        for batch in batch_stream:
            pending.append((batch, pool.apply_async(_encode, ([text for _, text, _ in batch],))))
            if len(pending) >= 2 * workers:
                batch, result = pending.popleft()
                yield batch, result.get()
        while pending:
            batch, result = pending.popleft()
            yield batch, result.get()


class TokenWriter:
    """Token files of token_dtype ids in folder, raw or with llm.c's header, each written under a hidden temporary
    name and renamed into place: .written lists the files renamed, .entries what meta.json says of each."""

    def __init__(self, folder, token_dtype, header):
        self.folder, self.dtype, self.header = folder, RAW_DTYPES[token_dtype], header
        self.written, self.entries = [], []

    def write(self, name, ids):
        path, tmp = self.folder / name, self.folder / f".{name}.{os.getpid()}.tmp"
        head, body = self._header(len(ids)), ids.astype(self.dtype, copy=False).tobytes()
        try:
            with open(tmp, "xb") as file:
                file.write(head)
                file.write(body)
            os.rename(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self.written.append(path)
        digest = hashlib.sha256(head)
        digest.update(body)
        entry = {"name": name, "tokens": len(ids), "bytes": len(head) + len(body), "sha256": digest.hexdigest()}
        self.entries.append(entry)
        return entry

    def write_text(self, name, text):
        """A text file (meta.json), written the same way; returns its path."""
        path, tmp = self.folder / name, self.folder / f".{name}.{os.getpid()}.tmp"
        try:
            with open(tmp, "x") as file:
                file.write(text)
            os.rename(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    def _header(self, count):
        if not self.header:
            return b""
        magic, version = next((m, v.version) for m, v in LLMC_HEADERS.items() if v.dtype == self.dtype)
        header = np.zeros(HEADER_BYTES // 4, dtype="<i4")
        header[:3] = magic, version, count
        return header.tobytes()

    def format_name(self):
        magic = next(m for m, v in LLMC_HEADERS.items() if v.dtype == self.dtype)
        return f"llm.c {self.dtype.name} (magic {magic})" if self.header else f"raw {self.dtype.name}"

    def default_marker(self):
        """The document marker train.py's --bos_id auto takes for files of this format."""
        return next(v.marker for v in LLMC_HEADERS.values() if v.dtype == self.dtype) if self.header else BOS_ID


def marker_id(tokenizer, doc_marker, path):
    """The id that opens each document: auto: the tokenizer's BOS; else doc_marker, an id or a token of it."""
    if doc_marker == "auto":
        if tokenizer.bos_id() < 0:
            raise ValueError(
                f"--tokenizer {path} has no BOS token; name the document marker with --doc_marker (an id or a token)."
            )
        return tokenizer.bos_id()
    marker: int | None
    if doc_marker.isdigit():
        marker = int(doc_marker)
    elif isinstance(tokenizer, HFTokenizer):
        marker = tokenizer.tokenizer.token_to_id(doc_marker)
    else:
        marker = tokenizer.piece_to_id(doc_marker)  # the unknown piece's id for a piece it lacks
        marker = marker if tokenizer.id_to_piece(marker) == doc_marker else None
    if marker is None or not 0 <= marker < tokenizer.get_piece_size():
        raise ValueError(f"--doc_marker {doc_marker} is not an id or a token of --tokenizer {path}.")
    return marker


def check_out(out_dir):
    """The output folder, new or without token files of an earlier run: prepare never replaces any."""
    out = pathlib.Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder to write token files into.")
    if out.is_dir() and (old := sorted([*out.glob("chunk_*.bin"), *out.glob("val.bin"), *out.glob("meta.json")])):
        raise ValueError(
            f"--out {out} already holds {old[0].name}; prepare never replaces token files: use a new folder."
        )
    return out


@dataclasses.dataclass(frozen=True)
class Options:
    """How prepare reads and writes (the flags of `python data_cli.py prepare`)."""

    field: str = "text"  # of a JSON line
    column: str = "text"  # of a Parquet file
    text_docs: str = "file"  # a text file's documents: file (all of it), blank (blocks between blank lines), line
    chunk_tokens: int = 1 << 24
    val_tokens: int = 1 << 20  # val.bin: whole documents until it holds this many ids (0: none)
    val_every: int = 100  # every val_every-th document goes to val.bin, until it is full
    token_dtype: str = "uint16"
    header: bool = False  # llm.c's header on every file
    doc_marker: str = "auto"  # the id (or token) opening each document; auto: the tokenizer's BOS
    workers: int = 1


def prepare(inputs, tokenizer_path, out_dir, options=Options(), progress=None):
    """Tokenize inputs into out_dir (see the module docstring) and return meta.json's contents. progress: tqdm's bar
    on stderr (None: on a terminal only)."""
    files = input_files(inputs)
    tokenizer = load_tokenizer(tokenizer_path)
    n_ids, limit = tokenizer.get_piece_size(), np.iinfo(RAW_DTYPES[options.token_dtype]).max + 1
    if n_ids > limit:
        raise ValueError(
            f"--tokenizer {tokenizer_path} has {n_ids:,} ids, more than {options.token_dtype} holds ({limit:,}); "
            f"pass --token_dtype uint32."
        )
    marker = marker_id(tokenizer, options.doc_marker, tokenizer_path)
    out = check_out(out_dir)
    sources = [
        {"path": str(path), "kind": kind, "bytes": path.stat().st_size, "sha256": file_sha256(path), "documents": 0}
        for path, kind in files
    ]
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    writer = TokenWriter(out, options.token_dtype, options.header)
    try:
        counts = write_tokens(files, sources, tokenizer_path, marker, writer, options, progress)
        meta = {
            "format": writer.format_name(),
            "tokenizer": {
                "file": str(tokenizer_path),
                "kind": "tokenizers" if isinstance(tokenizer, HFTokenizer) else "sentencepiece",
                "ids": n_ids,
                "sha256": file_sha256(tokenizer_path),
            },
            "doc_marker": marker,
            "options": {k: v for k, v in dataclasses.asdict(options).items() if k != "workers"},  # bytes: not its
            **counts,
            "sources": sources,
            "files": [entry for entry in writer.entries if entry["name"] != "val.bin"],
            "val_file": next((entry for entry in writer.entries if entry["name"] == "val.bin"), None),
            "train_flags": train_flags(out, n_ids, marker, writer, options, counts["tokens"]["val"] > 0),
        }
        writer.written.append(writer.write_text("meta.json", json.dumps(meta, indent=1) + "\n"))
    except BaseException as error:
        for path in writer.written:
            path.unlink(missing_ok=True)
        if created:
            with contextlib.suppress(OSError):  # a file put there meanwhile is not ours to remove
                out.rmdir()
        if isinstance(error, OSError):
            raise ValueError(
                f"--out {out} could not be written ({error.strerror or error}); none of it is left."
            ) from None
        raise
    return meta


def write_tokens(files, sources, tokenizer_path, marker, writer, options, progress):
    """Every document as [marker] + its ids, into val.bin (every val_every-th, until it is full) or the chunks;
    returns the counts meta.json gives. sources[i]["documents"] counts input i's."""
    chunk, filled, val = np.empty(options.chunk_tokens, dtype=writer.dtype), 0, []
    docs, tokens, number = {"train": 0, "val": 0, "empty": 0}, {"train": 0, "val": 0}, 0
    stream = batches(documents(files, options.field, options.column, options.text_docs))
    total = sum(source["bytes"] for source in sources)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="prepare", disable=None if progress is None else not progress
    ) as bar:
        for batch, (flat, lengths) in encoded(stream, tokenizer_path, marker, options.workers):
            for (index, text, size), end, length in zip(batch, np.cumsum(lengths), lengths):
                bar.update(size)
                if not text.strip():
                    docs["empty"] += 1
                    continue
                ids = flat[end - length : end].astype(writer.dtype)  # a copy: val.bin's parts hold no batch alive
                sources[index]["documents"] += 1
                part = "val" if number % options.val_every == 0 and tokens["val"] < options.val_tokens else "train"
                docs[part], tokens[part], number = docs[part] + 1, tokens[part] + len(ids), number + 1
                if part == "val":
                    val.append(ids)
                    continue
                while len(ids):
                    take = min(len(ids), len(chunk) - filled)
                    chunk[filled : filled + take], filled, ids = ids[:take], filled + take, ids[take:]
                    if filled == len(chunk):
                        write_chunk(writer, chunk)
                        filled = 0
    if not docs["train"]:
        raise ValueError(
            f"the inputs hold no document for training ({docs['val']} for validation, {docs['empty']} empty)."
        )
    if filled:
        write_chunk(writer, chunk[:filled])
    if val:
        writer.write("val.bin", np.concatenate(val))
    return {"documents": docs, "tokens": tokens, "chunks": len(writer.entries) - bool(val)}


def write_chunk(writer, ids):
    number = len(writer.entries) + 1
    if number > MAX_CHUNKS:
        raise ValueError(f"the data needs more than {MAX_CHUNKS} chunks of --chunk_tokens {len(ids):,}; raise it.")
    writer.write(f"chunk_{number:04d}.bin", ids)


def train_flags(out, n_ids, marker, writer, options, has_val):
    """The train.py flags that read out's files as written."""
    flags = [f"--data_dir {out}", f"--vocab_size {n_ids}"]
    flags += [f"--val_file {out / 'val.bin'}"] if has_val else []
    flags += ["--token_dtype uint32"] if options.token_dtype == "uint32" and not options.header else []
    flags += [f"--bos_id {marker}"] if marker != writer.default_marker() else []
    return " ".join(flags)
