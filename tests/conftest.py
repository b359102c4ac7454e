"""Fixtures shared by the train.py tests."""

import pytest

import data

VOCAB = 1024  # the synthetic chain's ids stay below this


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    """Two event-format chunk files of the synthetic chain (ids < VOCAB): data.write_synthetic, as a user would."""
    folder = tmp_path_factory.mktemp("tokens")
    data.write_synthetic(folder, 2 << 17, chunk_tokens=1 << 17, vocab_size=VOCAB, n_states=512)
    return folder


def train_tokenizer(folder, sentences, vocab_size):
    """A small SentencePiece BPE model with the event data's ids (unk 0, BOS 1, EOS 2), trained on sentences."""
    import sentencepiece

    (folder / "text.txt").write_text("\n".join(sentences * 3) + "\n")
    sentencepiece.SentencePieceTrainer.train(
        input=str(folder / "text.txt"),
        model_prefix=str(folder / "tok"),
        vocab_size=vocab_size,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return folder / "tok.model", sentencepiece.SentencePieceProcessor(model_file=str(folder / "tok.model"))
