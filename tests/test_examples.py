"""Smoke and unit tests of the example scripts (examples/): the ListOps generator and tokenizer, the byte tokenizer,
the LM leak check, the metric module, run_classification.py / run_clm.py end to end on small files the tests write,
and a ``--quick`` run of every reproduce.py table (tiny slices, 2 optimizer steps).

Tables that need the offline data (``data`` in $CTA_SHARED_DIR, default ../shared, or $CTA_DATA_DIR) are skipped
with a reason when it is absent;
ListOps needs no data.
"""

import csv
import gzip
import json
import math
import os
import random
import statistics
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
sys.path.insert(0, EXAMPLES)

import common  # noqa: E402
import listops  # noqa: E402
import reproduce  # noqa: E402
import run_classification  # noqa: E402
import run_clm  # noqa: E402

import cta  # noqa: E402
import shared_data  # noqa: E402  (tests/: the offline paths beside a checkout)

DATA_DIR = common.default_data_dir()
pytestmark = pytest.mark.shared_data  # reads $CTA_SHARED_DIR: CI reruns this file with an empty one


def _have(*parts):
    return os.path.exists(os.path.join(DATA_DIR, *parts))


def _tokenizer_available():
    return os.path.isdir(common.resolve_tokenizer_path(common.PAPER_TOKENIZER))


NEEDS = {
    "table1": [("imdb", "test.jsonl.gz"), ("sst2", "validation.jsonl.gz"), ("ag_news", "test.jsonl.gz")],
    "lra_text": [("imdb", "test.jsonl.gz")],
    "lra_text_4k": [("imdb", "test.jsonl.gz")],
    "placement": [("imdb", "test.jsonl.gz")],
    "listops": [],
}


# ------------------------------------------------------------------------------------------------ ListOps
def _independent_eval(tokens):
    """Recursive-descent evaluator, written independently of listops.evaluate_tokens."""

    def parse(i):
        tok = tokens[i]
        if tok.isdigit():
            return int(tok), i + 1
        assert tok.startswith("["), tok
        args, i = [], i + 1
        while tokens[i] != "]":
            v, i = parse(i)
            args.append(v)
        op = tok[1:]
        if op == "MIN":
            return min(args), i + 1
        if op == "MAX":
            return max(args), i + 1
        if op == "MED":
            return int(statistics.median(args)), i + 1
        if op == "SM":
            return sum(args) % 10, i + 1
        raise AssertionError(op)

    value, end = parse(0)
    assert end == len(tokens)
    return value


def test_listops_hand_cases():
    assert listops.evaluate_tokens("[MAX 2 9 [MIN 4 7 ] 0 ]".split()) == 9
    assert listops.evaluate_tokens("[MED 1 2 3 4 ]".split()) == 2  # int(np.median) = int(2.5)
    assert listops.evaluate_tokens("[MED 3 9 1 ]".split()) == 3
    assert listops.evaluate_tokens("[SM 5 6 7 ]".split()) == 8
    assert listops.evaluate_tokens("[MIN [SM 9 9 ] [MAX 1 3 ] ]".split()) == 3
    assert listops.evaluate_tokens(["7"]) == 7
    with pytest.raises(ValueError):
        listops.evaluate_tokens("[MAX 2 9".split())


def test_listops_deterministic_and_correct():
    a = listops.generate(40, seed=3, min_length=20, max_length=300)
    b = listops.generate(40, seed=3, min_length=20, max_length=300)
    c = listops.generate(40, seed=4, min_length=20, max_length=300)
    assert a == b
    assert a != c
    assert len({r["text"] for r in a}) == 40  # unique
    for row in a + c:
        tokens = row["text"].split()
        assert 20 <= len(tokens) <= 300
        assert row["label"] == _independent_eval(tokens)
        assert 0 <= row["label"] <= 9
        assert set(tokens) <= set(listops.VOCAB)
    ids = listops.encode(a[0]["text"])
    assert min(ids) >= 1 and max(ids) < len(listops.VOCAB)  # 0 is padding


def test_listops_lra_lengths_and_disjoint_splits():
    rows = listops.generate(5, seed=0)  # LRA defaults: 500..2000 tokens
    assert all(500 <= len(r["text"].split()) <= 2000 for r in rows)
    assert all(r["label"] == _independent_eval(r["text"].split()) for r in rows)
    splits = listops.generate_splits(30, 10, 10, seed=1, min_length=10, max_length=100)
    texts = [{r["text"] for r in splits[s]} for s in ("train", "validation", "test")]
    assert not (texts[0] & texts[1]) and not (texts[0] & texts[2]) and not (texts[1] & texts[2])
    assert splits == listops.generate_splits(30, 10, 10, seed=1, min_length=10, max_length=100)


