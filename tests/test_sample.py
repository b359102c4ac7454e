"""sample.py: a tiny GPT that memorised a few sentences, loaded through the organizers' snippet, continues them."""

import ast
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import sample  # noqa: E402
from conftest import train_tokenizer  # noqa: E402
from model import get_model  # noqa: E402

torch.set_num_threads(1)
SENTENCES = [
    "the red fox jumps over the lazy dog near the quiet river",
    "a small boat sails across the wide lake under grey clouds",
    "my old neighbour bakes fresh bread every sunday morning",
    "two young students solve hard puzzles in the library at night",
]
CONFIG = {"vocab_size": 128, "seq_len": 32, "n_layer": 2, "n_head": 2, "n_embd": 64}


def memorise(docs, config, steps=60):
    """A checkpoint, in train.py's format, of a model trained on BOS-led documents until it knows them."""
    x = torch.zeros(len(docs), max(map(len, docs)), dtype=torch.int64)
    y = torch.full_like(x, -100)  # cross_entropy skips the padding
    for i, doc in enumerate(docs):
        x[i, : len(doc)], y[i, : len(doc) - 1] = torch.tensor(doc), torch.tensor(doc[1:])
    torch.manual_seed(0)
    model = get_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = model(x, y)[1]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {"model": model.state_dict(), "config": config, "step": steps, "tokens": steps * x.numel()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint path, tokenizer path, tokenizer) for a SentencePiece model and a GPT trained here."""
    folder = tmp_path_factory.mktemp("sample")
    model_file, tokenizer = train_tokenizer(folder, SENTENCES, vocab_size=100)
    docs = [[1] + tokenizer.encode(s) for s in SENTENCES]  # BOS-led documents, as in the event data
    assert max(map(len, docs)) <= CONFIG["seq_len"]
    torch.save(memorise(docs, CONFIG), folder / "checkpoint.pt")
    return folder / "checkpoint.pt", model_file, tokenizer


def halves(sentence):
    words = sentence.split()
    return " ".join(words[: len(words) // 2]), " ".join(words[len(words) // 2 :])


def test_greedy_continues_each_memorised_sentence_from_its_first_half(trained, capsys):
    checkpoint, tokenizer_path, tokenizer = trained
    for sentence in SENTENCES:
        start, _ = halves(sentence)
        n_new = len(tokenizer.encode(sentence)) - len(tokenizer.encode(start))
        flags = [
            str(checkpoint),
            "--tokenizer",
            str(tokenizer_path),
            "--prompt",
            start,
            "--temperature",
            "0",
            "--max_new_tokens",
            str(n_new),
            "--num_samples",
            "2",
        ]
        samples = sample.main(flags)
        assert samples[0] == samples[1] == sample.main(flags)[0]  # greedy depends on nothing else
        assert samples[0][0] == tokenizer.bos_id()  # documents started with BOS, so prompts do
        assert tokenizer.decode(samples[0]) == sentence
        assert sentence in capsys.readouterr().out


def test_prompt_from_a_file_and_without_bos(trained, tmp_path):
    checkpoint, tokenizer_path, tokenizer = trained
    start, _ = halves(SENTENCES[1])
    (tmp_path / "prompt.txt").write_text(start + "\n")
    flags = [str(checkpoint), "--tokenizer", str(tokenizer_path), "--temperature", "0", "--max_new_tokens", "3"]
    from_file = sample.main([*flags, "--prompt", f"FILE:{tmp_path / 'prompt.txt'}"])
    assert from_file == sample.main([*flags, "--prompt", start])
    assert from_file[0][1 : 1 + len(tokenizer.encode(start))] == tokenizer.encode(start)
    without_bos = sample.main([*flags, "--prompt", start, "--no_bos"])
    assert without_bos[0][: len(tokenizer.encode(start))] == tokenizer.encode(start)


def test_ids_in_and_ids_out_without_a_tokenizer(trained, capsys):
    checkpoint, _, tokenizer = trained
    doc = [1] + tokenizer.encode(SENTENCES[2])
    prompt = ",".join(map(str, doc[:6]))
    samples = sample.main(
        [
            str(checkpoint),
            "--prompt_ids",
            prompt,
            "--temperature",
            "0",
            "--max_new_tokens",
            str(len(doc) - 6),
            "--num_samples",
            "1",
        ]
    )
    assert samples == [doc]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"{prompt} | {','.join(map(str, doc[6:]))}"


def test_sampling_is_seeded_and_keeps_to_the_top_k(trained):
    checkpoint, _, _ = trained
    flags = [str(checkpoint), "--prompt_ids", "1", "--max_new_tokens", "12", "--num_samples", "4", "--temperature", "5"]
    hot = sample.main([*flags, "--seed", "3", "--top_k", "0"])
    assert hot == sample.main([*flags, "--seed", "3", "--top_k", "0"])
    assert hot != sample.main([*flags, "--seed", "4", "--top_k", "0"])
    assert len({tuple(s) for s in hot}) > 1  # the samples of one batch differ
    # top_k 1 is greedy whatever the temperature
    assert sample.main([*flags, "--top_k", "1"]) == sample.main([*flags[:-2], "--temperature", "0"])


def test_generate_picks_the_argmax_of_the_full_forward_and_leaves_the_model_as_it_was(trained):
    checkpoint, _, _ = trained
    ckpt = torch.load(checkpoint, weights_only=True)
    model = get_model(ckpt["config"])
    model.load_state_dict(ckpt["model"])
    prompt = [1, 5, 9]
    out = sample.generate(model, prompt, 6, temperature=0)
    expected = torch.tensor([prompt])
    for _ in range(6):  # only the last position's logits are computed inside generate; here, all of them
        logits = model(expected)[0]
        assert logits.shape[1] == expected.shape[1]
        expected = torch.cat((expected, logits[:, -1, : CONFIG["vocab_size"]].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_a_prompt_longer_than_the_training_length_works(trained, tmp_path, pos):
    checkpoint, _, tokenizer = trained
    if pos == "learned":  # learned positions stop at seq_len, so the model sees the last seq_len tokens
        config = {**CONFIG, "pos": "learned"}
        torch.save(memorise([[1] + tokenizer.encode(SENTENCES[0])], config, steps=1), tmp_path / "learned.pt")
        checkpoint = tmp_path / "learned.pt"
    doc = [1] + tokenizer.encode(" ".join(SENTENCES))
    assert len(doc) > 2 * CONFIG["seq_len"]
    samples = sample.main(
        [str(checkpoint), "--prompt_ids", ",".join(map(str, doc)), "--max_new_tokens", "5", "--num_samples", "2"]
    )
    assert [s[: len(doc)] for s in samples] == [doc, doc] and all(len(s) == len(doc) + 5 for s in samples)
    assert all(0 <= i < CONFIG["vocab_size"] for s in samples for i in s)


def test_user_errors_are_one_line(trained, tmp_path):
    checkpoint, tokenizer_path, _ = trained
    cases = [
        ([str(tmp_path / "none.pt"), "--prompt_ids", "1"], "does not exist"),
        ([str(checkpoint), "--prompt", "hello"], "needs --tokenizer"),
        ([str(checkpoint), "--prompt_ids", "1,x"], "comma-separated"),
        ([str(checkpoint), "--prompt_ids", "1,500"], r"\[0, 128\)"),
        ([str(checkpoint), "--prompt_ids", ""], "no tokens"),
        ([str(checkpoint), "--tokenizer", str(tokenizer_path), "--prompt", "a", "--prompt_ids", "1"], "not both"),
        ([str(checkpoint), "--tokenizer", str(tokenizer_path), "--prompt", "FILE:/no/such"], "does not exist"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit, match=message):
            sample.main(argv)


def test_without_sentencepiece_it_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # makes `import sentencepiece` fail
    with pytest.raises(ValueError, match="pip install sentencepiece"):
        sample.load_tokenizer("tokenizer.model", 32000)


def test_sample_imports_only_model_and_eval_of_ours():
    ours = {path.stem for path in REPO.glob("*.py")}
    imported = set()
    for node in ast.walk(ast.parse((REPO / "sample.py").read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported & ours == {"eval"}  # eval.py imports model.py alone: the organizers' view


# ----------------------------------------------------------------------------- odd flags and files


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    """(folder, model): a tiny GPT with every weight random, saved as random.pt, and its twin with a NaN weight."""
    folder = tmp_path_factory.mktemp("random")
    torch.manual_seed(0)
    model = get_model(CONFIG)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    torch.save({"model": model.state_dict(), "config": CONFIG}, folder / "random.pt")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"][3, 0] = float("nan")
    torch.save({"model": state, "config": CONFIG}, folder / "nan.pt")
    (folder / "a_folder").mkdir()
    (folder / "binary").write_bytes(bytes(range(128, 256)))  # not UTF-8
    return folder, model


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--top_k", "-1"], "--top_k must be an integer >= 0 (0: every token), got -1."),
        (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0: greedy), got nan."),
        (["--temperature", "inf"], "--temperature must be a finite number >= 0 (0: greedy), got inf."),
        (["--temperature", "-0.5"], "--temperature must be a finite number >= 0 (0: greedy), got -0.5."),
        (["--max_new_tokens", "-1"], "--max_new_tokens must be an integer >= 0, got -1."),
        (["--num_samples", "0"], "--num_samples must be an integer >= 1, got 0."),
        (["--seed", "-1"], "--seed must be an integer in [0, 2**64), got -1."),
        (["--seed", str(2**64)], f"--seed must be an integer in [0, 2**64), got {2**64}."),
        (["CKPT=a_folder"], "a_folder is a folder, not a file."),
        (["CKPT=binary"], "is not a readable torch checkpoint"),
        (["CKPT=nan.pt"], "nan.pt holds NaN or inf weights; there is nothing to sample from."),
        (["--device", "tpu"], "--device tpu is not a device name such as cpu, cuda or cuda:1."),
        (["--device", "meta"], "--device meta is not a device this machine can run the model on."),
        (["--tokenizer", "DIR/binary", "--prompt", "a"], "--tokenizer DIR/binary is not a SentencePiece .model file."),
        (["--tokenizer", "DIR/a_folder", "--prompt", "a"], "--tokenizer DIR/a_folder is a folder, not a file."),
        (
            ["--tokenizer", "TOK", "--prompt", "FILE:DIR/a_folder"],
            "--prompt file DIR/a_folder is a folder, not a file.",
        ),
        (["--tokenizer", "TOK", "--prompt", "FILE:DIR/binary"], "--prompt file DIR/binary is not UTF-8 text."),
        *([] if torch.cuda.is_available() else [(["--device", "cuda:1"], "no CUDA device is visible")]),
    ],
)
def test_odd_flags_and_files_are_one_sentence_and_exit_2(trained, random_model, capsys, flags, message):
    folder, _ = random_model
    checkpoint = folder / "random.pt"
    if flags[0].startswith("CKPT="):
        checkpoint, flags = folder / flags[0][len("CKPT=") :], flags[1:]
    flags = [flag.replace("DIR", str(folder)).replace("TOK", str(trained[1])) for flag in flags]
    with pytest.raises(SystemExit) as exit_:
        sample.main([str(checkpoint), *(["--prompt_ids", "1,2"] if "--prompt" not in flags else []), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert message.replace("DIR", str(folder)) in err[0], err


def test_a_temperature_too_small_to_divide_by_samples_the_top_token(random_model):
    _, model = random_model
    greedy = sample.generate(model, [1, 5], 8, temperature=0, num_samples=2)
    assert torch.equal(sample.generate(model, [1, 5], 8, temperature=1e-45, num_samples=2), greedy)


def test_samples_stay_within_the_ids_the_tokenizer_can_decode(trained, random_model, capsys):
    _, tokenizer_path, tokenizer = trained
    folder, model = random_model
    pieces = tokenizer.get_piece_size()
    assert pieces < CONFIG["vocab_size"]
    hot = dict(temperature=5.0, top_k=0, num_samples=4, generator=torch.Generator().manual_seed(0))
    assert sample.generate(model, [1], 30, **hot).max() >= pieces  # without the limit, undecodable ids come up
    flags = ["--tokenizer", str(tokenizer_path), "--prompt", "the red", "--temperature", "5", "--top_k", "0"]
    samples = sample.main([str(folder / "random.pt"), *flags, "--max_new_tokens", "30", "--num_samples", "4"])
    assert max(max(s) for s in samples) < pieces and "--- sample 4 ---" in capsys.readouterr().out


def test_a_tokenizer_json_prompts_decodes_and_scores_hellaswag_as_a_sentencepiece_model_does(tmp_path, capsys):
    """A Hugging Face byte-level BPE (<s> = 1 its BOS): sample.py's prompt starts with it and the greedy text is the
    memorised sentence; eval.py's HellaSwag gives each ending its leading space and picks the memorised one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    import eval as eval_py

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(
        SENTENCES * 3, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>"], initial_alphabet=alphabet)
    )
    bpe.save(str(tmp_path / "tokenizer.json"))
    tokenizer = eval_py.load_tokenizer(tmp_path / "tokenizer.json", 384)
    assert tokenizer.bos_id() == 1 and tokenizer.get_piece_size() == bpe.get_vocab_size()
    config = {**CONFIG, "vocab_size": 384}
    torch.save(memorise([[1] + tokenizer.encode(s) for s in SENTENCES], config), tmp_path / "checkpoint.pt")
    model, _ = eval_py.load_checkpoint(tmp_path / "checkpoint.pt")
    for sentence in SENTENCES:
        start, rest = halves(sentence)
        n_new = len(tokenizer.encode(sentence)) - len(tokenizer.encode(start))
        flags = ["--tokenizer", str(tmp_path / "tokenizer.json"), "--prompt", start, "--temperature", "0"]
        samples = sample.main([str(tmp_path / "checkpoint.pt"), *flags, "--max_new_tokens", str(n_new)])
        assert samples[0][0] == 1 and tokenizer.decode(samples[0]) == sentence
        others = [halves(other)[1] for other in SENTENCES if other != sentence]
        scores = eval_py.hellaswag(model.eval(), [(start, [rest, *others], 0)], tokenizer, "cpu", 32)
        assert scores["hellaswag_acc"] == scores["hellaswag_acc_norm"] == 1.0
