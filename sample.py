"""Generate text from a checkpoint, loaded the way the organizers load it (model.py alone).

    python sample.py checkpoint.pt --tokenizer tokenizer.model --prompt "The meaning of life is"
    python sample.py checkpoint.pt --tokenizer tokenizer.model --prompt FILE:prompt.txt --temperature 0
    python sample.py checkpoint.pt --tokenizer tokenizer.json --prompt "Once upon a time"     # a Hugging Face one
    python sample.py checkpoint.pt --prompt_ids 1,450,4996 --max_new_tokens 20     # token ids in and out

With --tokenizer the prompt is text (or FILE:path, the text of that file), it starts with the tokenizer's BOS,
as every document does in data that marks documents with it (--no_bos leaves it out), and samples print as text.
Without one, --prompt_ids are used exactly as given and samples print as the prompt's ids | the new ids.
--temperature 0 is greedy decoding, so its output depends on nothing else. Generation may run past the training
length: RoPE has no length limit (a model with learned positions sees the last seq_len tokens). There is no KV
cache: each new token reruns the blocks on the whole sequence (measured on one CPU thread at 512 tokens: 50 ms
per token for l4w128, 3 s for l12w768; a cache would pay only for the large shapes, sampled on a CPU).
"""

import argparse
import math

import torch

from eval import OneSentenceParser, fail, load_checkpoint, load_tokenizer, user_device, user_file


@torch.no_grad()
def generate(
    model, prompt, max_new_tokens, temperature=1.0, top_k=None, num_samples=1, generator=None, vocab_size=None
):
    """(num_samples, len(prompt) + max_new_tokens) token ids: the prompt, then each sample's continuation.
    New ids lie below vocab_size (default: the model's), e.g. a tokenizer's piece count, so it can decode them."""
    cfg = model.config
    vocab_size = vocab_size or cfg.vocab_size
    idx = torch.tensor(prompt, dtype=torch.int64, device=next(model.parameters()).device).repeat(num_samples, 1)
    # the model computes logits at every position, and only the last is needed: cutting the final norm's output
    # to it makes the head's cost independent of length (7x faster at 512 tokens for l4w128 on a CPU)
    last_only = model.norm_f.register_forward_hook(lambda module, inputs, out: out[:, -1:])
    try:
        for _ in range(max_new_tokens):
            context = idx if cfg.pos == "rope" else idx[:, -cfg.seq_len :]
            logits = model(context)[0][:, -1, :vocab_size]  # past it: the head's padding, ids no tokenizer piece has
            if temperature == 0:
                token = logits.argmax(dim=-1, keepdim=True)
            else:
                scaled = logits / temperature
                if not scaled.isfinite().all():  # so small a temperature overflows: its limit, the top logits alone
                    scaled = torch.zeros_like(logits).masked_fill(logits < logits.amax(-1, keepdim=True), float("-inf"))
                logits = scaled
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                token = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
            idx = torch.cat((idx, token), dim=1)
    finally:
        last_only.remove()
    return idx


def prompt_tokens(args, tokenizer, vocab_size):
    """The prompt's token ids from --prompt (text, through the tokenizer) or --prompt_ids (as given)."""
    if args.prompt is not None and args.prompt_ids is not None:
        raise ValueError("give --prompt or --prompt_ids, not both.")
    if args.prompt_ids is not None:
        try:
            ids = [int(i) for i in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"--prompt_ids {args.prompt_ids!r} is not a comma-separated list of integers.") from None
    elif tokenizer is None:
        raise ValueError("--prompt is text, which needs --tokenizer TOKENIZER.model; without one give --prompt_ids.")
    else:
        text = args.prompt or ""
        if text.startswith("FILE:"):
            path = user_file(text[len("FILE:") :], "--prompt file")
            try:
                text = path.read_text().rstrip("\n")
            except UnicodeDecodeError:
                raise ValueError(f"--prompt file {path} is not UTF-8 text.") from None
        bos = [] if args.no_bos or tokenizer.bos_id() < 0 else [tokenizer.bos_id()]
        ids = bos + tokenizer.encode(text)
    if not ids:
        raise ValueError("the prompt has no tokens; generation needs at least one to start from.")
    if not all(0 <= i < vocab_size for i in ids):
        raise ValueError(f"--prompt_ids must lie in [0, {vocab_size}), the model's vocabulary.")
    return ids


