"""Evaluate a checkpoint the way the organizers load it: validation loss, bits per token, optionally HellaSwag.

    python eval.py checkpoint.pt --data /home/data/val.bin
    python eval.py checkpoint.pt --data /home/data --hellaswag hellaswag_val.jsonl --tokenizer tokenizer.model
    python eval.py checkpoint.pt --data fineweb10B/fineweb_val_000000.bin     # llm.c's headered shards too

Only model.py is imported, and the checkpoint is loaded with the organizers' snippet verbatim, so a checkpoint
that loads here loads for them.

Which tokens (the files train.py reads: raw little-endian uint16, or uint32 with --token_dtype uint32; a file that
opens with llm.c's header, magic 20240520 for uint16 ids or 20240801 for uint32, is read past it, whatever the flag):
  --data FILE  the first --max_tokens tokens of FILE (e.g. val.bin).
  --data DIR   DIR/val.bin if present, else DIR's first *_val_*.bin (modded-nanogpt's fineweb_val_000000.bin): its
               first --max_tokens tokens; else the LAST --max_tokens tokens of the last chunk_*.bin (or
               *_train_*.bin) in name order: the range train.py holds out when --max_tokens equals its --val_tokens
               (both default to 1,048,576).
They are cut into disjoint windows of seq_len + 1 tokens from the start (the remainder is dropped, as in
train.py's validation). The loss is the mean over every predicted token, in float32.

HellaSwag (--hellaswag FILE.jsonl --tokenizer TOKENIZER, offline): each line has "ctx" (or "ctx_a" and "ctx_b"),
"endings" and "label". The context is BOS + the tokenized context, each ending is tokenized on its own (SentencePiece's
leading-space marker stands for the space between them; a tokenizer.json is given " " + the ending, as GPT-2's
HellaSwag does), and an ending scores the sum of its tokens' log-probabilities given the context (acc) or their mean
per token (acc_norm). TOKENIZER: a SentencePiece .model, or a Hugging Face tokenizer.json (the tokenizers package).
"""

import argparse
import json
import math
import pathlib
import re
import sys
import warnings
from typing import NamedTuple, NoReturn

import numpy as np
import torch
import torch.nn.functional as F

from model import get_model

# The token-file formats: a deliberate copy of windows.py's (RAW_DTYPES, HEADER_BYTES, LLMC_HEADERS' versions and
# dtypes), since eval.py runs beside model.py alone (the organizers' folder, the bundled submission) and imports
# nothing else of ours.
RAW_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
HEADER_BYTES = 256 * 4
# magic: (version, ids)
LLMC_HEADERS: dict[int, tuple[int, np.dtype]] = {20240520: (1, np.dtype("<u2")), 20240801: (7, np.dtype("<u4"))}
# the token a tokenizer.json opens documents with, likeliest first: Llama-2/Mistral, Llama-3, Gemma, BERT-style, GPT-2
BOS_PIECES = ("<s>", "<|begin_of_text|>", "<bos>", "[BOS]", "<|endoftext|>")


def user_file(path, what):
    """path, if it names a file; else one sentence naming the flag (what) and the path."""
    path = pathlib.Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder, not a file.")
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist.")
    return path


def user_device(name):
    """The torch.device of --device (default: cuda if present), checked by putting a tensor on it, so that a
    device this machine lacks is one sentence here rather than a traceback from the first .to()."""
    if not name:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:  # an unknown type (tpu), a malformed index (cuda:x)
        raise ValueError(f"--device {name} is not a device name such as cpu, cuda or cuda:1.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was given but no CUDA device is visible.")
    if device.type == "cuda" and (device.index or 0) >= (count := torch.cuda.device_count()):
        raise ValueError(f"--device {name} was given but only cuda:0 to cuda:{count - 1} are visible.")
    try:
        torch.zeros(1, device=device).tolist()  # a build without the backend, or meta, which holds no data
    except Exception:
        raise ValueError(f"--device {name} is not a device this machine can run the model on.") from None
    return device


