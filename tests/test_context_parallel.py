"""Context parallelism (issue #52): a causal PDE site refines its shard of a sequence sharded across ranks exactly.

Two CPU processes on gloo (context_parallel_worker.py, one run of a few seconds) refine the shards of every PDE type,
scalar and per-channel coefficients, 1 and 3 steps, both layouts, with no walls, padding, packed rows and both, in fp32
and fp64, against PDERefinement on the full sequence: outputs, and gradients of the input and of the coefficients
(summed over the ranks, as DDP / FSDP do). The refusals are raised on both ranks, and the ranks still meet afterwards.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from packaging import version

from cta.pde_context_parallel import SequenceShards, check_sharded_refinement, exchange_halo, refine_sharded
from cta.pde_cta import PDERefinement

TESTS = Path(__file__).resolve().parent
TOLERANCE = {"float32": 1e-5, "float64": 1e-12}
# transformers 5.14's Trainer sums the evaluation loss over the context-parallel ranks (2x the mean; 5.24's averages)
EVAL_LOSS_IS_A_MEAN = version.parse(transformers.__version__) >= version.parse("5.24")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("context_parallel")
    env = dict(os.environ, PYTHONPATH=str(TESTS.parent), OMP_NUM_THREADS="1")
    # (a timeout: a refusal that one rank skipped would leave the other waiting in its collective)
    done = subprocess.run([sys.executable, str(TESTS / "context_parallel_worker.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_sharded_refinement_matches_the_full_sequence(two_ranks):
    cases = two_ranks[0]["cases"]
    assert len(cases) == 4 * 2 * 2 * 2 * 5 * 2  # types, per-channel, steps, layouts, walls, dtypes
    failures = []
    for rank, results in enumerate(two_ranks):
        for case, errors in results["cases"].items():
            tolerance = TOLERANCE[case.rsplit("-", 1)[1]] * max(1.0, errors.pop("scale"))
            failures += [(rank, case, name, error) for name, error in errors.items() if not error <= tolerance]
    assert failures == []


def test_bf16_shards_give_the_full_sequence_outputs(two_ranks):
    for results in two_ranks:
        assert len(results["bf16"]) == 8 and set(results["bf16"].values()) == {0.0}


def test_refusals_are_raised_on_every_rank_before_any_collective(two_ranks):
    first, second = (results["refusals"] for results in two_ranks)
    assert first == second
    assert "steps=3" in first["short_chunk"] and "at least 12 tokens" in first["short_chunk"]
    assert "bidirectional" in first["bidirectional"]
    assert "head_tail" in first["odd_length"]
    assert first["after"] == [1, 4, 2]  # the ranks met in the same collectives after the refusals


def test_sharded_models_match_the_full_sequence(two_ranks):
    """A patched Llama and a native CTA decoder with shard_sequences: each rank's logits are its shard of the
    full-sequence logits, and the PDE coefficients' gradients summed over the ranks are the full sequence's, both
    layouts, every placement outside the attention matrix (attention made position-local: no ring attention on CPU;
    the GPU test runs torch's context_parallel)."""
    for results in two_ranks:
        assert set(results["models"]) == {f"{k}-{layout}" for k in ("patched", "native")
                                          for layout in ("contiguous", "head_tail")}
        for case, errors in results["models"].items():
            assert len(errors) > 5, case  # the logits and every PDE coefficient
            assert max(errors.values()) < 1e-5, (case, errors)


def test_torch_context_parallel_shards_as_described(two_ranks):
    # torch's context_parallel (public API, CPU buffers) cuts the sequence as SequenceSharding("torch") says, on both ranks: head-tail for 16 tokens (a multiple of 2 * 2), contiguous for 14
    for rank, results in enumerate(two_ranks):
        layouts = results["torch_layouts"]
        assert {length: layouts[length] for length in ("16", "14")} == {"16": ["head_tail", True],
                                                                        "14": ["contiguous", True]}
        # accelerate's parallelism_config: torch CP (load-balanced), DeepSpeed Ulysses (contiguous), neither
        found = layouts["accelerate"]
        assert found["cp"] == ["head_tail", 2, rank] and found["sp"] == ["contiguous", 2, rank]
        assert found["none"] is None and found["no_config"] is None
        assert "both cp_size and sp_size" in found["both"]


# ------------------------------------------------------------------------------------------------------------------
# One process: the layout's index math, the refusals' messages, and one rank holding the whole sequence
# ------------------------------------------------------------------------------------------------------------------


def test_head_tail_layout_matches_torch_load_balancing():
    # torch's _HeadTailLoadBalancer: rank r holds chunks r and 2W-1-r of 2W, in that order
    world = 4
    for rank in range(world):
        shards = SequenceShards("head_tail", world, rank)
        assert shards.local_chunks == (rank, 2 * world - 1 - rank)
        assert shards.global_positions(6).tolist() == [
            *range(3 * rank, 3 * rank + 3), *range(3 * (2 * world - 1 - rank), 3 * (2 * world - rank))]
        assert [shards.owner(chunk) for chunk in shards.local_chunks] == [(rank, 0), (rank, 1)]
    shards = SequenceShards("head_tail", world, 0)
    assert shards.left_neighbour(0) is None  # the global start
    assert shards.left_neighbour(1) == (1, 1)  # chunk 7 follows chunk 6, the tail of rank 1
    assert SequenceShards("head_tail", world, 3).left_neighbour(1) == (3, 0)  # chunk 4 follows chunk 3, its own head
    assert SequenceShards("head_tail", world, 2).left_neighbour(0) == (1, 0)
    sequence = torch.arange(16)[None]
    assert SequenceShards("head_tail", 2, 1).shard(sequence).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]