def test_listops_dataset_is_cached_and_deterministic(tmp_path):
    a = listops.load_dataset(12, 4, seed=2, min_length=10, max_length=60, cache_dir=str(tmp_path))
    b = listops.load_dataset(12, 4, seed=2, min_length=10, max_length=60, cache_dir=str(tmp_path))
    splits = listops.generate_splits(12, 0, 4, seed=2, min_length=10, max_length=60)
    assert a["train"].to_list() == b["train"].to_list() == splits["train"]
    assert a["test"].to_list() == splits["test"]


# ------------------------------------------------------------------------------------------------ tokenizers
def test_byte_tokenizer_is_byt5_bytes():
    from transformers import ByT5Tokenizer

    tok = common.load_tokenizer("byte")
    assert isinstance(tok, ByT5Tokenizer) and len(tok) == 259 and tok.pad_token_id == 0
    for text in ["hello world", "naïve café — 日本語", "<br />a\tb\n", ""]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == [b + 3 for b in text.encode("utf-8")]  # bytes, not characters
        assert tok.decode(ids) == text
    assert tok("abcdef", truncation=True, max_length=4)["input_ids"] == [ord(c) + 3 for c in "abc"] + [1]  # + eos


def test_listops_tokenizer_pads_saves_and_reloads(tmp_path):
    from transformers import AutoTokenizer, DataCollatorWithPadding

    tok = common.load_tokenizer("listops")
    texts = ["[MAX 2 9 [MIN 4 7 ] 0 ]", "[SM 5 6 ]"]
    assert [tok(t)["input_ids"] for t in texts] == [listops.encode(t) for t in texts]
    assert len(tok) == len(listops.VOCAB) and tok.pad_token_id == 0
    batch = DataCollatorWithPadding(tok, pad_to_multiple_of=4)([dict(tok(t), labels=i) for i, t in enumerate(texts)])
    assert batch["input_ids"].tolist()[1] == listops.encode(texts[1]) + [0] * 8  # 9 tokens, padded to 12
    assert batch["attention_mask"].tolist()[1] == [1] * 4 + [0] * 8
    assert batch["labels"].tolist() == [0, 1]
    tok.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)(texts[0])["input_ids"] == listops.encode(texts[0])
    with pytest.raises(Exception, match="UNK"):
        tok("[FOO 1 ]")


def test_accuracy_metric_module():
    metric = common.load_accuracy_metric()
    assert metric.compute(predictions=[0, 1, 2, 2, 1], references=[0, 1, 1, 2, 0]) == {"accuracy": 0.6}


def test_common_holds_no_data_classes():
    import inspect

    own = [name for name, obj in vars(common).items() if inspect.isclass(obj) and obj.__module__ == common.__name__]
    assert sorted(own) == ["DataArguments", "ModelArguments", "PretrainedArguments"]  # argument dataclasses only


# ------------------------------------------------------------------------------------------------ leak check
def _make_leaky(model):
    """Turns a causal CTA LM into a leaky one: bidirectional attention masks and attention modules."""
    model.config.is_causal = False
    model.model.config.is_causal = False
    for module in model.modules():
        if hasattr(module, "is_causal"):
            module.is_causal = False
    return model


def _tiny_lm(**kwargs):
    torch.manual_seed(0)
    config = cta.CTAConfig.paper_encoder(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                         **kwargs)
    return cta.CTAForCausalLM(config).eval()


@pytest.mark.parametrize("pde_type", ["diffusion", "wave", "reaction_diffusion", "advection_diffusion"])
def test_leak_check_passes_for_causal_model(pde_type):
    model = _tiny_lm(pde_type=pde_type, pde_steps=4, pde_placement=["embedding", "block_output"])
    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(0))
    result = run_clm.leak_check(model, ids)
    assert result["passed"], result
    assert result["max_abs_diff"] <= 1e-5


def test_leak_check_catches_leaky_model():
    # A deliberately leaky "causal" LM: its attention is switched to bidirectional after construction.
    model = _make_leaky(_tiny_lm(pde_steps=1))
    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(0))
    result = run_clm.leak_check(model, ids)
    assert not result["passed"]
    assert result["max_abs_diff"] > result["tolerance"]


class _FutureMeanLM(torch.nn.Module):
    """Leaks by construction: every position's logits include the mean embedding of the whole sequence."""

    def __init__(self, vocab=50):
        super().__init__()
        self.config = type("C", (), {"vocab_size": vocab})()
        self.emb = torch.nn.Embedding(vocab, 8)
        self.head = torch.nn.Linear(8, vocab)

    def forward(self, input_ids, **kwargs):
        h = self.emb(input_ids)
        return type("O", (), {"logits": self.head(h + h.mean(1, keepdim=True))})()


def test_leak_check_catches_future_mean_model():
    result = run_clm.leak_check(_FutureMeanLM(), torch.randint(0, 50, (2, 16)))
    assert not result["passed"]


