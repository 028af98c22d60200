"""Every PEFT way of loading a CTA adapter, onto every kind of base: the trained model exactly, or an error.

Trains two adapters of a patched tiny Llama (random weights, no download) for a few steps, with coefficients set far
from the identity so that a dropped PDE would show: LoRA + PDE and the PDE alone (``cta.CTALoraConfig``). Each is
loaded with ``PeftModel.from_pretrained``, ``AutoPeftModelForCausalLM.from_pretrained`` and transformers'
``model.load_adapter`` onto the plain base, a base patched with the adapter's spec and one patched with another
spec; each load's logits on a left-padded batch are compared with the trained model's. Writes
``results/adapter_loads.json`` and ``.md`` (read by docs/adapters.md); ``tests/test_adapters.py`` asserts the same
table.

    python scripts/adapter_loads.py [--out results] [--work DIR]
"""

import argparse
import json
import tempfile
from pathlib import Path

import peft
import torch
import transformers
from peft import AutoPeftModelForCausalLM, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import cta

ROOT = Path(__file__).resolve().parents[1]
SPEC = dict(pde_type="diffusion", pde_steps=2, placement=["value", "block_output"])
OTHER_SPEC = dict(pde_type="diffusion", pde_steps=4, placement=["value", "block_output"])
KINDS = {"lora_pde": ["q_proj", "v_proj"], "pde_alone": []}  # LoRA target modules
LABELS = {"lora_pde": "LoRA + PDE", "pde_alone": "PDE alone"}
BASES = ("plain", "same_spec", "other_spec")


def tiny_config():
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def batch():
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the padding walls must load too
    return ids, mask


def logits(model):
    ids, mask = batch()
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def _fill_pde(model, value):
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "_pde." in name and param.requires_grad:
                param.fill_(value)


def make_adapters(root: Path) -> dict:
    """Saves the bases (plain, patched with SPEC, patched with OTHER_SPEC) and the trained adapters under ``root``;
    returns ``{kind: (trained logits, logits with the PDE off)}``."""
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config()).save_pretrained(root / "plain")
    for name, spec in (("same_spec", SPEC), ("other_spec", OTHER_SPEC)):
        cta.patch_model(LlamaForCausalLM.from_pretrained(root / "plain"), **spec).save_pretrained(root / name)
    ids, mask = batch()
    trained = {}
    for kind, targets in KINDS.items():
        model = cta.patch_model(LlamaForCausalLM.from_pretrained(root / "plain"), **SPEC)
        peft_model = get_peft_model(model, cta.CTALoraConfig(r=4, target_modules=targets, task_type="CAUSAL_LM",
                                                             lora_dropout=0.0))
        optimizer = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=0.5)
        peft_model.train()
        for _ in range(3):
            peft_model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        _fill_pde(peft_model, -30.0)  # projected onto 0: the PDE off
        off = logits(peft_model)
        _fill_pde(peft_model, 2.0)  # far from the identity, so that a dropped PDE shows
        trained[kind] = (logits(peft_model), off)
        peft_model.save_pretrained(root / kind)
    return trained


def load(root: Path, loader: str, kind: str, base: str):
    """The model that ``loader`` makes of adapter ``kind`` and base ``base`` (raises what the loader raises)."""
    if loader == "PeftModel.from_pretrained":
        return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / base), root / kind)
    if loader == "model.load_adapter":
        model = AutoModelForCausalLM.from_pretrained(root / base)
        model.load_adapter(str(root / kind))
        return model
    folder = root / f"{kind}_on_{base}"  # AutoPeftModel loads the base named in the adapter's config
    folder.mkdir(exist_ok=True)
    for file in (root / kind).iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(dict(config, base_model_name_or_path=str(root / base))))
    return AutoPeftModelForCausalLM.from_pretrained(folder)


LOADERS = ("PeftModel.from_pretrained", "AutoPeftModelForCausalLM", "model.load_adapter")


def load_matrix(root: Path, trained: dict) -> list:
    """One row per loader, adapter kind and base: ``max_abs_diff`` from the trained logits, or the ``error``."""
    rows = []
    for loader in LOADERS:
        for kind, (expected, _) in trained.items():
            for base in BASES:
                row = dict(loader=loader, adapter=kind, base=base)
                try:
                    row["max_abs_diff"] = (logits(load(root, loader, kind, base)) - expected).abs().max().item()
                except ValueError as err:
                    row["error"] = f"{type(err).__name__}: {err}"
                rows.append(row)
    return rows


def render(result: dict) -> str:
    lines = [f"Max \\|logit - trained logit\\| of each load (a tiny Llama; transformers {result['transformers']}, "
             f"peft {result['peft']}). The same adapters without their PDE are off by {result['pde_effect']:.3f}.",
             "", "| loader | adapter | plain base | base patched the same | base patched otherwise |",
             "|---|---|---|---|---|"]
    for loader in LOADERS:
        for kind in KINDS:
            cells = []
            for base in BASES:
                row = next(r for r in result["rows"] if (r["loader"], r["adapter"], r["base"]) == (loader, kind, base))
                cells.append(f"{row['max_abs_diff']:.1e}" if "error" not in row else "raises: " + (
                    "another spec" if "patched with" in row["error"] else "needs transformers >= 5.18"))
            lines.append(f"| `{loader}` | {LABELS[kind]} | "
                         + " | ".join(cells) + " |")
    lines += ["", f"Reproduce: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "results"), help="folder for adapter_loads.json / .md")
    parser.add_argument("--work", help="folder for the bases and adapters (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.work or tmp)
        trained = make_adapters(root)
        result = dict(transformers=transformers.__version__, peft=peft.__version__, torch=torch.__version__,
                      pde_effect=max((t - off).abs().max().item() for t, off in trained.values()),
                      rows=load_matrix(root, trained), command="python scripts/adapter_loads.py")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_loads.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "adapter_loads.md").write_text(render(result))
    print(render(result))
    return result


if __name__ == "__main__":
    main()