def test_contiguous_layout():
    shards = SequenceShards("contiguous", 3, 2)
    assert shards.local_chunks == (2,) and shards.num_chunks == 3 and shards.chunks_per_rank == 1
    assert shards.left_neighbour(0) == (1, 0)
    assert SequenceShards("contiguous", 3, 0).left_neighbour(0) is None
    assert shards.shard(torch.arange(9)[None]).tolist() == [[6, 7, 8]]
    assert shards.global_positions(3).tolist() == [6, 7, 8]


@pytest.mark.parametrize("arguments, message", [
    (("ring", 2, 0), "`layout` must be one of"),
    (("contiguous", 0, 0), "`world_size` must be a positive int"),
    (("head_tail", 2, 2), "`rank` must be an int in [0, world_size=2)"),
])
def test_unknown_layouts_are_refused(arguments, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        SequenceShards(*arguments)


def test_refusals_name_the_bad_argument():
    shards = SequenceShards("head_tail", 1, 0)
    causal = PDERefinement(2, steps=2, causal=True, backend="torch")
    with pytest.raises(TypeError, match="`shards` must be a cta SequenceShards"):
        refine_sharded(causal, torch.randn(1, 4, 2), "head_tail")
    with pytest.raises(ValueError, match=r"`hidden_states` must be this rank's shard"):
        refine_sharded(causal, torch.randn(4, 2), shards)
    with pytest.raises(ValueError, match=r"`token_mask` must be this rank's shard \[batch, local_seq\] = \[1, 4\]"):
        refine_sharded(causal, torch.randn(1, 4, 2), shards, token_mask=torch.ones(1, 8))
    with pytest.raises(ValueError, match=r"`position_ids` must be this rank's shard"):
        refine_sharded(causal, torch.randn(1, 4, 2), shards, position_ids=torch.arange(4))
    with pytest.raises(ValueError, match="spans 2 ranks but torch.distributed is not initialised"):
        check_sharded_refinement(causal, torch.randn(1, 4, 2), SequenceShards("contiguous", 2, 0))


@pytest.mark.parametrize("pde_type", ["diffusion", "wave", "reaction_diffusion", "advection_diffusion"])
def test_one_rank_head_tail_is_the_full_sequence(pde_type):
    # W = 1 under head-tail: two chunks on one rank, the second's halo is the first's tail (no collective)
    torch.manual_seed(0)
    module = PDERefinement(3, pde_type, steps=4, causal=True, per_channel=True, backend="torch").double()
    x = torch.randn(2, 10, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 10)
    mask[1, 3:6] = 0
    shards = SequenceShards("head_tail", 1, 0)
    torch.testing.assert_close(refine_sharded(module, x, shards, mask), module(x, mask), rtol=0, atol=1e-14)
    halos = exchange_halo(x, shards, 4)
    assert halos.shape == (2, 2, 4, 3)
    assert torch.equal(halos[0], torch.zeros(2, 4, 3, dtype=torch.float64)) and torch.equal(halos[1], x[:, 1:5])
    halos[1].sum().backward()  # the halo's gradient comes back to the rows it was taken from
    assert x.grad[:, 1:5].eq(1).all() and x.grad[:, 5:].eq(0).all() and x.grad[:, :1].eq(0).all()


def test_halo_longer_than_a_chunk_is_refused():
    with pytest.raises(ValueError, match=r"`halo`=3 must be in \[1, chunk length\] = \[1, 2\]"):
        exchange_halo(torch.randn(1, 4, 2), SequenceShards("head_tail", 1, 0), 3)


def test_zero_steps_is_the_identity():
    x = torch.randn(1, 4, 2)
    module = PDERefinement(2, steps=0, causal=True, backend="torch")
    assert refine_sharded(module, x, SequenceShards("contiguous", 1, 0)) is x


# ------------------------------------------------------------------------------------------------------------------
# The Trainer: TrainingArguments(parallelism_config=ParallelismConfig(cp_size=2)) + cta.ContextParallelCallback
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """context_parallel_trainer_worker.py on 2 gloo ranks (a real Trainer, torch's context_parallel sharding its
    buffers, position-local attention) and on one process."""
    out = tmp_path_factory.mktemp("context_parallel_trainer")
    env = dict(os.environ, PYTHONPATH=str(TESTS.parent), OMP_NUM_THREADS="1")
    worker = str(TESTS / "context_parallel_trainer_worker.py")
    for command in ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", worker],
                    [sys.executable, worker]):
        done = subprocess.run(command + [str(out), "cpu"], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((out / name).read_text()) for name in ("cp-rank0.json", "cp-rank1.json", "single.json")]


