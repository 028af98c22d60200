"""QLoRA with CTA (GPU only): a 4-bit (bitsandbytes nf4) Llama, patched after loading, trains LoRA + PDE.

The PDE coefficients stay trainable in fp32 after ``peft.prepare_model_for_kbit_training`` (which freezes every
parameter and upcasts the rest), they move in training, and the saved adapter reloads onto a freshly loaded and
patched 4-bit base with identical outputs.
"""

import importlib.util

import pytest
import torch

import cta

pytestmark = pytest.mark.gpu
requires_bnb = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None
    or importlib.util.find_spec("peft") is None,
    reason="needs CUDA, bitsandbytes and peft",
)
PATCH = dict(pde_type="diffusion", pde_steps=4, placement="block_output", init="paper")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # hidden 256: bitsandbytes quantizes Linear layers in blocks of 64; big enough that every projection is 4-bit.
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _patched_4bit_base(path, patch=True):
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, dtype=torch.bfloat16,
                                                 device_map={"": 0})
    if patch:
        cta.patch_model(model, **PATCH)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


@requires_bnb
def test_qlora_trains_pde_in_fp32_and_adapter_reloads(llama_dir, tmp_path):
    import bitsandbytes as bnb
    from peft import PeftModel, get_peft_model

    base = _patched_4bit_base(llama_dir)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in base.modules()), "the base did not load in 4 bits"
    assert any(isinstance(m, cta.PDERefinement) for m in base.modules()), "no PDE site on the 4-bit base"
    config = cta.CTALoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                               task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    pde = {n: p for n, p in model.named_parameters() if "_pde." in n and "original_module" not in n}
    assert pde and all(p.requires_grad and p.dtype == torch.float32 for p in pde.values()), \
        {n: (p.requires_grad, p.dtype) for n, p in pde.items()}
    before = {n: p.detach().clone() for n, p in pde.items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1)).cuda()
    losses = []
    model.train()
    for _ in range(5):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in pde.values())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    assert all(not torch.equal(before[n], p.detach()) for n, p in pde.items()), "a PDE coefficient did not move"

    model.save_pretrained(tmp_path / "adapter")
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    for patch in (True, False):  # a patched 4-bit base, and the plain one (the adapter applies its patch)
        reloaded = PeftModel.from_pretrained(_patched_4bit_base(llama_dir, patch), tmp_path / "adapter").eval()
        with torch.no_grad():
            got = reloaded(input_ids=ids).logits
        assert torch.equal(got, expected), (patch, (got - expected).abs().max())
        for name, param in reloaded.named_parameters():
            if name in pde:
                assert param.dtype == torch.float32 and torch.equal(param, pde[name]), (patch, name)
