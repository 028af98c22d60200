"""A PDE site over a serving engine's flat batch (cta/pde_serving.py, what the vLLM plugin's site calls): sequences
served as a scheduler serves them (chunked prefill under a token budget, one-token decodes batched first, states in
slots of a table that also holds other sequences' states) equal the operator on each whole sequence. On CPU (the
reference) and, ``gpu``-marked, on CUDA through the Triton paths in the same state layout."""

import os
import random

import pytest
import torch

from cta.pde_cta import coefficient_bounds, pde_refine_reference
from cta.pde_serving import FlatBatch, refine_flat_batch

TYPES = ["diffusion", "wave", "reaction_diffusion", "advection_diffusion"]


def _coefficients(pde_type, channels, per_channel, generator):
    (a_low, a_high), beta_bounds = coefficient_bounds(pde_type, True)
    shape = (channels,) if per_channel else (1,)
    alpha = a_low + (a_high - a_low) * torch.rand(shape, generator=generator)
    beta = None if beta_bounds is None else beta_bounds[0] + (beta_bounds[1] - beta_bounds[0]) * torch.rand(
        shape, generator=generator)
    return alpha, beta


def serve_like_a_scheduler(sequences, prompt_lengths, budget, operator, device, dtype, seed=0):
    """Feeds each sequence's first ``prompt_lengths[i]`` tokens as prefill chunks of at most ``budget`` tokens per
    step, the rest one token per step, decodes first in each flat batch (as vLLM orders them); states in random slots
    of a 3x larger table whose other rows are garbage. Returns every sequence's outputs."""
    rng = random.Random(seed)
    steps, channels = operator["steps"], sequences[0].shape[-1]
    table = torch.randn(3 * len(sequences) + 1, steps, channels, device=device, dtype=torch.float32)
    slots = rng.sample(range(table.shape[0]), len(sequences))
    done = [0] * len(sequences)
    outputs = [torch.empty_like(s) for s in sequences]
    while any(d < len(s) for d, s in zip(done, sequences)):
        decode = [i for i, s in enumerate(sequences) if prompt_lengths[i] <= done[i] < len(s)]
        tokens, left = [sequences[i][done[i]] for i in decode], budget - len(decode)
        starts, chunk_of, continues = [len(decode)], [], []
        for i, s in enumerate(sequences):
            if done[i] < prompt_lengths[i] and left > 0:
                size = min(prompt_lengths[i] - done[i], left, rng.randint(1, budget))
                tokens.extend(s[done[i]:done[i] + size])
                chunk_of.append((i, size))
                continues.append(done[i] > 0)
                starts.append(starts[-1] + size)
                left -= size
        padding = rng.randint(0, 3)  # tokens that pad the batch (a CUDA graph's size)
        flat = torch.stack(tokens + [torch.randn_like(tokens[0])] * padding)
        batch = FlatBatch.of(torch.tensor([slots[i] for i in decode], device=device) if decode else None,
                             prefill_starts=starts if chunk_of else [], prefill_slots=[slots[i] for i, _ in chunk_of],
                             prefill_continues=continues)
        out = torch.full_like(flat, float("nan")) if rng.random() < 0.5 else None  # (an engine's output buffer)
        output = refine_flat_batch(flat, table, batch, out=out, **operator)
        assert out is None or output is out
        assert torch.equal(output[len(tokens):], flat[len(tokens):]), "padding tokens pass through"
        for row, i in enumerate(decode):
            outputs[i][done[i]] = output[row]
            done[i] += 1
        for (i, size), start in zip(chunk_of, starts):
            outputs[i][done[i]:done[i] + size] = output[start:start + size]
            done[i] += size
    return outputs


def _check(pde_type, per_channel, device, dtype, tolerance):
    generator = torch.Generator().manual_seed(TYPES.index(pde_type))
    channels, steps = 24, 3
    alpha, beta = _coefficients(pde_type, channels, per_channel, generator)
    lengths = [1, 7, 40, 23, 64]
    prompts = [1, 5, 33, 9, 60]
    sequences = [torch.randn(n, channels, generator=generator) for n in lengths]
    operator = dict(pde_type=pde_type, steps=steps, alpha=alpha.to(device), beta=None if beta is None else
                    beta.to(device))
    served = serve_like_a_scheduler([s.to(device, dtype) for s in sequences], prompts, budget=16, operator=operator,
                                    device=device, dtype=dtype)
    for sequence, out in zip(sequences, served):
        expected = pde_refine_reference(sequence.to(dtype).unsqueeze(0), pde_type=pde_type, steps=steps, alpha=alpha,
                                        beta=beta, causal=True)[0]
        torch.testing.assert_close(out.float().cpu(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("pde_type", TYPES)
@pytest.mark.parametrize("per_channel", [False, True])
def test_a_flat_batch_served_in_chunks_equals_the_whole_sequences(pde_type, per_channel):
    _check(pde_type, per_channel, "cpu", torch.float32, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("CTA_TEST_GPU", "0") in ("", "0"),
                    reason="needs a CUDA GPU (and CTA_TEST_GPU=1)")
@pytest.mark.parametrize("pde_type", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_paths_serve_the_flat_batch(pde_type, dtype):
    """On CUDA the decodes run the fused decode kernel on the gathered slot states and the chunks the fused forward
    with an initial state: the same results in the state layout the vLLM site uses."""
    _check(pde_type, True, "cuda", dtype, 1e-5 if dtype == torch.float32 else 2e-2)
