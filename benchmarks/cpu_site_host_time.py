"""CPU host time per PDE site of a patched decoder's one-token step: a tiny Llama (8 layers x 64), one thread.

    python benchmarks/cpu_site_host_time.py --placement block_output [--identity-step | --floor-step]

Each round times the median decode step of the unpatched model, then of the patched copy (same weights; 100 tokens
each, the all-ones mask generate() passes); prints the median and lower quartile over rounds of (patched - unpatched)
/ sites. ``--identity-step`` replaces the one-token PDE step by the identity (prefill stays real: it stores the state
the continuation check asks for), so what remains is the structure's cost: hooks, lookups, module calls.
``--floor-step`` replaces it by the fewest eager torch ops a linear scheme's update with scalar coefficients needs
(one concatenation, one matrix product, the state write, the decode map formed once and never re-checked; batch 1):
a lower bound of what any eager torch implementation of the step costs in situ. A shared
CPU makes single rounds noisy: compare trees within one session, alternating (``PYTHONPATH=<tree>``).
"""

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import cta  # noqa: E402
from cta.pde_cache import CACHE_ARGUMENT  # noqa: E402
from cta.pde_cta import PDERefinement  # noqa: E402
from cta.patching_cta import patch_model, pde_modules  # noqa: E402


@contextlib.contextmanager
def substitute_decode_step(mode: str):
    """Within the block, a PDE site's one-token step is replaced (prefill stays real: it stores the state the
    continuation check asks for): ``identity`` returns the token (what remains is the structure: hooks, lookups,
    module calls); ``floor`` runs the fewest eager torch ops a linear scheme's update with scalar coefficients needs
    (one concatenation, one matrix product, the state write; the decode map formed once and never re-checked;
    batch 1), a lower bound of any eager torch implementation of the step."""
    from cta.pde_cache import cached_pde_state
    from cta.pde_decode import causal_decode_map

    real = PDERefinement.forward
    maps = {}

    def substitute(self, h, attention_mask=None, cache=None):
        if h.shape[1] != 1:
            return real(self, h, attention_mask, cache)
        if mode == "identity":
            return h
        state = cached_pde_state(cache, self.layer_idx, self.state_idx)
        if self not in maps:
            alpha, beta = self.coefficients()
            maps[self] = causal_decode_map(self.pde_type, self.steps, alpha.detach(), beta, state.dtype)[..., 0]
        levels = torch.mm(maps[self], torch.cat([h[0], state[0]]))
        state[0].copy_(levels[:-1])
        return levels[-1:].unsqueeze(0)

    PDERefinement.forward = substitute
    try:
        yield
    finally:
        PDERefinement.forward = real


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--placement", default="block_output", help="a placement or a JSON list of them")
    parser.add_argument("--pde-type", default="diffusion")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--identity-step", action="store_true")
    parser.add_argument("--floor-step", action="store_true")
    args = parser.parse_args()
    placement = json.loads(args.placement) if args.placement.startswith("[") else args.placement
    substitution = contextlib.ExitStack()  # (held for the whole run: closing it restores the real step)
    if args.identity_step or args.floor_step:
        substitution.enter_context(substitute_decode_step("identity" if args.identity_step else "floor"))
    torch.set_num_threads(1)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config).eval()
    patched = patch_model(copy.deepcopy(plain), pde_type=args.pde_type, pde_steps=4, placement=placement,
                          init="paper", backend="torch")
    sites = len(pde_modules(patched))
    ids = torch.randint(0, 128, (1, 16))
    mask = torch.ones(1, 16 + args.tokens + 1, dtype=torch.long)

    def step_time(model):
        with torch.no_grad():
            out = model(ids, use_cache=True)
            cache, token = getattr(out, CACHE_ARGUMENT), out.logits[:, -1:].argmax(-1)
            times = []
            for t in range(args.tokens):
                start = time.perf_counter()
                out = model(token, attention_mask=mask[:, :17 + t], use_cache=True, **{CACHE_ARGUMENT: cache})
                times.append(time.perf_counter() - start)
                token = out.logits[:, -1:].argmax(-1)
        return statistics.median(times)

    diffs, unpatched = [], []
    for _ in range(args.rounds):
        a, b = step_time(plain), step_time(patched)
        diffs.append(b - a)
        unpatched.append(a)
    diffs.sort()
    step = "identity" if args.identity_step else "floor" if args.floor_step else "real"
    print(f"{cta.__file__}: placement={placement} {args.pde_type} sites={sites} step={step}: "
          f"unpatched step median {statistics.median(unpatched) * 1e6:.0f} us; host time per site: median "
          f"{statistics.median(diffs) / sites * 1e6:.1f} us, lower quartile {diffs[len(diffs) // 4] / sites * 1e6:.1f} us; "
          f"per token {100 * statistics.median(diffs) / statistics.median(unpatched):+.1f}%")


if __name__ == "__main__":
    main()