@pytest.mark.skipif(not _have("wikitext2", "train.txt.gz") or not _tokenizer_available(),
                    reason="offline WikiText-2 / bert-base-uncased tokenizer not found "
                           "(set CTA_SHARED_DIR or CTA_DATA_DIR)")
def test_run_clm_refuses_to_report_when_leaky(tmp_path, monkeypatch):
    original = run_clm.build_model

    def leaky_build(*args, **kwargs):
        return _make_leaky(original(*args, **kwargs))

    monkeypatch.setattr(run_clm, "build_model", leaky_build)
    out = tmp_path / "leaky"
    argv = reproduce.QUICK_LM + ["--block_size", "32", "--output_dir", str(out)]
    with pytest.raises(SystemExit) as exc:
        run_clm.main(argv)
    assert exc.value.code == 3
    results = json.loads((out / "run_results.json").read_text())
    assert results["leak_check"]["passed"] is False
    assert "LEAK CHECK FAILED" in results["error"]
    assert "test_perplexity" not in results and "eval_perplexity" not in results


# ------------------------------------------------------------------------------------------------ user files
TINY = ["--hidden_size", "16", "--intermediate_size", "32", "--num_attention_heads", "2", "--num_hidden_layers", "1",
        "--max_steps", "2", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8",
        "--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "true", "--dataloader_num_workers", "0",
        "--tokenizer_name", "byte"]
GOOD = ["great fun", "loved it", "wonderful acting", "a joy to watch", "brilliant film"]
BAD = ["boring mess", "hated it", "awful plot", "a waste of time", "terrible film"]


def _reviews(n, labels):
    return [(GOOD[i % 5] if i % 2 == 0 else BAD[i % 5], labels[i % 2]) for i in range(n)]