def fail(message) -> NoReturn:
    """Exit status 2 with one sentence on stderr; the SystemExit carries the sentence too, for callers of main."""
    print(f"error: {message}", file=sys.stderr)
    error = SystemExit(f"error: {message}")
    error.code = 2
    raise error


class OneSentenceParser(argparse.ArgumentParser):
    """argparse whose error (a flag it cannot read) is fail's one sentence; --help still shows the usage."""

    def error(self, message: str) -> NoReturn:
        fail(message)


def load_checkpoint(path):
    """The organizers' three lines, verbatim; each way a checkpoint file can be bad becomes one ValueError."""
    path = user_file(path, "checkpoint")
    if path.stat().st_size == 0:
        raise ValueError(f"checkpoint {path} is empty (0 bytes).")
    try:
        with warnings.catch_warnings():  # a damaged file can make the unpickler warn before it fails
            warnings.simplefilter("ignore")
            ckpt = torch.load(path, weights_only=True)
    except Exception as e:  # RuntimeError, EOFError, UnpicklingError, ...: whatever the damage gives
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if refused:  # a readable file holding an object the organizers' weights_only load refuses
            raise ValueError(
                f"checkpoint {path} holds a {refused[1]} object, which torch.load(weights_only=True) "
                f"refuses; save plain tensors, numbers and strings."
            ) from None
        raise ValueError(
            f"checkpoint {path} ({path.stat().st_size:,} bytes) is not a readable torch checkpoint: "
            f"truncated, corrupted or another format."
        ) from None
    if not isinstance(ckpt, dict) or "config" not in ckpt or "model" not in ckpt:
        held = sorted(map(str, ckpt)) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ValueError(f"checkpoint {path} lacks the 'model' and 'config' entries train.py writes (it holds {held}).")
    try:
        model = get_model(ckpt["config"])
    except Exception as e:  # whatever get_model's checks raise on a config it cannot build
        raise ValueError(f"checkpoint {path}: get_model cannot build a model from its config ({e}).") from None
    try:
        model.load_state_dict(ckpt["model"])
    except Exception as e:  # RuntimeError listing every mismatch, TypeError on a non-dict
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = (lines[1] if len(lines) > 1 else lines[0] if lines else type(e).__name__)[:300].rstrip(".")
        raise ValueError(
            f"checkpoint {path}: its weights do not fit the model its config describes ({detail})."
        ) from None
    return model, ckpt


class TokenSpan(NamedTuple):
    """Where a token file's ids lie: their dtype, the byte offset of the first, how many there are."""

    dtype: np.dtype
    offset: int
    n_tokens: int


def token_span(path, token_dtype):
    """The TokenSpan of a token file: past an llm.c header, else raw token_dtype ids."""
    n_bytes = path.stat().st_size
    if n_bytes == 0:
        raise ValueError(f"--data {path} is empty (0 bytes).")
    with open(path, "rb") as file:
        head = file.read(HEADER_BYTES)
    magic = int.from_bytes(head[:4], "little") if len(head) >= 4 else None
    if magic not in LLMC_HEADERS:
        dtype = RAW_DTYPES[token_dtype]
        count, rest = divmod(n_bytes, dtype.itemsize)
        if rest:
            size = "an odd size" if dtype.itemsize == 2 else f"a size that is not a multiple of {dtype.itemsize}"
            raise ValueError(
                f"--data {path} has {size} ({n_bytes} bytes), so it is not a file of {token_dtype} tokens."
            )
        return TokenSpan(dtype, 0, count)
    version, dtype = LLMC_HEADERS[magic]
    header = np.frombuffer(head.ljust(HEADER_BYTES, b"\0"), dtype="<i4")
    count = int(header[2])
    if len(head) < HEADER_BYTES or header[1] != version or n_bytes != HEADER_BYTES + count * dtype.itemsize:
        raise ValueError(
            f"--data {path} opens with llm.c's magic {magic}, but its header (version {header[1]}, {count:,} tokens) "
            f"does not match its {n_bytes:,} bytes: it is truncated or damaged."
        )
    return TokenSpan(dtype, HEADER_BYTES, count)


