"""Default CTA models fine-tune under FSDP1 and FSDP2: two CPU processes (torchrun, gloo) shard a patched Llama and a
native CTA decoder, both with the default scalar PDE coefficients (1-element tensors: both engines refuse 0-d
parameters), by their ``_no_split_modules``; their per-step losses equal one process training on the same global
batch, and the saved checkpoint reloads (patched) with the same weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cta
from fsdp_setup import ENGINES, MODELS, STEPS, batch

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    out, losses_file = tmp / "checkpoints", tmp / "losses.json"
    env = dict(os.environ, PYTHONPATH=str(TESTS), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(TESTS / "fsdp_worker.py"),
         str(out), str(losses_file), str(TESTS.parent)],
        env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads(losses_file.read_text())


def one_process_losses(model):
    """One process, the same global batch: the mean of the two halves' losses is what the two ranks average."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = batch()
    losses = []
    for _ in range(STEPS):
        loss = sum(model(input_ids=part, labels=part).loss for part in ids.chunk(2)) / 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_default_models_have_no_0_d_parameters():
    for build in MODELS.values():
        model = build()
        assert [n for n, p in model.named_parameters() if p.dim() == 0] == []
        assert any(n.endswith("_pde.alpha") and p.shape == (1,) for n, p in model.named_parameters())


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_default_model_under_fsdp_matches_one_process(sharded_runs, engine, kind):
    out, runs = sharded_runs
    run = runs[f"{engine}_{kind}"]
    assert run["units"] == (["LlamaDecoderLayer"] if kind == "patched" else ["CTADecoderLayer"])
    model = MODELS[kind]()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = one_process_losses(model)
    assert losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)

    folder = str(out / f"{engine}_{kind}")
    reloaded = cta.load_patched(folder) if kind == "patched" else cta.CTAForCausalLM.from_pretrained(folder)
    trained = dict(model.named_parameters())
    moved = []
    for name, parameter in reloaded.named_parameters():
        torch.testing.assert_close(parameter, trained[name], rtol=1e-5, atol=1e-6, msg=name)
        if "_pde." in name:
            moved.append(not torch.equal(parameter, initial[name]))
    assert moved and all(moved)  # every PDE coefficient was trained (sharded) and saved


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_checkpoint_saved_from_an_fsdp2_model_names_this_package(sharded_runs, kind):
    """FSDP2 swaps the model's class for one of torch's (``FSDP<Name>``): the checkpoint its own ``save_pretrained``
    writes must still name this package's classes and files, so that it loads with ``trust_remote_code`` alone."""
    out, _ = sharded_runs
    folder = out / f"fsdp2_{kind}_from_sharded"
    config = json.loads((folder / "config.json").read_text())
    modules = {ref.split(".")[0] for ref in config["auto_map"].values()}
    assert modules == ({"configuration_cta", "modeling_cta"} if kind == "native" else {"patching_cta"}), modules
    assert config["architectures"] == [type(MODELS[kind]()).__name__]
    assert not list(folder.glob("_fsdp*.py"))
    assert (folder / ("modeling_cta.py" if kind == "native" else "patching_cta.py")).exists()
    reloaded = cta.load_patched(str(folder)) if kind == "patched" else cta.CTAForCausalLM.from_pretrained(folder)
    reference = cta.load_patched(str(out / f"fsdp2_{kind}")) if kind == "patched" else \
        cta.CTAForCausalLM.from_pretrained(out / f"fsdp2_{kind}")
    for (name, a), (_, b) in zip(reloaded.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(a, b, msg=name)