def check_flags(args):
    """Each numeric flag in its range, or one sentence naming it."""
    for flag, ok, allowed in [
        ("max_new_tokens", args.max_new_tokens >= 0, "an integer >= 0"),
        ("num_samples", args.num_samples >= 1, "an integer >= 1"),
        ("temperature", math.isfinite(args.temperature) and args.temperature >= 0, "a finite number >= 0 (0: greedy)"),
        ("top_k", args.top_k >= 0, "an integer >= 0 (0: every token)"),
        ("seed", 0 <= args.seed < 2**64, "an integer in [0, 2**64)"),  # what torch's generator takes
    ]:
        if not ok:
            raise ValueError(f"--{flag} must be {allowed}, got {getattr(args, flag)}.")


def sample(args):
    check_flags(args)
    model, ckpt = load_checkpoint(args.checkpoint)  # the organizers' snippet, with one-sentence errors
    if not all(p.isfinite().all() for p in model.parameters()):  # they would make every probability NaN
        raise ValueError(f"checkpoint {args.checkpoint} holds NaN or inf weights; there is nothing to sample from.")
    device = user_device(args.device)
    model.to(device).eval()
    vocab_size = model.config.vocab_size
    tokenizer = load_tokenizer(args.tokenizer, vocab_size) if args.tokenizer else None
    prompt = prompt_tokens(args, tokenizer, vocab_size)
    how = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, top_k {args.top_k}, seed {args.seed}"
    print(
        f"checkpoint {args.checkpoint}: step {ckpt.get('step')}, {model.num_params():,} parameters, on {device} | "
        f"prompt {len(prompt)} tokens, training length {model.config.seq_len} | {how}"
    )
    generator = torch.Generator(device=device).manual_seed(args.seed)
    pieces = tokenizer.get_piece_size() if tokenizer is not None else None  # may be fewer than the model's ids
    out = generate(
        model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.num_samples, generator, pieces
    )
    samples = out.tolist()
    for number, ids in enumerate(samples, 1):
        print(f"--- sample {number} ---")
        if tokenizer is not None:
            print(tokenizer.decode(ids))  # decoded whole, so the space between prompt and continuation stays
        else:
            print(",".join(map(str, ids[: len(prompt)])), "|", ",".join(map(str, ids[len(prompt) :])))
    return samples


def main(argv=None):
    parser = OneSentenceParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint.pt written by train.py")
    parser.add_argument("--tokenizer", default=None, help="the training data's SentencePiece .model or tokenizer.json")
    parser.add_argument(
        "--prompt", default=None, help="prompt text, or FILE:path for a file's text (needs --tokenizer)"
    )
    parser.add_argument("--prompt_ids", default=None, help="prompt token ids, comma-separated, e.g. 1,450,4996")
    parser.add_argument("--no_bos", action="store_true", help="do not start a --prompt with the tokenizer's BOS")
    parser.add_argument("--max_new_tokens", type=int, default=200, help="tokens generated per sample")
    parser.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0: greedy")
    parser.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest tokens; 0: all")
    parser.add_argument("--num_samples", type=int, default=3, help="continuations of the prompt, one batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ...; default: cuda if present")
    args = parser.parse_args(argv)
    try:
        return sample(args)
    except (ValueError, OSError) as e:  # user errors: one sentence, no traceback, exit 2 as eval.py
        fail(e)


if __name__ == "__main__":
    main()