def read_tokens(path, max_tokens, tail=False, token_dtype="uint16"):
    """The first (or last) max_tokens tokens of a token file, as int64."""
    dtype, start, n_tokens = token_span(path, token_dtype)
    count = min(max_tokens, n_tokens)
    offset = start + (n_tokens - count) * dtype.itemsize if tail else start
    tokens = np.fromfile(path, dtype=dtype, count=count, offset=offset).astype(np.int64)
    where = f"{'last' if tail else 'first'} {count:,} tokens of {path}"
    return torch.from_numpy(tokens), where


def eval_tokens(data, max_tokens, token_dtype="uint16"):
    """The evaluation tokens for --data (see the module docstring) and a description of where they came from."""
    path = pathlib.Path(data)
    if path.is_file():
        return read_tokens(path, max_tokens, token_dtype=token_dtype)
    if not path.is_dir():
        raise FileNotFoundError(f"--data {path} does not exist.")
    held_out = [path / "val.bin", *sorted(path.glob("*_val_*.bin"))]
    if val := next((p for p in held_out if p.is_file()), None):
        return read_tokens(val, max_tokens, token_dtype=token_dtype)
    chunks = next((found for glob in ("chunk_*.bin", "*_train_*.bin") if (found := sorted(path.glob(glob)))), [])
    chunks = [p for p in chunks if p.is_file()]
    if not chunks:
        raise FileNotFoundError(
            f"--data {path} holds neither val.bin nor chunk_*.bin token files (nor *_val_*.bin, *_train_*.bin ones)."
        )
    return read_tokens(chunks[-1], max_tokens, tail=True, token_dtype=token_dtype)