def test_trainer_context_parallel_matches_one_process(trainer_runs):
    """A patched Llama trained 4 steps by the Trainer under cp_size=2 with the callback: every rank logs the
    one-process losses and evaluation loss (position-local attention: the PDE sites are the only cross-position
    operations, and their halos make the shards exact); the sites were sharded (head-tail) from the first step."""
    *ranks, single = trainer_runs
    expected = single["patched"]
    assert len(expected["losses"]) == 4 and expected["sites"] == [["None"]] * 4
    for results in ranks:
        got = results["patched"]
        assert got["sites"] == [["head_tail"]] * 4
        torch.testing.assert_close(got["losses"], expected["losses"], rtol=0, atol=1e-5)
        if EVAL_LOSS_IS_A_MEAN:
            assert abs(got["eval_loss"] - expected["eval_loss"]) < 1e-5


def test_trainer_refuses_untold_sites_on_every_rank(trainer_runs):
    """Without the callback the proposed forward check (refuse_untold_sites) raises on both ranks at the first
    forward: training stops instead of refining each shard as a whole sequence (the run exits, no hang)."""
    first, second = (results["untold"] for results in trainer_runs[:2])
    assert first == second and "ContextParallelCallback" in first["error"] and first["steps_begun"] == 1


def test_trainer_context_parallel_native_decoder(trainer_runs):
    """A native CTA decoder (every placement outside the attention matrix) under the same Trainer run: the one-process
    losses and evaluation loss. accelerate's context-parallel guard refuses ``layer_types`` other than
    ``full_attention``; the callback shows it ``full_attention`` for the native ``hybrid`` (full causal attention plus
    the PDE cache state) while the Trainer prepares the model, and restores them when training begins."""
    *ranks, single = trainer_runs
    assert single["native"]["layer_types"] == ["hybrid", "hybrid"]
    for results in ranks:
        got = results["native"]
        assert "error" not in got, got["error"]
        assert got["sites"] == [["head_tail"]] * 4 and got["layer_types"] == ["hybrid", "hybrid"]
        torch.testing.assert_close(got["losses"], single["native"]["losses"], rtol=0, atol=1e-5)
        if EVAL_LOSS_IS_A_MEAN:
            assert abs(got["eval_loss"] - single["native"]["eval_loss"]) < 1e-5


class _Mesh(dict):
    """accelerate's device mesh: ``mesh["cp"].get_group()``."""


def _stand_in_state(monkeypatch, cp_size=1, sp_size=1, has_config=True):
    import types

    import accelerate.state

    config = types.SimpleNamespace(cp_enabled=cp_size > 1, cp_backend="torch", sp_enabled=sp_size > 1,
                                   sp_backend="deepspeed") if has_config else None
    mesh = _Mesh(cp=types.SimpleNamespace(get_group=lambda: "cp-group"))

    class State:  # (AcceleratorState: the shared dict, and an instance with parallelism_config / device_mesh)
        _shared_state = {"parallelism_config": config}

        def __init__(self):
            self.parallelism_config, self.device_mesh = config, mesh

    monkeypatch.setattr(accelerate.state, "AcceleratorState", State)


def _tiny_patched_llama():
    import cta
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2)
    return cta.patch_model(LlamaForCausalLM(config), pde_steps=1, placement=["block_output"])


