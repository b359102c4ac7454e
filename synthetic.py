"""Synthetic token data: an embedded Markov source whose entropy rate (the best possible loss) is known exactly.

synthetic_tokens draws ids from a sparse Markov chain (BOS_ID starts documents, the other ids avoid 0-2);
synthetic_entropy_nats is its entropy rate; write_synthetic writes it in the event format (`python data_cli.py synth`).
numpy + stdlib only.
"""

import os
import pathlib

import numpy as np

from windows import BOS_ID, TOKEN_DTYPE

SYNTH_STATES = 1024  # few enough that a tiny model on 2 CPU cores nears the floor in ~2 minutes


def _synthetic_probs(n_successors, doc_len):
    """The successor probabilities shared by every state: slot 0 is BOS (a document ends after ~doc_len tokens),
    the rest fall off as 1/rank, like word frequencies."""
    if n_successors < 2 or doc_len <= 1:
        raise ValueError(f"synthetic data needs n_successors >= 2 and doc_len > 1, got {n_successors}, {doc_len}.")
    zipf = 1.0 / np.arange(1, n_successors)
    return np.concatenate([[1.0 / doc_len], (1.0 - 1.0 / doc_len) * zipf / zipf.sum()])


def synthetic_entropy_nats(n_successors=8, doc_len=256):
    """Entropy rate of synthetic_tokens in nats/token: every state has n_successors distinct successors with the
    same probabilities p, so the rate is H(p) whatever the stationary distribution. The forced s -> BOS lane joins
    in synthetic_tokens (>= 64 * doc_len tokens apart) raise the best loss by < log(doc_len) / (64 * doc_len),
    3e-4 nats at the defaults."""
    p = _synthetic_probs(n_successors, doc_len)
    return float(-(p * np.log(p)).sum())


def synthetic_tokens(n_tokens, vocab_size=32000, seed=0, n_states=SYNTH_STATES, n_successors=8, doc_len=256, part=0):
    """n_tokens uint16 ids from a sparse Markov chain over n_states ids of the vocabulary (state 0 is BOS_ID; the
    others avoid ids 0-2). seed fixes the chain, part picks an independent stretch of it (one per file)."""
    if not n_successors < n_states <= vocab_size - 2:
        raise ValueError(
            f"synthetic data needs n_successors < n_states <= vocab_size - 2, got {n_successors}, "
            f"{n_states}, {vocab_size}."
        )
    probs = _synthetic_probs(n_successors, doc_len)
    rng = np.random.default_rng([seed, 0])
    ids = np.concatenate([[BOS_ID], rng.choice(np.arange(3, vocab_size), n_states - 1, replace=False)])
    # distinct non-BOS successors per state; every state but BOS itself (no empty documents) ends docs via slot 0
    successors = rng.random((n_states, n_states - 1)).argpartition(n_successors - 1, axis=1)[:, :n_successors] + 1
    successors[1:, 0] = 0
    successor_of = successors.astype(np.int32).ravel()  # [state * n_successors + slot]

    # many chains ("lanes") advance together: a Python loop over lane length only, vectorised over lanes
    rng = np.random.default_rng([seed, 1, part])
    lanes = int(np.clip(n_tokens // (64 * doc_len), 1, 1024))
    steps = -(-n_tokens // lanes) + 1  # + 1: a lane ending in BOS drops that token
    uniform, slots = rng.random((steps, lanes)), np.zeros((steps, lanes), dtype=np.uint8)
    for edge in np.cumsum(probs)[:-1]:  # inverse CDF; k - 1 compares are ~3x faster than searchsorted here
        slots += uniform >= edge
    walk = np.zeros((steps, lanes), dtype=np.int32)  # row 0: every lane starts a document (state 0 = BOS)
    for t in range(steps - 1):
        np.take(successor_of, walk[t] * n_successors + slots[t], out=walk[t + 1])
    walk = walk.T
    keep = np.ones(walk.shape, dtype=bool)
    keep[:, -1] = walk[:, -1] != 0  # so each lane join (s -> BOS) is a transition the chain can make
    return ids.astype(np.uint16)[walk[keep][:n_tokens]]


def write_synthetic(
    out_dir,
    n_tokens,
    chunk_tokens=1 << 24,
    vocab_size=32000,
    seed=0,
    n_states=SYNTH_STATES,
    n_successors=8,
    doc_len=256,
):
    """Write n_tokens synthetic tokens in the event format: chunk_0001.bin, chunk_0002.bin, ... Never over an
    existing file (a ValueError before anything is written); each chunk is written under a temporary name and
    renamed, so a write that fails (a full disk) leaves no partial chunk that looks valid."""
    if n_tokens < 1 or chunk_tokens < 1:
        raise ValueError(
            f"synthetic data needs at least 1 token and 1 token per chunk, got {n_tokens}, {chunk_tokens}."
        )
    synthetic_tokens(1, vocab_size, seed, n_states, n_successors, doc_len)  # the chain's own checks, first
    out = pathlib.Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a folder to write token files into.")
    paths = [out / f"chunk_{part + 1:04d}.bin" for part in range(-(-n_tokens // chunk_tokens))]
    if existing := [path for path in paths if path.exists() or path.is_symlink()]:
        raise ValueError(f"{existing[0]} exists; synth never replaces token files: write into a new or empty folder.")
    out.mkdir(parents=True, exist_ok=True)
    for part, path in enumerate(paths):
        start = part * chunk_tokens
        tokens = synthetic_tokens(
            min(chunk_tokens, n_tokens - start), vocab_size, seed, n_states, n_successors, doc_len, part=part
        )
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "xb") as file:
                file.write(tokens.astype(TOKEN_DTYPE).tobytes())
            os.rename(tmp, path)
        except OSError as error:
            tmp.unlink(missing_ok=True)
            raise ValueError(
                f"{path} could not be written ({error.strerror or error}); the {part} chunk(s) before it are whole."
            ) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return paths
