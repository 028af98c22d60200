"""Where the host time of eager calls goes: decode steps, and the kernels' training path.

    python benchmarks/profile_host.py [--layers 8] [--hidden 4096] [--pairs 256] [--mask] [--split] [--site-timer]
    python benchmarks/profile_host.py --micro      # host time per call of each layer of the decode path
    python benchmarks/profile_host.py --refine     # host time per call of each layer of pde_refine's training path

The default mode splits the cost of a patched decode step (batch 1, greedy, through the cache) into variants, each
measured in per-token pairs against an unpatched copy of the model (``bench_patched_model.paired_decode``: every
token decoded by both models back to back, each step synchronised and timed by itself): patched; patched without the
prepared decode step (``_DecodePlan``: every step through ``PDERefinement``'s general fast path); pass-through
wrappers (the wrappers alone, no PDE); with ``--split`` also the refined token written to a new tensor instead of
over the wrapped layer's output (``patching_cta.DECODE_IN_PLACE = False``), the wrapper with a prepared step that
returns its input, and the prepared step without its launch. Each line gives the median over tokens of patched /
unpatched with a bootstrap 95% interval, and the extra microseconds per PDE site and token. ``--site-timer``: then
the host time of the patched layer, the layer inside it and the prepared PDE step, timed around each call while
decoding; last, a torch.profiler table of the patched model and the PDE kernels' device time. ``--mask`` passes an
all-ones attention mask with every step, as ``generate()`` does.

A batch-1 decode step of an eager transformers model is bound by host time (Python and launches), and so is a
forward+backward of a few thousand tokens; ``--micro`` and ``--refine`` time each layer of those paths by itself:
calls queued back to back on a tensor small enough that the GPU never waits, one synchronisation at the end.
``--refine`` then measures, in the same run, what that host time does to ``triton.testing.do_bench`` of a
forward+backward at ``--bench-shape`` with Triton's generic launch and with the direct launch
(``cta.triton_cta.DIRECT_LAUNCH``).
"""

import argparse
import time

import torch
from transformers import LlamaConfig

import cta
from bench_patched_model import llama_model  # the model of the model-level benchmarks


def decode(model, ids, tokens, mask=True):
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        ones = torch.ones(ids.shape[0], ids.shape[1] + tokens + 1, dtype=torch.long, device=ids.device)
        for i in range(tokens):
            step_mask = ones[:, : ids.shape[1] + i + 1] if mask else None
            out = model(token, past_key_values=cache, use_cache=True, attention_mask=step_mask)
            token = out.logits[:, -1:].argmax(-1)
    return token


def per_token_us(model, ids, tokens, device, mask=True):
    decode(model, ids, 4, mask)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    decode(model, ids, tokens, mask)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / tokens * 1e6


def site_costs(model, ids, args):
    """Per-token pairs of each decode variant against an unpatched copy of the model (see the module docstring);
    prints one line per variant. Leaves ``model`` patched."""
    import statistics

    import cta.patching_cta as patching
    import cta.pde_cta as pde_cta
    import cta.triton_cta as kernels
    from bench_patched_model import bootstrap_median, paired_decode

    bind, plan_call = kernels.bind_decode_update, pde_cta._DecodePlan.__call__

    def set_variant(name):
        kernels.bind_decode_update = bind
        pde_cta._DecodePlan.__call__ = plan_call
        for wrapper, output_pdes in output_pde_names.items():
            wrapper._output_pde_names = output_pdes
        patching.DECODE_IN_PLACE = True
        for _, pde in patching.pde_modules(model):
            pde.__dict__.pop("_decode_plan", None)
        if name == "patched, no prepared step":
            kernels.bind_decode_update = lambda *unused: None
        elif name == "patched, output not in place":
            patching.DECODE_IN_PLACE = False
        elif name == "pass-through wrappers":  # everything the wrappers do but refine
            for wrapper in output_pde_names:
                wrapper._output_pde_names = ()
        elif name == "prepared step: no launch":
            kernels.bind_decode_update = lambda *unused: lambda x, y, state, token_mask: None
        elif name == "wrapper returns its input":
            # Plans are still prepared (by each pass's first token); calling one then returns its input.
            pde_cta._DecodePlan.__call__ = lambda self, hidden_states, *unused: hidden_states

    names = ["patched", "patched, no prepared step", "pass-through wrappers"]
    if args.split:
        names += ["patched, output not in place", "wrapper returns its input", "prepared step: no launch"]
    cta.patch_model(model, pde_type="diffusion", pde_steps=args.steps, placement="block_output", init="paper")
    output_pde_names = {m: m._output_pde_names for m in model.modules() if isinstance(m, patching.CTAPatchWrapper)}
    unpatched = llama_model(args.layers, args.hidden, args.intermediate, 32000, torch.device(args.device), args.dtype)
    print(f"decode, batch 1, {args.layers} layers x {args.hidden}, {args.pairs} per-token pairs per variant against "
          f"an unpatched copy (median over tokens of patched / unpatched; 95% interval of that median by bootstrap), "
          f"{'all-ones attention mask' if args.mask else 'no attention mask'}:")
    for name in names:
        set_variant(name)
        pairs = paired_decode(model, unpatched, ids, 64, args.pairs, torch.device(args.device), mask=args.mask)
        ratios = [p / u for u, p in pairs]
        low, high = bootstrap_median(ratios)
        per_site = statistics.median(p - u for u, p in pairs) * 1e6 / args.layers
        unpatched_us, patched_us = (1e6 * statistics.median(side) for side in zip(*pairs))
        print(f"  {name:32s} {unpatched_us:7.0f} -> {patched_us:7.0f} us/token  "
              f"{100 * (statistics.median(ratios) - 1):+6.2f}% [{100 * (low - 1):+.2f}, {100 * (high - 1):+.2f}]  "
              f"{per_site:6.1f} us per site and token", flush=True)
    set_variant("patched")
    del unpatched