def test_callback_tells_the_sites_what_accelerate_shards(monkeypatch):
    import cta
    from cta.pde_context_parallel import _site_holders

    model = _tiny_patched_llama()
    sharding = lambda: {getattr(h, n) for h, n in _site_holders(model)}  # noqa: E731
    callback = cta.ContextParallelCallback()
    _stand_in_state(monkeypatch, cp_size=1)
    callback.on_init_end(None, None, None, model=model)
    assert sharding() == {None}  # nothing sharded: nothing told
    _stand_in_state(monkeypatch, cp_size=2)
    callback.on_train_begin(None, None, None, model=model)
    assert sharding() == {cta.SequenceSharding("torch", "cp-group")}  # torch's rule over the cp mesh's group
    from transformers import LlamaConfig, LlamaForCausalLM

    plain = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2))
    callback.on_init_end(None, None, None, model=plain)  # no PDE sites: nothing to tell, no error
    _stand_in_state(monkeypatch, cp_size=2, sp_size=2)
    with pytest.raises(ValueError, match="both cp_size and sp_size"):
        callback.on_train_begin(None, None, None, model=model)
    cta.shard_sequences(model, None)
    _stand_in_state(monkeypatch, sp_size=2)  # DeepSpeed Ulysses: its group exists once the model is prepared
    callback.on_init_end(None, None, None, model=model)
    assert sharding() == {None}


def test_callback_shows_accelerate_full_attention_for_a_native_decoder_while_it_is_prepared(monkeypatch):
    import cta
    from cta.pde_context_parallel import _site_holders

    config = cta.CTAConfig.modern_decoder(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                         num_attention_heads=2, pde_steps=1, pde_placement=["block_output"])
    model, callback = cta.CTAForCausalLM(config), cta.ContextParallelCallback()
    assert model.config.layer_types == ["hybrid", "hybrid"]
    _stand_in_state(monkeypatch, cp_size=2)
    callback.on_init_end(None, None, None, model=model)  # (then Trainer.train prepares the model: accelerate's guard)
    assert model.config.layer_types == ["full_attention", "full_attention"]
    callback.on_train_begin(None, None, None, model=model)
    assert model.config.layer_types == ["hybrid", "hybrid"]
    assert {getattr(h, n) for h, n in _site_holders(model)} == {cta.SequenceSharding("torch", "cp-group")}
    other = cta.CTAForCausalLM(config)
    _stand_in_state(monkeypatch, cp_size=1)
    cta.ContextParallelCallback().on_init_end(None, None, None, model=other)  # not sharded: nothing hidden
    assert other.config.layer_types == ["hybrid", "hybrid"]


def test_untold_sites_are_refused_while_accelerate_shards(monkeypatch):
    import cta
    from cta.pde_context_parallel import accelerate_shards_sequences, refuse_untold_sites

    _stand_in_state(monkeypatch, has_config=False)
    assert not accelerate_shards_sequences()
    refuse_untold_sites(None, True)
    _stand_in_state(monkeypatch, cp_size=2)
    assert accelerate_shards_sequences()
    with pytest.raises(ValueError, match=r"M: accelerate's parallelism_config shards .*ContextParallelCallback"):
        refuse_untold_sites(None, True, "M")
    refuse_untold_sites(cta.SequenceSharding(), True)  # told
    refuse_untold_sites(None, False)  # evaluation / generation outside the Trainer's sharded steps


def test_the_context_parallel_accelerate_config_sets_cp_size():
    """examples/accelerate/context_parallel.yaml reaches the processes as accelerate's parallelism_config: cp_size 2
    (torch's backend) under FSDP2, which the Trainer then reads (what `accelerate launch --config_file` exports)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    config = TESTS.parent / "examples" / "accelerate" / "context_parallel.yaml"
    args = launch_command_parser().parse_args(["--config_file", str(config), "train.py"])
    env = prepare_multi_gpu_env(_validate_launch_command(args)[0])
    assert {key: env[key] for key in ("ACCELERATE_USE_PARALLELISM_CONFIG", "PARALLELISM_CONFIG_CP_SIZE",
                                      "PARALLELISM_CONFIG_CP_BACKEND", "ACCELERATE_USE_FSDP", "FSDP_VERSION")} == {
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_CP_SIZE": "2",
        "PARALLELISM_CONFIG_CP_BACKEND": "torch", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}


def test_a_train_only_sharding_leaves_eval_mode_forwards_whole():
    """DeepSpeed Ulysses as accelerate sets it up shards train-mode forwards only (``disable_in_eval``, decided by the
    module's mode): told such a sharding, a model in eval mode refines whole sequences, with or without autograd,
    and gives the logits of a model never told; in train mode the walls keep the sharding."""
    import cta
    from cta.pde_sites import SiteWalls

    sharding = cta.SequenceSharding("contiguous", training_only=True)
    assert SiteWalls.of_forward(None, training=False, sharding=sharding).sharding is None
    assert SiteWalls.of_forward(None, training=True, sharding=sharding).sharding is sharding
    assert SiteWalls.of_forward(None, training=False, sharding=cta.SequenceSharding()).sharding is not None
    model = _tiny_patched_llama().eval()
    ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    cta.shard_sequences(model, sharding)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)