def _write(path, rows, columns, with_labels=True):
    """rows of (text, label) as csv (header ``columns``) or JSON Lines (.jsonl / .jsonl.gz)."""
    columns = columns if with_labels else columns[:1]
    records = [dict(zip(columns, row)) for row in rows]
    if str(path).endswith(".csv"):
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(records)
    else:
        with (gzip.open if str(path).endswith(".gz") else open)(path, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


@pytest.mark.parametrize("ext,labels", [("csv", ("pos", "neg")), ("jsonl.gz", (7, 2))])
def test_run_classification_on_user_files(tmp_path, ext, labels):
    columns = ("review", "sentiment")
    train = _write(tmp_path / f"my.{ext}", _reviews(24, labels), columns)
    dev = _write(tmp_path / f"my_dev.{ext}", _reviews(10, labels), columns)
    test = _write(tmp_path / f"my_test.{ext}", _reviews(6, labels), columns, with_labels=False)
    out = tmp_path / "out"
    results = run_classification.main(
        ["--train_file", train, "--validation_file", dev, "--test_file", test, "--text_column_name", "review",
         "--label_column_name", "sentiment", "--max_seq_length", "32", "--output_dir", str(out)] + TINY)
    names = sorted(str(label) for label in labels)  # the label list comes from the data, sorted
    assert results["labels"] == names
    evaluation = json.loads((out / "eval_results.json").read_text())
    assert 0.0 <= evaluation["eval_accuracy"] <= 1.0 and evaluation["eval_samples"] == 10
    assert json.loads((out / "all_results.json").read_text())["eval_accuracy"] == evaluation["eval_accuracy"]
    lines = (out / "predict_results.txt").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 1 + 6
    assert [int(line.split("\t")[0]) for line in lines[1:]] == list(range(6))
    assert {line.split("\t")[1] for line in lines[1:]} <= set(names)  # predictions map back to the data's labels
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {str(i): name for i, name in enumerate(names)}
    assert config["label2id"] == {name: i for i, name in enumerate(names)}
    for name in ("train_results.json", "run_results.json", "tokenizer_config.json"):
        assert (out / name).exists(), name


def test_run_classification_needs_data(tmp_path):
    with pytest.raises(ValueError, match="--train_file"):
        run_classification.main(["--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="must end in one of"):
        run_classification.main(["--train_file", str(tmp_path / "x.parquet"), "--output_dir", str(tmp_path)])


def test_missing_text_or_label_column_lists_the_columns_the_file_has(tmp_path):
    """A text / label column the file lacks is a ValueError naming the argument and the file's columns (it was a bare
    KeyError), in run_classification.py, run_clm.py and finetune_patched_llama.py."""
    train = _write(tmp_path / "my.csv", _reviews(8, ("pos", "neg")), ("review", "opinion"))
    dev = _write(tmp_path / "my_dev.csv", _reviews(4, ("pos", "neg")), ("review", "opinion"))
    base = ["--train_file", train, "--validation_file", dev, "--output_dir", str(tmp_path / "out")] + TINY
    has = r"its columns are \['review', 'opinion'\]"
    with pytest.raises(ValueError, match=rf"--label_column_name 'sentiment' is not a column of the train data: {has}"):
        run_classification.main(base + ["--text_column_name", "review", "--label_column_name", "sentiment"])
    with pytest.raises(ValueError, match=rf"--label_column_name 'label' .*{has}"):  # the default name
        run_classification.main(base + ["--text_column_name", "review"])
    with pytest.raises(ValueError, match=rf"--text_column_name 'body' .*{has}"):
        run_classification.main(base + ["--text_column_name", "body", "--label_column_name", "opinion"])
    only_labels = _write(tmp_path / "labels.csv", [("pos",), ("neg",)], ("opinion",))
    with pytest.raises(ValueError, match=r"No text column.*\['opinion'\].*--text_column_name"):
        run_classification.main(["--train_file", only_labels, "--label_column_name", "opinion", "--output_dir",
                                 str(tmp_path / "out")] + TINY)

    lm = tmp_path / "lm.jsonl"
    lm.write_text("".join(json.dumps({"content": f"{GOOD[i % 5]} {i}"}) + "\n" for i in range(20)))
    with pytest.raises(ValueError, match=r"--text_column_name 'text' .*its columns are \['content'\]"):
        run_clm.main(["--train_file", str(lm), "--validation_file", str(lm), "--block_size", "16", "--output_dir",
                      str(tmp_path / "lm-out")] + TINY)
    pytest.importorskip("peft")
    import finetune_patched_llama

    data_args = finetune_patched_llama.DataTrainingArguments(train_file=str(lm), validation_file=str(lm),
                                                             text_column_name="story")
    with pytest.raises(ValueError, match=r"--text_column_name 'story' .*its columns are \['content'\]"):
        finetune_patched_llama.load_raw_datasets(data_args, str(tmp_path / "cache"))


@pytest.mark.parametrize("ext", ["txt", "jsonl"])
def test_run_clm_on_user_files(tmp_path, ext):
    lines = [f"{GOOD[i % 5]} and {BAD[(i * 3) % 5]} number {i}" if i % 7 else "" for i in range(120)]
    files = {}
    for split, part in (("train", lines), ("validation", lines[:40]), ("test", lines[40:80])):
        path = tmp_path / f"{split}.{ext}"
        if ext == "txt":
            path.write_text("\n".join(part) + "\n")
        else:
            path.write_text("".join(json.dumps({"content": line}) + "\n" for line in part))
        files[split] = str(path)
    out = tmp_path / "out"
    argv = ["--train_file", files["train"], "--validation_file", files["validation"], "--test_file", files["test"],
            "--block_size", "16", "--save_strategy", "no", "--output_dir", str(out)] + TINY
    if ext == "jsonl":
        argv += ["--text_column_name", "content"]
    results = run_clm.main(argv)
    # every non-empty line is its bytes (ids byte + 3) and eos; the stream is cut into blocks of 16
    tokens = sum(len(line.encode()) + 1 for line in lines if line.strip())
    assert results["num_train_blocks"] == tokens // 16
    assert results["leak_check"]["passed"]
    evaluation = json.loads((out / "eval_results.json").read_text())
    assert evaluation["eval_perplexity"] == pytest.approx(2.718281828 ** evaluation["eval_loss"], rel=1e-6)
    assert json.loads((out / "test_results.json").read_text())["test_perplexity"] == results["test_perplexity"]


def test_run_clm_reports_the_best_checkpoint_with_reproduces_best_checkpoint_flags(tmp_path):
    """The data-fraction table's runs (reproduce.BEST_CHECKPOINT) evaluate every epoch and report the checkpoint of
    the lowest validation loss: a learning rate that makes later epochs worse must not move the reported loss."""
    lines = [f"{GOOD[i % 5]} and {BAD[(i * 3) % 5]} number {i}" for i in range(120)]
    # Validation text of random bytes: the more the model learns the training text, the worse it predicts these,
    # so the first epoch is the best one and the last one is not.
    noise = random.Random(0)
    validation = ["".join(chr(noise.randrange(33, 127)) for _ in range(40)) for _ in range(40)]
    files = {}
    for split, part in (("train", lines), ("validation", validation)):
        files[split] = tmp_path / f"{split}.txt"
        files[split].write_text("\n".join(part) + "\n")
    out = tmp_path / "out"
    tiny = [a for a in TINY]
    tiny[tiny.index("--max_steps") + 1] = "-1"
    argv = (["--train_file", str(files["train"]), "--validation_file", str(files["validation"]), "--block_size", "16",
             "--num_train_epochs", "3", "--learning_rate", "0.01", "--save_strategy", "epoch", "--output_dir", str(out)]
            + tiny + reproduce.BEST_CHECKPOINT)
    results = run_clm.main(argv)
    last = max(out.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    state = json.loads((last / "trainer_state.json").read_text())
    per_epoch = [h["eval_loss"] for h in state["log_history"] if "eval_loss" in h and "epoch" in h][:3]
    assert len(per_epoch) == 3 and per_epoch[-1] > min(per_epoch)
    assert state["best_metric"] == pytest.approx(min(per_epoch))
    assert results["eval_loss"] == pytest.approx(min(per_epoch), rel=1e-5)


def test_mark_unstable_withholds_means_of_seeds_far_apart():
    def cell(row, variant, values):
        return dict(row=row, variant=variant, values=values, mean=statistics.mean(values), delta_vs_baseline=0.0)

    data = dict(higher_is_better=False, baseline_variant="base", cells=[
        cell("a", "base", [100.0, 110.0]), cell("a", "cta", [90.0, 400.0]),
        cell("b", "base", [50.0, 500.0]), cell("b", "cta", [60.0, 61.0])])
    flags = [c["unstable"] for c in reproduce.mark_unstable(data)["cells"]]
    assert flags == [False, True, True, False]
    assert [c["delta_vs_baseline"] for c in data["cells"]] == [0.0, None, None, None]
    accuracy = dict(higher_is_better=True, baseline_variant="base", cells=[cell("a", "base", [10.0, 90.0])])
    assert reproduce.mark_unstable(accuracy)["cells"][0]["unstable"] is False
    assert "unstable: seeds span 90.00–400.00" in reproduce.render_markdown(dict(
        data, title="t", metric="test_perplexity", metric_scale=1.0, settings={}, table="t",
        cells=[dict(c, n=2, std=0.0, failed=[], paper=None, runs=[]) for c in data["cells"]]))


STORIES260K = str(shared_data.STORIES260K)


def test_finetune_patched_llama_on_user_files(tmp_path):
    pytest.importorskip("peft")
    import finetune_patched_llama
    from transformers import AutoTokenizer

    stories = [f"Once upon a time there was a cat called Tom {i}. Tom was happy." for i in range(40)]
    for split, part in (("train", stories), ("validation", stories[:12])):
        (tmp_path / f"{split}.txt").write_text("".join(f"{story}\n<|endoftext|>\n" for story in part))
    result = finetune_patched_llama.main(
        ["--model_name_or_path", STORIES260K, "--train_file", str(tmp_path / "train.txt"), "--validation_file",
         str(tmp_path / "validation.txt"), "--block_size", "32", "--max_steps", "1", "--seeds", "0", "--modes",
         "lora_pde,pde", "--per_device_train_batch_size", "4", "--disable_tqdm", "true",
         "--results_dir", str(tmp_path / "results"), "--output_dir", str(tmp_path / "out"), "--save_models"])
    # saved as a receiver loads them: the LoRA + PDE adapter onto the plain model, the PDE-only model patched
    assert all(run["reload_max_abs_logit_diff"] < 1e-5 for run in result["runs"]), result["runs"]
    tokenizer = AutoTokenizer.from_pretrained(STORIES260K)
    tokens = sum(len(ids) + 1 for ids in tokenizer(stories)["input_ids"])  # each story: <s> ... </s>
    assert result["train_blocks"] == tokens // 32
    assert set(result["summary"]) == {"lora_pde", "pde"}
    assert result["summary"]["pde"]["trainable_parameters"] < result["summary"]["lora_pde"]["trainable_parameters"]
    assert (tmp_path / "results" / "finetune_patched_llama.md").exists()


def test_pretrained_study_smoke(tmp_path):
    """``--study pretrained --smoke``: the whole study (untrained evaluations, the PDE learning-rate sweep on the
    validation split, every mode x init x seed, test perplexity at two lengths, the kept adapter, the report) on
    stories260K and a slice of the demo data, on CPU; the report-only pass rewrites the same file from the runs."""
    pytest.importorskip("peft")
    import finetune_patched_llama
    import pretrained_study

    common_args = ["--study", "pretrained", "--smoke", "--output_dir", str(tmp_path / "out"), "--disable_tqdm", "true",
                   "--study_types", "diffusion"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (the tiny model's matmuls: threads only contend, on a busy machine many times over)
    try:
        result = finetune_patched_llama.main(common_args + ["--results_dir", str(tmp_path / "results")])
    finally:
        torch.set_num_threads(threads)
    s = result["settings"]
    assert result["complete"] and s["smoke"] and s["eval_lengths"] == [32, 64] and s["seeds"] == [0, 1]
    assert s["tokens_per_run"] == 2 * 2 * 32 and s["pde_learning_rates_swept"] == [0.01, 0.1]
    modes = [(c["mode"], c["init"]) for c in result["cells"]]
    assert modes == [("lora", None), ("full", None)] + [(m, i) for m in ("lora_pde", "pde", "full_pde")
                                                        for i in ("identity", "paper")]
    chosen = result["sweep"]["chosen"]["diffusion"]
    assert chosen in (0.01, 0.1)
    sweep = result["sweep"]["perplexity"]["diffusion"]
    assert sweep[f"{chosen:g}"] == min(sweep.values())  # chosen by validation perplexity
    for cell in result["cells"]:
        assert cell["seeds"] == [0, 1] and cell["pde_lr"] == (chosen if cell["pde_type"] else None)
        for metric in ("valid_32_ppl", "test_32_ppl", "test_64_ppl"):
            stats = cell["metrics"][metric]
            assert len(stats["values"]) == 2 and stats["mean"] == pytest.approx(sum(stats["values"]) / 2)
        if cell["reference"]:
            assert set(cell["delta"]) == {"valid_32_ppl", "test_32_ppl", "test_64_ppl"}
    # the untrained model and the paper-init patch, evaluated before training
    assert set(result["base"]) == {"base", "base|diffusion|paper"}
    # the identity init starts from the pretrained function: its "before" is the untrained model's
    identity = next(c for c in result["cells"] if c["mode"] == "pde" and c["init"] == "identity")
    assert identity["before"] == {k: result["base"]["base"][k] for k in identity["before"]}
    # full fine-tuning trains every weight; PDE alone only the coefficients
    params = {c["key"]: c["trainable_parameters"] for c in result["cells"]}
    assert params["full"] > params["lora"] > params["pde|diffusion|identity"] > 0
    assert params["full_pde|diffusion|identity"] == params["full"] + params["pde|diffusion|identity"]
    # the kept adapter is the LoRA + PDE run with the lowest validation perplexity, and the card block names it
    runs = [r for r in result["runs"] if r["mode"] == "lora_pde"]
    best = min(runs, key=lambda r: r["valid_32_ppl"])
    assert result["best_lora_pde_adapter"]["key"] == best["key"]
    card = result["card_results"]
    adapter = tmp_path / "out" / "best_lora_pde"
    assert card["adapter_sha256"] == pretrained_study.sha256(adapter / "adapter_model.safetensors")
    assert card["rows"][0][1:] == [f"{best['test_32_ppl']:.3f}", f"{best['test_64_ppl']:.3f}"]
    assert card["description"].startswith("SMOKE RUN") and card["model_index"] == []
    assert all(len(r["loss_history"]) == 2 for r in result["runs"] if r["mode"] != "base")
    for ext in ("json", "md", "png"):
        assert (tmp_path / "results" / f"pretrained_finetune.{ext}").stat().st_size > 0
    text = (tmp_path / "results" / "pretrained_finetune.md").read_text()
    assert "SMOKE RUN" in text and "## What it shows" in text and "LoRA + PDE vs LoRA" in text
    # resuming runs nothing new; the report alone equals the first one
    again = finetune_patched_llama.main(common_args + ["--results_dir", str(tmp_path / "again"),
                                                       "--study_report_only", "true"])
    assert {k: v for k, v in again.items() if k != "command"} == {k: v for k, v in result.items() if k != "command"}


def test_pretrained_study_grows_but_keeps_its_settings():
    """A study's runs file takes more types, inits, modes or seeds (its runs stay valid); other rates, lengths or
    block size are another study."""
    import pretrained_study

    plan = dict(types=["reaction_diffusion"], inits=["identity"], modes=["lora", "lora_pde"], seeds=[0, 1],
                rates=[0.01, 0.1], lengths=[1024, 4096], block_size=1024)
    grown = dict(plan, types=["diffusion", "reaction_diffusion"], inits=["identity", "paper"], seeds=[0, 1, 2])
    assert pretrained_study.plan_extends(plan, plan) and pretrained_study.plan_extends(plan, grown)
    assert not pretrained_study.plan_extends(grown, plan)  # (fewer cells: not the same study)
    for change in (dict(rates=[0.01]), dict(lengths=[1024]), dict(block_size=512)):
        assert not pretrained_study.plan_extends(plan, dict(grown, **change))


@pytest.mark.parametrize("name", ["run_classification", "run_clm", "finetune_patched_llama"])
def test_help_reads_like_transformers_scripts(name, capsys):
    import importlib

    module = importlib.import_module(name)
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--model_name_or_path", "--tokenizer_name", "--cache_dir", "--dataset_name", "--dataset_config_name",
                 "--train_file", "--validation_file", "--test_file", "--text_column_name", "--max_train_samples",
                 "--max_eval_samples", "--preprocessing_num_workers", "--overwrite_cache", "--output_dir",
                 "--pde_steps"):
        assert flag in text, flag
    own = {"run_classification": ("--label_column_name", "--max_seq_length", "--task"),
           "run_clm": ("--block_size", "--leak_check_tolerance"),
           "finetune_patched_llama": ("--block_size", "--modes", "--lora_r", "--document_separator", "--study",
                                      "--smoke", "--full_learning_rate", "--gguf_file")}
    for flag in own[name]:
        assert flag in text, flag


# ------------------------------------------------------------------------------------------------ tables
LM_TABLES = ["lm_steps", "lm_pde_types", "lm_seq_len", "lm_data_fraction", "hybrid"]


def _skip_reason(table):
    if table in LM_TABLES:
        if not _have("wikitext2", "train.txt.gz") or not _tokenizer_available():
            return "offline WikiText-2 / bert-base-uncased tokenizer not found (set CTA_SHARED_DIR or CTA_DATA_DIR)"
        return None
    for parts in NEEDS[table]:
        if not _have(*parts):
            return f"offline data {os.path.join(DATA_DIR, *parts)} not found (set CTA_SHARED_DIR or CTA_DATA_DIR)"
    if table == "table1" and not _tokenizer_available():
        return "bert-base-uncased tokenizer not found offline"
    return None


def test_every_table_is_covered():
    assert set(reproduce.TABLES) == set(NEEDS) | set(LM_TABLES)


@pytest.mark.parametrize("table", list(reproduce.TABLES))
def test_reproduce_quick(table, tmp_path):
    reason = _skip_reason(table)
    if reason:
        pytest.skip(reason)
    out = reproduce.main(["--table", table, "--quick", "--seeds", "1", "--jobs", "0", "--output_dir", str(tmp_path)])
    data = out[table]
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"{table}.{ext}").exists()
    on_disk = json.loads((tmp_path / f"{table}.json").read_text())
    assert on_disk["cells"] == json.loads(json.dumps(data["cells"], default=str))
    for cell in data["cells"]:
        assert cell["n"] == 1 and not cell["failed"], cell
        assert cell["mean"] is not None
    md = (tmp_path / f"{table}.md").read_text()
    assert "QUICK SMOKE RUN" in md
    for cell in data["cells"]:  # every number in the markdown comes from the JSON
        assert f"{cell['mean']:.2f}" in md
    if table in LM_TABLES:
        assert all(r["leak_check"]["passed"] for c in data["cells"] for r in c["runs"])
    # re-running resumes: nothing is trained again
    again = reproduce.main(["--table", table, "--quick", "--seeds", "1", "--jobs", "0", "--output_dir",
                            str(tmp_path)])
    assert [c["values"] for c in again[table]["cells"]] == [c["values"] for c in data["cells"]]


def test_reproduce_dry_run_lists_every_run(capsys):
    reproduce.main(["--table", "table1", "--seeds", "3", "--dry_run"])
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("python examples/")]
    assert len(lines) == 6 * 2 * 3
    assert any("--pde_steps 0" in l for l in lines) and any("--pde_steps 1" in l for l in lines)


def test_encoder_sliding_window_is_refused(tmp_path):
    import run_classification

    with pytest.raises(NotImplementedError, match="sliding_window"):
        run_classification.main(["--task", "listops", "--sliding_window", "8", "--output_dir", str(tmp_path)]
                                + reproduce.QUICK_CLS + ["--max_seq_length", "64"])


def _earlier_listops_results(path, extra=""):
    """A listops table JSON as an earlier --quick run would have left it (values chosen by hand, never trained)."""
    table = reproduce.TABLES["listops"]
    cells = []
    for i, (variant, _) in enumerate(table["variants"]):
        cells.append(dict(row="ListOps", variant=variant, values=[40.0 + i], seeds=[0],
                          runs=[dict(seed=0, global_steps=2, device="cpu")]))
    data = dict(table="listops", metric=table["metric"], metric_scale=table["scale"], cells=cells,
                settings=dict(quick=True, extra=extra, epochs_override=None, command="earlier command"))
    path.mkdir(parents=True, exist_ok=True)
    (path / "listops.json").write_text(json.dumps(data))


def test_reproduce_resume_from_takes_over_finished_seeds(tmp_path):
    _earlier_listops_results(tmp_path / "earlier")
    out = reproduce.main(["--table", "listops", "--quick", "--seeds", "1", "--jobs", "0", "--time_budget", "0",
                          "--output_dir", str(tmp_path / "new"), "--work_dir", str(tmp_path / "runs"),
                          "--resume_from", str(tmp_path / "earlier")])
    data = out["listops"]
    assert [c["values"] for c in data["cells"]] == [[40.0], [41.0]]  # nothing trained, both seeds taken over
    assert data["settings"]["resumed_from"]["listops"] == {"command": "earlier command", "runs": 2}
    assert "taken over with `--resume_from`" in (tmp_path / "new" / "listops.md").read_text()


def test_reproduce_resume_from_refuses_other_settings(tmp_path):
    _earlier_listops_results(tmp_path / "earlier", extra="--learning_rate 1")
    with pytest.raises(SystemExit, match="other settings"):
        reproduce.main(["--table", "listops", "--quick", "--seeds", "1", "--jobs", "0", "--time_budget", "0",
                        "--output_dir", str(tmp_path / "new"), "--work_dir", str(tmp_path / "runs"),
                        "--resume_from", str(tmp_path / "earlier")])


# ------------------------------------------------------------------------------------------------ make demo
DEMO_MODEL = os.path.join(EXAMPLES, "demo_data", "stories260K")


def test_demo_ships_what_it_needs():
    """`make demo` works on a bare clone: the model, the text and their provenance are in the repository."""
    for path in ("stories260K/config.json", "stories260K/model.safetensors", "stories260K/tokenizer.json",
                 "stories260K/PROVENANCE.md", "tinystories/train.txt.gz", "tinystories/validation.txt.gz",
                 "tinystories/PROVENANCE.md"):
        assert os.path.isfile(os.path.join(EXAMPLES, "demo_data", path)), path
    size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(os.path.join(EXAMPLES, "demo_data"))
               for f in files)
    assert size < 2_000_000, size
    for name in ("stories260K", "tinystories"):
        text = open(os.path.join(EXAMPLES, "demo_data", name, "PROVENANCE.md")).read()
        assert ("MIT" if name == "stories260K" else "CDLA-Sharing-1.0") in text


def test_demo_verdict_does_not_overclaim():
    import demo

    assert demo.verdict([4.40, 4.39, 4.41], [4.40, 4.41, 4.39], "a", "b")[1] == "within noise"
    assert demo.verdict([4.30, 4.31, 4.29], [4.40, 4.41, 4.39], "a", "b")[1] == "lower"
    assert demo.verdict([4.30, 4.42, 4.29], [4.40, 4.41, 4.39], "a", "b")[1] == "within noise"  # one seed disagrees
    assert demo.verdict([4.3], [4.4], "a", "b")[1] == "one seed"


def test_demo_end_to_end_tiny(tmp_path):
    """The demo on a minimal setting: identity init, training arms, merge + save, reload without `cta`, files."""
    pytest.importorskip("peft")
    import demo
    from transformers import AutoModelForCausalLM

    out = tmp_path / "demo"
    result = demo.main(["--output_dir", str(out), "--seeds", "0", "--max_steps", "2", "--max_train_blocks", "16",
                        "--max_eval_blocks", "4", "--per_device_train_batch_size", "4", "--sample_tokens", "6",
                        "--disable_tqdm", "true"])

    # identity init, checked here independently of the demo's own check
    ids = torch.tensor([[1, 403, 407, 261, 378, 2, 1, 66, 80]])
    base = AutoModelForCausalLM.from_pretrained(DEMO_MODEL).eval()
    patched = AutoModelForCausalLM.from_pretrained(DEMO_MODEL).eval()
    cta.patch_model(patched, pde_type=result["args"]["pde_type"], pde_steps=result["args"]["pde_steps"],
                    placement=result["args"]["pde_placement"], init="identity", per_channel=True)
    with torch.no_grad():
        assert torch.equal(base(input_ids=ids).logits, patched(input_ids=ids).logits)
    assert result["identity"]["same_greedy_tokens"] and result["identity"]["max_abs_logit_diff"] <= 1e-6

    # the saved model reloaded in a process without `cta` gives the logits it had before saving
    assert result["reload"]["cta_importable"] is False
    assert result["reload"]["class"].startswith("transformers_modules.")
    assert result["reload"]["max_abs_logit_diff"] <= 1e-5
    assert result["reload"]["sample"].startswith(result["args"]["prompt"])
    saved = AutoModelForCausalLM.from_pretrained(out / "model", trust_remote_code=True)
    assert len([m for m in saved.modules() if type(m).__name__ == "PDERefinement"]) == result["identity"]["pde_sites"]

    # result files with the expected fields
    for suffix in (".json", ".md", ".png"):
        assert (out / f"demo{suffix}").stat().st_size > 0
    on_disk = json.loads((out / "demo.json").read_text())
    assert set(on_disk["summary"]) == {"lora", "lora_pde", "pde"}
    for row in on_disk["summary"].values():
        assert set(row) >= {"ppl_after_mean", "ppl_after_std", "seeds", "trainable_parameters"}
        assert math.isfinite(row["ppl_after_mean"])
    assert on_disk["summary"]["pde"]["trainable_parameters"] < on_disk["summary"]["lora"]["trainable_parameters"]
    assert {c["pair"] for c in on_disk["comparisons"]} == {"lora_pde vs lora", "pde vs before"}
    assert math.isfinite(on_disk["ppl_before"]) and on_disk["conclusion"]
    assert "within" in (out / "demo.md").read_text() or "one seed" in (out / "demo.md").read_text()


def test_demo_help(capsys):
    import demo

    with pytest.raises(SystemExit) as exc:
        demo.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--model_name_or_path", "--seeds", "--modes", "--max_steps", "--pde_type", "--output_dir"):
        assert flag in text, flag
