"""A patched model fine-tunes under FSDP: two CPU processes (torchrun, gloo) shard it by its ``_no_split_modules``,
their per-step losses equal one process training on the same global batch, and the saved checkpoint reloads patched
with the same weights."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import cta
from fsdp_setup import STEPS, batch, tiny_patched_model

TESTS = Path(__file__).resolve().parent


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on the PATH")
def test_patched_model_under_fsdp_matches_one_process(tmp_path):
    out, losses_file = tmp_path / "checkpoint", tmp_path / "losses.json"
    env = dict(os.environ, PYTHONPATH=str(TESTS), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [shutil.which("torchrun"), "--standalone", "--nproc_per_node", "2", str(TESTS / "fsdp_worker.py"),
         str(out), str(losses_file), str(TESTS.parent)],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sharded = json.loads(losses_file.read_text())
    assert sharded["units"] == ["LlamaDecoderLayer"]

    # One process, the same global batch: the mean of the two halves' losses is what the two ranks average.
    model = tiny_patched_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = batch()
    losses = []
    for _ in range(STEPS):
        halves = [model(input_ids=part, labels=part).loss for part in ids.chunk(2)]
        loss = sum(halves) / 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)

    reloaded = cta.load_patched(str(out))
    assert cta.patching_cta.is_patched(reloaded)
    trained = dict(model.named_parameters())
    for name, parameter in reloaded.named_parameters():
        torch.testing.assert_close(parameter, trained[name], rtol=1e-5, atol=1e-6, msg=name)
