"""A deterministic, seeded ListOps generator (Nangia & Bowman, 2018) with the Long Range Arena rules.

LRA (Tay et al., 2021, ``lra_benchmarks/data/listops.py``) generates trees with

* operators ``MIN``, ``MAX``, ``MED`` (median, rounded down to an int) and ``SM`` (sum modulo 10),
* leaves: single digits 0-9,
* ``max_depth = 10``, ``max_args = 10``, a node branches (is an operator) with probability ``0.25``
  (it is always a leaf at ``max_depth``), an operator has ``randint(2, max_args)`` arguments,
* rejection sampling on the token length: ``min_length <= len(tokens) <= max_length`` (LRA: 500 to 2000),
  duplicates are rejected,
* the string form ``[MAX 2 9 [MIN 4 7 ] 0 ]``: an operator opens with ``[OP``, closes with ``]``
  (LRA's TSV also has parentheses from the tuple form; its input pipeline drops them, so they are not produced here).

Everything depends only on ``seed`` (Python's ``random.Random``): the same seed gives the same data on every machine.

    python examples/listops.py --num_samples 5 --seed 0 --min_length 10 --max_length 60
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
from typing import List, Sequence

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
VALUES = tuple(str(v) for v in range(10))

# Token ids: 0 is padding; the vocabulary is small and fixed.
PAD_TOKEN = "<pad>"
VOCAB = (PAD_TOKEN,) + VALUES + OPERATORS + (END,)
TOKEN_TO_ID = {tok: i for i, tok in enumerate(VOCAB)}
NUM_CLASSES = 10


def _tree(rng: random.Random, depth: int, max_depth: int, max_args: int, prob_branch: float, out: List[str]):
    """Appends the tokens of one random subtree to ``out`` (iterative-free recursion, depth <= max_depth)."""
    r = rng.random() if depth < max_depth else 1.0
    if r > prob_branch:
        out.append(rng.choice(VALUES))
        return
    num_args = rng.randint(2, max_args)
    out.append(rng.choice(OPERATORS))
    for _ in range(num_args):
        _tree(rng, depth + 1, max_depth, max_args, prob_branch, out)
    out.append(END)


def evaluate_tokens(tokens: Sequence[str]) -> int:
    """Value of a ListOps expression given as tokens (stack machine)."""
    stack: List[list] = []
    result = None
    for tok in tokens:
        if tok in OPERATORS:
            stack.append([tok])
        elif tok == END:
            op, *args = stack.pop()
            if not args:
                raise ValueError("operator without arguments")
            if op == "[MIN":
                value = min(args)
            elif op == "[MAX":
                value = max(args)
            elif op == "[MED":
                s = sorted(args)
                n = len(s)
                # int(np.median(...)) as in LRA: mean of the two middle values, truncated
                value = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2
            else:  # [SM
                value = sum(args) % 10
            if stack:
                stack[-1].append(value)
            else:
                result = value
        else:
            value = int(tok)
            if stack:
                stack[-1].append(value)
            else:
                result = value
    if stack or result is None:
        raise ValueError("unbalanced ListOps expression")
    return result


def generate(num_samples: int, seed: int = 0, min_length: int = 500, max_length: int = 2000, max_depth: int = 10,
             max_args: int = 10, prob_branch: float = 0.25, exclude=None, max_tries: int = 10_000_000):
    """Returns ``num_samples`` dicts ``{"text": "[MAX 2 9 ]", "label": int}``, unique, deterministic for a seed.

    ``exclude``: a set of texts that must not be produced (e.g. the train set when generating test data).
    """
    if min_length > max_length:
        raise ValueError(f"`min_length` ({min_length}) must be <= `max_length` ({max_length}).")
    rng = random.Random(seed)
    seen = set(exclude or ())
    rows = []
    tries = 0
    while len(rows) < num_samples:
        tries += 1
        if tries > max_tries:
            raise RuntimeError(
                f"ListOps: only {len(rows)} of {num_samples} sequences with {min_length} <= length <= {max_length} "
                f"after {max_tries} trees; widen the length range."
            )
        tokens: List[str] = []
        _tree(rng, 1, max_depth, max_args, prob_branch, tokens)
        if not min_length <= len(tokens) <= max_length:
            continue
        text = " ".join(tokens)
        if text in seen:
            continue
        seen.add(text)
        rows.append({"text": text, "label": evaluate_tokens(tokens)})
    return rows


def generate_splits(num_train: int, num_eval: int, num_test: int, seed: int = 0, **kwargs):
    """Disjoint train / validation / test splits (each from its own derived seed)."""
    train = generate(num_train, seed=seed * 3 + 0, **kwargs)
    seen = {r["text"] for r in train}
    validation = generate(num_eval, seed=seed * 3 + 1, exclude=seen, **kwargs)
    seen |= {r["text"] for r in validation}
    test = generate(num_test, seed=seed * 3 + 2, exclude=seen, **kwargs)
    return {"train": train, "validation": validation, "test": test}


def encode(text: str) -> List[int]:
    """Token ids (whitespace tokens; 0 is padding)."""
    return [TOKEN_TO_ID[t] for t in text.split()]


def tokenizer():
    """The ListOps tokenizer: a `tokenizers` word-level model over ``VOCAB`` (whitespace-split, 0 = ``<pad>``) in
    ``transformers.PreTrainedTokenizerFast``, so it pads, saves and reloads (``AutoTokenizer``) as any other.
    A token outside the vocabulary raises."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab=dict(TOKEN_TO_ID), unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD_TOKEN,
                                   model_input_names=["input_ids", "attention_mask"])


def _split_rows(num_train, num_test, seed, min_length, max_length):
    splits = generate_splits(num_train, 0, num_test, seed=seed, min_length=min_length, max_length=max_length)
    for split in ("train", "test"):
        for row in splits[split]:
            yield dict(row, split=split)


def load_dataset(num_train: int, num_test: int, seed: int = 0, min_length: int = 500, max_length: int = 2000,
                 cache_dir=None):
    """``datasets.DatasetDict`` with ``train`` and ``test`` (columns ``text``, ``label``), made by
    ``generate_splits`` and cached by `datasets` under a fingerprint of this file and the arguments (so a changed
    generator never reuses old data)."""
    import hashlib

    import datasets

    kwargs = dict(num_train=num_train, num_test=num_test, seed=seed, min_length=min_length, max_length=max_length)
    with open(os.path.abspath(__file__), "rb") as f:
        fingerprint = hashlib.sha256(f.read() + json.dumps(kwargs, sort_keys=True).encode()).hexdigest()[:32]
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.Value("int64"),
                                  "split": datasets.Value("string")})
    rows = datasets.Dataset.from_generator(_split_rows, features=features, gen_kwargs=kwargs, cache_dir=cache_dir,
                                           fingerprint=fingerprint)
    return datasets.DatasetDict({split: rows.filter(lambda s, split=split: s == split, input_columns="split")
                                 .remove_columns("split") for split in ("train", "test")})


def save_jsonl_gz(rows, path):
    tmp = f"{path}.tmp{os.getpid()}"
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_samples", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min_length", type=int, default=500)
    parser.add_argument("--max_length", type=int, default=2000)
    parser.add_argument("--output", help="write JSON Lines (.jsonl.gz) here instead of printing")
    args = parser.parse_args(argv)
    rows = generate(args.num_samples, args.seed, args.min_length, args.max_length)
    if args.output:
        save_jsonl_gz(rows, args.output)
    else:
        for row in rows:
            print(json.dumps(row))


if __name__ == "__main__":
    main()