def make_windows(tokens, where, seq_len, vocab_size):
    """(n, seq_len + 1) disjoint windows from the start of tokens."""
    window = seq_len + 1
    if len(tokens) < window:
        raise ValueError(
            f"--data gives {len(tokens)} tokens, fewer than one window of seq_len + 1 = {window} (the {where})."
        )
    if (top := int(tokens.max())) >= vocab_size:
        raise ValueError(f"--data contains token id {top} >= the model's vocab_size {vocab_size} (in the {where}).")
    return tokens[: len(tokens) // window * window].view(-1, window)


@torch.no_grad()
def mean_loss(model, windows, batch_size, device):
    """Mean next-token loss over all predicted tokens of the windows, with the model's own loss."""
    total, count = 0.0, 0
    for batch in windows.split(batch_size):
        batch = batch.to(device)
        _, loss = model(batch[:, :-1], batch[:, 1:])
        total += loss.item() * batch[:, 1:].numel()  # the model averages per batch; weight by tokens
        count += batch[:, 1:].numel()
    return total / count


# ----------------------------------------------------------------------------- HellaSwag


def load_hellaswag(path):
    """[(context, endings, label)] from a HellaSwag .jsonl file."""
    path = user_file(path, "--hellaswag")
    try:
        lines = path.read_text().split("\n")
    except UnicodeDecodeError:
        raise ValueError(f"--hellaswag {path} is not a text file of JSON lines.") from None
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            # a missing or null half is not text: join() refuses it (TypeError), an f-string would score "None"
            context = row["ctx"] if "ctx" in row else " ".join((row["ctx_a"], row["ctx_b"])).strip()
            endings, label = row["endings"], row["label"]
            label = int(label) if isinstance(label, str) and label.isdigit() else label  # some dumps write "3"
            example = (
                isinstance(context, str)
                and context
                and isinstance(endings, list)
                and len(endings) >= 2
                and all(isinstance(e, str) and e.strip() for e in endings)
                and type(label) is int  # not a bool, not 1.7
                and 0 <= label < len(endings)
            )
        except (ValueError, KeyError, TypeError):  # not JSON, not an object, a key missing
            example = False
        if not example:
            raise ValueError(
                f"--hellaswag {path} line {number} is not an example with a ctx (or ctx_a and ctx_b), "
                f"2+ non-empty endings and an integer label indexing them."
            )
        items.append((context, endings, label))
    if not items:
        raise ValueError(f"--hellaswag {path} holds no examples.")
    return items


class HFTokenizer:
    """A Hugging Face tokenizer.json behind the calls made here of a SentencePiece processor: encode (a text, or a
    list of them) without special tokens, decode, bos_id (the first of BOS_PIECES it has, else -1), get_piece_size."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.bos = next((i for piece in BOS_PIECES if (i := tokenizer.token_to_id(piece)) is not None), -1)

    def encode(self, text):
        if isinstance(text, str):
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return [encoding.ids for encoding in self.tokenizer.encode_batch(text, add_special_tokens=False)]

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)  # as SentencePiece drops its BOS

    def bos_id(self):
        return self.bos

    def get_piece_size(self):
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def load_tokenizer(path, vocab_size=None):
    """A SentencePiece processor for a .model, an HFTokenizer for a tokenizer.json (a .json file); each package is
    needed only here, so it is imported only here. vocab_size: the model's, which the tokenizer's ids must fit."""
    package = "tokenizers" if pathlib.Path(path).suffix == ".json" else "sentencepiece"
    try:
        module = __import__(package)
    except ImportError:
        raise ValueError(f"--tokenizer needs the {package} package: pip install {package}") from None
    path = user_file(path, "--tokenizer")
    try:
        if package == "tokenizers":
            tokenizer = HFTokenizer(module.Tokenizer.from_file(str(path)))
        else:
            tokenizer = module.SentencePieceProcessor(model_file=str(path))
    except Exception:  # each package's parse errors (RuntimeError, OSError, its own Exception)
        kind = "Hugging Face tokenizer.json" if package == "tokenizers" else "SentencePiece .model"
        raise ValueError(f"--tokenizer {path} is not a {kind} file.") from None
    if vocab_size is not None and tokenizer.get_piece_size() > vocab_size:
        raise ValueError(
            f"--tokenizer {path} has {tokenizer.get_piece_size()} pieces, more than the model's "
            f"vocab_size {vocab_size}."
        )
    return tokenizer


@torch.no_grad()
def ending_logprobs(model, context, endings, device, max_len):
    """[(sum of log p(token | everything before it), token count)] per ending, all endings in one batch.
    context: token ids (at least one), endings: lists of token ids. Rows longer than max_len + 1 lose
    context tokens from the left; rows are right-padded, which a causal model never sees."""
    rows = [(context + ending)[-(max_len + 1) :] for ending in endings]
    if any(len(ending) == 0 or len(ending) >= len(row) for ending, row in zip(endings, rows)):
        raise ValueError(f"every ending needs 1..{max_len} tokens after at least one context token.")
    batch = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.int64)
    for i, row in enumerate(rows):
        batch[i, : len(row)] = torch.tensor(row)
    logits, _ = model(batch[:, :-1].to(device))
    logp = F.log_softmax(logits.float(), dim=-1).cpu()
    scores = []
    for i, (row, ending) in enumerate(zip(rows, endings)):
        start = len(row) - len(ending)  # first ending token; predicted by the logits one position earlier
        targets = torch.tensor(ending)
        scores.append((logp[i, start - 1 : len(row) - 1].gather(-1, targets[:, None]).sum().item(), len(ending)))
    return scores


def hellaswag(model, items, tokenizer, device, max_len):
    """acc (highest total log-prob) and acc_norm (highest mean log-prob per token) over the items."""
    bos = [tokenizer.bos_id()] if tokenizer.bos_id() >= 0 else []  # training documents start with BOS
    spaced = isinstance(tokenizer, HFTokenizer)  # no leading-space marker: the space is the ending's own
    correct = correct_norm = 0
    for number, (context, endings, label) in enumerate(items, 1):
        ending_ids = tokenizer.encode([" " + e for e in endings] if spaced else endings)
        try:
            scores = ending_logprobs(model, bos + tokenizer.encode(context), ending_ids, device, max_len)
        except ValueError as e:  # an ending longer than the window
            raise ValueError(f"--hellaswag example {number}: {e}") from None
        correct += max(range(len(scores)), key=lambda i: scores[i][0]) == label
        correct_norm += max(range(len(scores)), key=lambda i: scores[i][0] / scores[i][1]) == label
    return {
        "hellaswag_acc": correct / len(items),
        "hellaswag_acc_norm": correct_norm / len(items),
        "hellaswag_examples": len(items),
    }


# ----------------------------------------------------------------------------- main


def evaluate(args):
    if args.hellaswag and not args.tokenizer:
        raise ValueError("--hellaswag needs --tokenizer (a .model or tokenizer.json) to turn its text into token ids.")
    for flag in ("seq_len", "batch_size", "max_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be positive, got {getattr(args, flag)}.")
    model, ckpt = load_checkpoint(args.checkpoint)
    device = user_device(args.device)
    model.to(device).eval()
    vocab_size = model.config.vocab_size
    seq_len = args.seq_len if args.seq_len is not None else ckpt["config"].get("seq_len", model.config.seq_len)
    if model.config.pos == "learned" and seq_len > model.config.seq_len:
        raise ValueError(
            f"--seq_len {seq_len} is longer than the checkpoint's learned position table ({model.config.seq_len})."
        )
    tokens, where = eval_tokens(args.data, args.max_tokens, args.token_dtype)
    windows = make_windows(tokens, where, seq_len, vocab_size)
    if args.hellaswag:  # read before the loss is computed, so a bad file costs no time
        tokenizer, items = load_tokenizer(args.tokenizer, vocab_size), load_hellaswag(args.hellaswag)
    loss = mean_loss(model, windows, args.batch_size, device)
    result = {
        "checkpoint": str(args.checkpoint),
        "step": ckpt.get("step"),
        "params": model.num_params(),
        "data": where,
        "seq_len": seq_len,
        "windows": len(windows),
        "tokens": windows[:, 1:].numel(),
        "val_loss": loss,
        "bits_per_token": loss / math.log(2),
    }
    print(f"checkpoint {args.checkpoint}: step {result['step']}, {result['params']:,} parameters, on {device}")
    print(f"data: {where} -> {len(windows):,} windows of {seq_len} + 1 ({result['tokens']:,} predicted tokens)")
    print(f"val loss {loss:.4f} nats/token = {result['bits_per_token']:.4f} bits/token")
    if args.hellaswag:
        result.update(hellaswag(model, items, tokenizer, device, seq_len))
        print(
            f"hellaswag: acc {result['hellaswag_acc']:.4f}, acc_norm {result['hellaswag_acc_norm']:.4f} "
            f"over {result['hellaswag_examples']:,} examples"
        )
    print(json.dumps(result))
    return result


def main(argv=None):
    parser = OneSentenceParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint.pt written by train.py")
    parser.add_argument("--data", required=True, help="a token file, or a folder (see above)")
    parser.add_argument(
        "--token_dtype", default="uint16", choices=tuple(RAW_DTYPES), help="ids of headerless files (%(default)s)"
    )
    parser.add_argument("--seq_len", type=int, default=None, help="window length; default: the checkpoint's")
    parser.add_argument("--batch_size", type=int, default=8, help="windows per forward pass")
    parser.add_argument("--max_tokens", type=int, default=1 << 20, help="tokens read for the loss")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ...; default: cuda if present")
    parser.add_argument("--hellaswag", default=None, help="a HellaSwag .jsonl file")
    parser.add_argument("--tokenizer", default=None, help="the training data's SentencePiece .model or tokenizer.json")
    args = parser.parse_args(argv)
    try:
        return evaluate(args)
    except (ValueError, OSError) as e:  # user errors: one sentence, no traceback, exit 2 as train.py
        fail(e)


if __name__ == "__main__":
    main()
