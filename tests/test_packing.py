"""Padding-free packed batches (sequences concatenated in one row, `position_ids` restarting at 0): each packed
sequence's outputs and gradients equal the sequence run alone, for patched and native models, on the reference and the
Triton path, and a Trainer step on packed batches equals one on padded batches."""

import pytest
import torch
import transformers
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

import cta
from cta import PDE_TYPES
from cta.patching_cta import patch_model
from cta.pde_packing import PackedRows, sequence_starts
from pde_testing import enable_checkpointing, randomize_pde

VOCAB = 64
LENGTHS = (5, 3, 7)


ALL_PLACEMENTS = ["embedding", "value", "attention_output", "mlp_output", "block_output"]


def model_of(kind, pde_type="diffusion", backend="torch", seed=0, placements=ALL_PLACEMENTS):
    torch.manual_seed(seed)
    if kind == "native":
        config = cta.CTAConfig.modern_decoder(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=48, pde_type=pde_type, pde_steps=3, pde_placement=placements, pde_backend=backend,
            attn_implementation="sdpa")
        model = cta.CTAForCausalLM(config)
    elif kind == "native_encoder":
        config = cta.CTAConfig.paper_encoder(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=64, hidden_dropout_prob=0.0, pde_type=pde_type, pde_steps=3,
            pde_placement=["embedding", "value", "block_output"], pde_backend=backend, attn_implementation="sdpa")
        model = cta.CTAModel(config)
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             attn_implementation="sdpa"))
        if kind == "patched":
            patch_model(model, pde_type=pde_type, pde_steps=3, placement=placements, init="paper", backend=backend)
    model.config.use_cache = False  # (as for training: transformers' own attention separates packed rows then)
    return randomize_pde(model, seed)


