"""The bench corpus's English text as JSON lines, before any tokenizer: the input of `python data_cli.py prepare`'s
benchmark (BENCHMARKS.md, "Your own data").

    python bench/corpus_text.py --root DEBS/root --out docs.jsonl

../shared/bench/make_corpus.py's own extraction, cleaning, splitting, filtering and shuffle, at its defaults, over the
nine Debian packages its setup.sh names, unpacked with `dpkg-deb -x` under --root; each line is {"source", "text"}.
make_corpus.py then tokenizes exactly these documents, so the two outputs can be set side by side.
"""

import argparse
import hashlib
import json
import pathlib
import random
import sys

MAKE_CORPUS = pathlib.Path(__file__).resolve().parents[2] / "shared" / "bench"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, help="the tree the Debian packages were unpacked into")
    parser.add_argument("--out", required=True, help="the JSON-lines file to write")
    parser.add_argument("--seed", type=int, default=1234, help="make_corpus.py's (%(default)s)")
    args = parser.parse_args()
    sys.path.insert(0, str(MAKE_CORPUS))
    import make_corpus

    make_corpus.ROOT = str(pathlib.Path(args.root).resolve())
    _, raw = make_corpus.collect(make_corpus.ALL_SOURCES, 2)
    docs, seen = [], set()
    for key, text in raw:  # make_corpus.main's cleaning at its default flags
        for piece in make_corpus.split_long(key, make_corpus.normalize(text), 8000, args.seed):
            digest = hashlib.sha1(piece.encode()).digest()
            if len(piece) < 300 or make_corpus.prose_score(piece) < 0.70 or digest in seen:
                continue
            seen.add(digest)
            docs.append((key.split(":", 1)[0], piece))
    random.Random(args.seed).shuffle(docs)
    with open(args.out, "w") as file:
        for source, text in docs:
            file.write(json.dumps({"source": source, "text": text}) + "\n")
    print(f"{len(docs):,} documents, {sum(len(text) for _, text in docs):,} characters -> {args.out}")


if __name__ == "__main__":
    main()