def site_timer(model, ids, args):
    """In-situ host time of a patched decode step's pieces: the patched layer as a whole (``CTAPatchWrapper``), the
    wrapped layer inside it, and the prepared PDE step (``_DecodePlan``), timed around each call while decoding
    (one-token calls only), against the unpatched layer timed the same way. Prints microseconds per call."""
    import cta.patching_cta as patching
    import cta.pde_cta as pde_cta

    totals = {}

    def timed(name, fn):
        def run(*a, **k):
            hidden = next((v for v in (*a, *k.values()) if torch.is_tensor(v) and v.dim() == 3), None)
            if hidden is None or hidden.shape[1] != 1:
                return fn(*a, **k)
            start = time.perf_counter_ns()
            out = fn(*a, **k)
            total = totals.setdefault(name, [0, 0])
            total[0] += time.perf_counter_ns() - start
            total[1] += 1
            return out

        return run

    results = {}
    for variant in ("unpatched", "patched"):
        if variant == "patched":
            cta.patch_model(model, pde_type="diffusion", pde_steps=args.steps, placement="block_output", init="paper")
        elif patching.is_patched(model):
            cta.unpatch_model(model)
        saved = patching.CTAPatchWrapper.__call__, pde_cta._DecodePlan.__call__
        inner = [layer._modules["wrapped"] if variant == "patched" else layer for layer in model.model.layers]
        try:
            patching.CTAPatchWrapper.__call__ = timed("patched layer (wrapper)", saved[0])
            pde_cta._DecodePlan.__call__ = timed("prepared PDE step", saved[1])
            for layer in inner:
                layer.forward = timed("decoder layer", layer.forward)
            decode(model, ids, 4, args.mask)
            totals.clear()
            per_token = per_token_us(model, ids, args.tokens, args.device, args.mask)
            results[variant] = (per_token, {k: v[0] / v[1] / 1e3 for k, v in totals.items()})
        finally:
            patching.CTAPatchWrapper.__call__, pde_cta._DecodePlan.__call__ = saved
            for layer in inner:
                layer.__dict__.pop("forward", None)
    print(f"in-situ host time while decoding ({args.layers} layers x {args.hidden}, "
          f"{'all-ones attention mask' if args.mask else 'no attention mask'}), us per call:")
    for variant, (per_token, parts) in results.items():
        print(f"  {variant:10s} {per_token:8.0f} us/token; " + "; ".join(f"{k} {v:.1f}" for k, v in parts.items()))


def per_call_us(fn, device, n=2000):
    """Host microseconds per call: median of 5 rounds of ``n`` calls queued back to back, one sync per round."""
    import statistics

    rounds = []
    for _ in range(5):
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(rounds)


