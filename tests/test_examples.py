"""Smoke and unit tests of the example scripts (examples/): the ListOps generator, the byte tokenizer, the LM leak
check, the metric module, and a ``--quick`` run of every reproduce.py table (tiny slices, 2 optimizer steps).

Tables that need the offline data (../shared/data or $CTA_DATA_DIR) are skipped with a reason when it is absent;
ListOps needs no data.
"""

import json
import os
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
import run_clm  # noqa: E402

import cta  # noqa: E402

DATA_DIR = common.default_data_dir()


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


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    old = os.environ.get("CTA_CACHE_DIR")
    os.environ["CTA_CACHE_DIR"] = str(tmp_path_factory.mktemp("cta_cache"))
    yield
    if old is None:
        os.environ.pop("CTA_CACHE_DIR", None)
    else:
        os.environ["CTA_CACHE_DIR"] = old


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


# ------------------------------------------------------------------------------------------------ tokenizers
def test_byte_tokenizer_matches_byt5():
    tok = common.ByteTokenizer()
    from transformers import ByT5Tokenizer

    ref = ByT5Tokenizer(extra_ids=0)
    for text in ["hello world", "naïve café — 日本語", "<br />a\tb\n", ""]:
        ids = tok.encode(text)
        assert ids == ref(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        assert all(3 <= i < 259 for i in ids)
    assert tok.encode("abcdef", max_length=4) == [ord(c) + 3 for c in "abcd"]
    assert len(tok.encode("é")) == 2  # bytes, not characters


def test_pad_collator():
    batch = common.PadCollator(0, pad_to_multiple_of=4)([{"input_ids": [5, 6, 7], "labels": 1},
                                                         {"input_ids": [8], "labels": 0}])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["labels"].tolist() == [1, 0]


def test_accuracy_metric_module_and_fallback_agree():
    preds, refs = [0, 1, 2, 2, 1], [0, 1, 1, 2, 0]
    fallback = common._FallbackAccuracy().compute(predictions=preds, references=refs)
    assert fallback == {"accuracy": 0.6}
    pytest.importorskip("evaluate")
    metric = common.load_accuracy_metric()
    assert metric.compute(predictions=preds, references=refs) == fallback


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
                    reason="offline WikiText-2 / bert-base-uncased tokenizer not found (set CTA_DATA_DIR)")
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


# ------------------------------------------------------------------------------------------------ tables
LM_TABLES = ["lm_steps", "lm_pde_types", "lm_seq_len", "lm_data_fraction", "hybrid"]


def _skip_reason(table):
    if table in LM_TABLES:
        if not _have("wikitext2", "train.txt.gz") or not _tokenizer_available():
            return "offline WikiText-2 / bert-base-uncased tokenizer not found (set CTA_DATA_DIR)"
        return None
    for parts in NEEDS[table]:
        if not _have(*parts):
            return f"offline data {os.path.join(DATA_DIR, *parts)} not found (set CTA_DATA_DIR)"
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