def sequences(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def packed_batch(seqs):
    return DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": s, "labels": s} for s in seqs])


def outputs(model, **inputs):
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state


@pytest.mark.parametrize("pde_type", PDE_TYPES)
@pytest.mark.parametrize("kind", ["patched", "native"])
def test_packed_sequences_equal_each_sequence_alone(kind, pde_type):
    model = model_of(kind, pde_type)
    seqs = sequences()
    batch = packed_batch(seqs)
    packed = outputs(model, input_ids=batch["input_ids"], position_ids=batch["position_ids"])[0]
    alone = torch.cat([outputs(model, input_ids=torch.tensor([s]))[0] for s in seqs])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_unpatched_model_is_the_baseline():
    """What the PDE must match: transformers' own model keeps packed sequences apart."""
    model = model_of("plain")
    seqs = sequences()
    batch = packed_batch(seqs)
    packed = outputs(model, input_ids=batch["input_ids"], position_ids=batch["position_ids"])[0]
    alone = torch.cat([outputs(model, input_ids=torch.tensor([s]))[0] for s in seqs])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["patched", "native"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_gradients_equal_the_sum_over_sequences(kind, backend):
    """The loss of a packed batch (mean over its tokens) has the gradients of the same tokens' mean loss over the
    sequences run alone, on the PDE coefficients and the weights; Triton through its interpreter on the CPU."""
    pytest.importorskip("triton")
    model = model_of(kind, "reaction_diffusion", backend=backend).train()
    seqs = sequences(1)
    batch = packed_batch(seqs)
    model(**batch).loss.backward()
    packed = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    predicted = sum(len(s) - 1 for s in seqs)
    total = sum(model(input_ids=torch.tensor([s]), labels=torch.tensor([s])).loss * (len(s) - 1) for s in seqs)
    (total / predicted).backward()
    alone = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert packed.keys() == alone.keys() and any("pde" in name for name in packed)
    for name in packed:
        torch.testing.assert_close(packed[name], alone[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_encoder_site_and_flash_attention_keywords(backend):
    """A bidirectional (encoder) site keeps walls between packed sequences, with padding in the row too;
    FlashAttention's `cu_seq_lens_q` alone (no `position_ids`) marks the same walls."""
    pytest.importorskip("triton")
    site = model_of("native_encoder", "advection_diffusion", backend=backend).embedding_pde
    total = sum(LENGTHS)
    batch = packed_batch(sequences(2))
    starts = sequence_starts(batch["position_ids"], None, total)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    assert torch.equal(starts, sequence_starts(None, None, total, cu_seq_lens=cu))
    hidden = torch.randn(1, total, 32)
    refined = site(hidden, None, None, PackedRows(starts, None))
    expected = torch.cat([site(piece) for piece in hidden.split(LENGTHS, dim=1)], dim=1)
    torch.testing.assert_close(refined, expected, rtol=1e-5, atol=1e-6)
    # a padded token inside the row is returned unchanged and is a wall too
    mask = torch.ones(1, total, dtype=torch.long)
    mask[0, 1] = 0
    refined = site(hidden, mask, None, PackedRows(sequence_starts(batch["position_ids"], mask, total), mask))
    pieces = hidden.split(LENGTHS, dim=1)
    first = torch.cat([pieces[0][:, :1], pieces[0][:, 1:2], site(pieces[0][:, 2:])], dim=1)
    first[:, :1] = site(pieces[0][:, :1])
    expected = torch.cat([first, *(site(piece) for piece in pieces[1:])], dim=1)
    torch.testing.assert_close(refined, expected, rtol=1e-5, atol=1e-6)


def test_trainer_step_on_packed_batches_equals_padded_batches(tmp_path):
    """One SGD step of transformers' Trainer with DataCollatorWithFlattening moves a patched model exactly as the
    step on the same sequences padded does (the loss is the mean over the same predicted tokens)."""
    from datasets import Dataset

    seqs = sequences(3)
    data = Dataset.from_list([{"input_ids": s, "labels": s} for s in seqs])

    def trained(collator):
        model = model_of("patched", "wave", seed=4).train()
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "run"), per_device_train_batch_size=len(seqs), max_steps=1, learning_rate=0.5,
            optim="sgd", lr_scheduler_type="constant", report_to=[], use_cpu=True, save_strategy="no",
            logging_strategy="no", remove_unused_columns=False, dataloader_num_workers=0)
        transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collator).train()
        return dict(model.named_parameters())

    def padded(features):
        length = max(len(f["input_ids"]) for f in features)
        pad = lambda row, value: row + [value] * (length - len(row))  # noqa: E731
        return {"input_ids": torch.tensor([pad(f["input_ids"], 0) for f in features]),
                "attention_mask": torch.tensor([pad([1] * len(f["input_ids"]), 0) for f in features]),
                "labels": torch.tensor([pad(f["labels"], -100) for f in features])}

    flat, pad = trained(DataCollatorWithFlattening(return_tensors="pt")), trained(padded)
    moved = [name for name in flat if not torch.equal(flat[name], model_of("patched", "wave", seed=4).state_dict()[
        name]) and "pde" in name]
    assert moved, "the PDE coefficients did not train"
    for name in flat:
        torch.testing.assert_close(flat[name], pad[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("kind", ["patched", "native"])
def test_training_keeps_packed_rows_apart_with_the_default_use_cache(kind, checkpointing):
    """In training with `position_ids` neither model builds a cache unless asked (the config's default
    use_cache=True), so transformers' masks keep packed rows apart as the PDE walls do: the gradients of a packed
    batch are those of each sequence alone."""
    model = model_of(kind, "reaction_diffusion").train()
    model.config.use_cache = True
    if checkpointing:
        enable_checkpointing(model)
    seqs = sequences(2)
    model(**packed_batch(seqs)).loss.backward()
    packed = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total = sum(model(input_ids=torch.tensor([s]), labels=torch.tensor([s])).loss * (len(s) - 1) for s in seqs)
    (total / sum(len(s) - 1 for s in seqs)).backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_compiled_packed_training_forward_gives_no_dynamo_warning():
    """Compiled, the patch's forward pre-hook is traced: it reads whether the base model takes ``use_cache`` from its
    context (set when patched), not from a cached signature lookup that makes Dynamo warn of potential silent
    incorrectness; the compiled packed step gives the eager loss."""
    import warnings

    model = model_of("patched").train()
    batch = packed_batch(sequences(3))
    eager = model(**batch).loss
    compiled = torch.compile(model.forward, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = compiled(**batch).loss
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message)[:200] for w in caught]
    torch.testing.assert_close(loss, eager)


@pytest.mark.parametrize("placements", [ALL_PLACEMENTS, ["block_output"]])
@pytest.mark.parametrize("kind", ["patched", "native"])
def test_packed_rows_cannot_continue_a_cache(kind, placements):
    """A packed row starts its sequences: a packed prefill of an empty cache runs (also where the first site comes
    after the first attention, which has appended this forward's tokens by then), continuing a cache that holds past
    tokens with one raises. (With a cache transformers' own attention does not separate packed rows: no comparison
    with each sequence alone here.)"""
    from transformers import DynamicCache

    from cta.pde_cache import CACHE_ARGUMENT

    model = model_of(kind, placements=placements).eval()  # (a training forward keeps no PDE state in its cache)
    batch = packed_batch(sequences(5))
    inputs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True,
                  **{CACHE_ARGUMENT: DynamicCache(config=model.config)})
    model(**inputs)
    assert inputs[CACHE_ARGUMENT].get_seq_length() == batch["input_ids"].shape[1]
    with pytest.raises(ValueError, match="packed rows cannot continue a cache"):
        model(**inputs)