def micro(args):
    """Host microseconds per call of each layer of the decode path (median of 5 rounds of 2000 calls)."""
    from transformers import DynamicCache

    import cta.triton_cta as kernels
    from cta.pde_cta import PDERefinement

    device = args.device
    config = LlamaConfig(num_hidden_layers=1, layer_types=["hybrid"], number_of_conv_states=1, hidden_size=128,
                         num_attention_heads=1)
    pde = PDERefinement(args.hidden, "diffusion", args.steps, causal=True, alpha=0.1, layer_idx=0).to(device)
    cache = DynamicCache(config=config)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.no_grad():
        pde(torch.randn(1, 8, args.hidden, device=device, dtype=dtype), None, cache)
    state = cache.layers[0].conv_states[0]
    h = torch.randn(1, 1, args.hidden, device=device, dtype=dtype)
    alpha, beta = pde._inference_coefficients()

    rows = [("torch.empty_like(h)", lambda: torch.empty_like(h)),
            ("h.add_(0) (one aten launch)", lambda: h.add_(0))]
    y = torch.empty_like(h)
    block_c = min(kernels._next_pow2(args.hidden), 1024)
    grid = (kernels._cdiv(args.hidden, block_c), 1)
    rows.append(("triton JIT launch of the decode kernel", lambda: kernels._pde_decode_kernel[grid](
        h, y, state, h, alpha, alpha, args.hidden, h.stride(0), state.stride(0), state.stride(1),
        PDE=0, STEPS=args.steps, HAS_MASK=False, A_VEC=False, B_VEC=False, BLOCK_C=block_c, num_warps=4)))
    compiled = rows[-1][1]()
    print(f"active launch hooks: {kernels._launch_hooks()}; JIT launch returned {type(compiled).__name__} "
          f"(packed_metadata: {hasattr(compiled, 'packed_metadata')})", flush=True)
    if hasattr(compiled, "packed_metadata"):
        import triton

        def direct_run():
            stream = triton.runtime.driver.active.get_current_stream(h.device.index)
            compiled.run(grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                         h, y, state, h, alpha, alpha, args.hidden, h.stride(0), state.stride(0), state.stride(1),
                         0, args.steps, False, False, False, block_c)
        rows.append(("compiled kernel .run (no JIT dispatch)", direct_run))
        pointers = [t.data_ptr() for t in (h, y, state, h, alpha, alpha)]

        def integer_pointers_run():
            stream = triton.runtime.driver.active.get_current_stream(h.device.index)
            compiled.run(grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                         *pointers, args.hidden, h.stride(0), state.stride(0), state.stride(1),
                         0, args.steps, False, False, False, block_c)
        rows.append(("  the same with integer pointers", integer_pointers_run))
        if hasattr(compiled.run, "launch"):  # Triton's CudaLauncher: Python around its C launch function
            stubbed_launcher = compiled.run
            rows.append(("  its Python part alone (C launch stubbed)", integer_pointers_run))
            launcher = kernels._launcher(compiled)
            if hasattr(launcher, "c_launch"):  # what the cached launches call (triton_cta.RAW_C_LAUNCH)
                c_launch, cooperative, pdl = launcher.c_launch

                def c_launch_run():
                    stream = triton.runtime.driver.active.get_current_stream(h.device.index)
                    c_launch(grid[0], grid[1], 1, stream, compiled.function, cooperative, pdl, None, None,
                             compiled.packed_metadata, None, None, None, *pointers, args.hidden, h.stride(0),
                             state.stride(0), state.stride(1), 0, args.steps, False, False, False, block_c)
                rows.append(("  its C launch function called directly", c_launch_run))
    for direct in (False, True):
        def update(direct=direct):
            kernels.DIRECT_LAUNCH = direct
            return kernels.pde_decode_update(h, state, alpha, beta, None, 0, args.steps)
        rows.append((f"pde_decode_update (direct launch {direct})", update))
    kernels.DIRECT_LAUNCH = True
    rows.append(("PDERefinement(h, None, cache) decode", lambda: pde(h, None, cache)))
    with torch.no_grad():
        pde(h, None, cache)  # prepares the plan (GPU with direct launch)
    plan = pde.__dict__.get("_decode_plan")
    if plan is not None:
        rows.append(("  its prepared step alone (_DecodePlan call)", lambda: plan(h, cache)))
    with torch.no_grad():
        for name, fn in rows:
            saved = None
            if "C launch stubbed" in name:
                saved, stubbed_launcher.launch = stubbed_launcher.launch, lambda *unused: None
            try:
                print(f"{name:45s} {per_call_us(fn, device):8.1f} us/call", flush=True)
            finally:
                if saved is not None:
                    stubbed_launcher.launch = saved


def micro_refine(args):
    """Host microseconds per call of each layer of the eager training path of ``pde_refine_triton`` (diffusion,
    per-channel alpha, bf16), with Triton's generic launch and with the direct launch; then do_bench medians of a
    forward+backward at ``--bench-shape`` both ways, and of ``y.copy_(x)``, in the same run."""
    import cta.triton_cta as kernels
    from triton.testing import do_bench

    device, steps, causal = args.device, args.steps, args.causal
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(1, 64, args.hidden, device=device, dtype=dtype)
    alpha = torch.full((args.hidden,), 0.1, device=device, requires_grad=True)
    kw = dict(pde_type="diffusion", steps=steps, alpha=alpha, causal=causal)

    def fwd_bwd(x, grad):
        xx = x.detach().requires_grad_(True)

        def run():
            xx.grad = None
            alpha.grad = None
            kernels.pde_refine_triton(xx, **kw).backward(grad)
        return run

    grad = torch.randn_like(x)
    rows = [("y.copy_(x) (one aten launch)", lambda: grad.copy_(x))]
    no_grad = torch.no_grad()
    for direct in (False, True):
        def layer(fn, direct=direct):
            def call():
                kernels.DIRECT_LAUNCH = direct
                return fn()
            return call
        tag = "direct" if direct else "generic"
        rows += [
            (f"_launch_fwd ({tag})", layer(no_grad(lambda: kernels._launch_fwd(
                x, alpha, None, None, None, "diffusion", steps, causal, False)))),
            (f"_launch_bwd ({tag})", layer(no_grad(lambda: kernels._launch_bwd(
                grad, x, alpha, None, None, None, "diffusion", steps, causal, need_db=False)))),
            (f"pde_refine_triton, no grad ({tag})",
             layer(no_grad(lambda: kernels.pde_refine_triton(x.detach(), **kw)))),
            (f"pde_refine_triton, forward with grad ({tag})",
             layer(lambda: kernels.pde_refine_triton(x.detach().requires_grad_(True), **kw))),
            (f"forward + backward ({tag})", layer(fwd_bwd(x, grad))),
        ]
    for name, fn in rows:
        print(f"{name:50s} {per_call_us(fn, device):8.1f} us/call", flush=True)
    if device == "cuda":
        shape = tuple(int(v) for v in args.bench_shape.split("x"))
        big = torch.randn(shape, device=device, dtype=dtype)
        out = torch.empty_like(big)
        big_grad = torch.randn_like(big)
        copy = do_bench(lambda: out.copy_(big), warmup=10, rep=50, return_mode="median")
        print(f"do_bench {args.bench_shape}: copy {copy * 1e3:.1f} us", flush=True)
        for direct in (False, True):
            kernels.DIRECT_LAUNCH = direct
            t = do_bench(fwd_bwd(big, big_grad), warmup=10, rep=50, return_mode="median")
            print(f"do_bench {args.bench_shape} forward+backward ({'direct' if direct else 'generic'} launch): "
                  f"{t * 1e3:.1f} us = {t / copy:.2f}x copy", flush=True)
    kernels.DIRECT_LAUNCH = True


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (the model of bench_patched_model)")
    parser.add_argument("--tokens", type=int, default=48, help="decoded tokens per timing")
    parser.add_argument("--pairs", type=int, default=256, help="per-token pairs of each decode variant")
    parser.add_argument("--mask", action="store_true", help="pass an all-ones attention mask with every step")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--micro", action="store_true", help="host time per call of each layer of the decode path")
    parser.add_argument("--refine", action="store_true",
                        help="host time per call of each layer of pde_refine's eager training path (Triton)")
    parser.add_argument("--causal", action="store_true", help="--refine: the causal scheme (default bidirectional)")
    parser.add_argument("--site-timer", action="store_true",
                        help="also time the patched layer, its wrapped layer and the PDE step in situ while decoding")
    parser.add_argument("--split", action="store_true",
                        help="also time the prepared step in pieces: the refined token written to a new tensor, the "
                             "wrapper with a step that returns its input, and the step without its launch")
    parser.add_argument("--bench-shape", default="1x4096x4096",
                        help="--refine: shape of the do_bench forward+backward, generic vs direct launch")
    args = parser.parse_args()
    if args.micro:
        micro(args)
        return
    if args.refine:
        micro_refine(args)
        return
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    args.intermediate = int(round(11008 * args.hidden / 4096 / 64)) * 64  # as bench_patched_model
    model = llama_model(args.layers, args.hidden, args.intermediate, 32000, torch.device(args.device), args.dtype)
    ids = torch.randint(0, 32000, (1, 512), device=args.device)
    site_costs(model, ids, args)
    if args.site_timer:
        site_timer(model, ids, args)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        decode(model, ids, 8, args.mask)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    for event in prof.key_averages():
        if "pde" in event.key:  # the PDE kernels' device time (not among the rows above)
            print(f"{event.key[:60]:60s} calls {event.count:5d}  device time per call "
                  f"{getattr(event, 'device_time', 0.0):.2f} us")


if __name__ == "__main__":
    main()
