"""Where a compiled decode step's host time goes (CUDA graphs on a GPU; Dynamo's share on the CPU): the findings of
docs/decoding.md on the compiled step.

    python benchmarks/compiled_profile.py compiled-host [--rounds 15]   # a compiled step's host time (GPU)
    python benchmarks/compiled_profile.py dynamo-host [--loops 15]      # ... Dynamo's part, by piece (CPU)
    python benchmarks/compiled_profile.py inputs                        # a compiled call's cost per input (GPU)

``compiled-host``: the host time a patched model adds to a compiled decode step (``generate()`` with a static cache,
CUDA graphs) of a small model whose GPU time is negligible, per step and in the compiled call itself: unpatched,
patched with 1 and 4 steps per site, 4 steps through :func:`subclass_layers` (the floor: no hooks, walls or checks;
its tokens are checked against the package's), and 4 steps with the step replaced by the identity (the hooks and
cache lookups alone), in rounds that time every row (the order rotating); then one profiled call per row for
Dynamo's guard evaluation per step. Writes ``compiled_host_<gpu>.json`` / ``.md``.

``dynamo-host`` (CPU): what Dynamo itself does per call of a compiled decode step (``torch.compile(model.forward,
fullgraph=True)`` through a ``StaticCache``, a backend that returns the graph's first outputs, so a call is guard
evaluation, input gathering and the replay of side effects), for the patched model taken apart: its classes and cache
alone (hooks removed), the base model's hooks alone, the layer hooks as no-ops, both, the site without its PDE
(``PDERefinement.forward`` returning the token), the full site with 1 and 4 steps, the layers subclassed instead of
hooked (:func:`subclass_layers`: calling their class's forward alone, and the floor); each with and without guard
evaluation (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``), the least over ``--loops`` loops, the median
over ``--processes`` fresh processes. Writes ``dynamo_host_cpu.json`` / ``.md``.

``inputs``: what one more tensor input costs a compiled, CUDA-graphed call (``torch.compile(mode="reduce-overhead",
fullgraph=True)``) in torch alone, the cost that the step buffers of the PDE sites carry: a function (its own code
object per model, :func:`own_code`) calling a module whose forward returns ``2 * x`` of a ``[1, --channels]`` token
and either reads ``n`` registered buffers of that shape (summed into the output) or writes each in place
(``b.mul_(0.5).add_(x)``), for each ``n`` of ``--counts``; host µs per call (calls queued without synchronising; the
GPU work is a few pointwise kernels), the median over ``--repeats`` loops, all models timed in turn in each of
``--rounds`` rounds; the slope in µs per input is fitted over the counts. Writes ``compiled_inputs_<gpu>.json`` /
``.md``.

The compiled decode step's kernels and generate() overheads are ``bench_generate.py``'s; an eager step's costs are
``decode_profile.py``'s.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers  # noqa: E402
from bench_generate import subclass_layers  # noqa: E402
from bench_patched_model import llama_model  # noqa: E402
from decode_profile import per_call_us, step_variant  # noqa: E402
from results_io import TokenClock, run_command, write_result_files  # noqa: E402

from cta.patching_cta import patch_model  # noqa: E402
from cta.pde_cta import PDERefinement  # noqa: E402

FLOOR = "4 steps, the floor (subclassed layers: no hooks, walls or checks)"
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def cuda_or_smoke(name: str, what: str) -> torch.device:
    """``--device``: a CUDA device where there is one, or the CPU for a smoke test; exits when CUDA was asked for and
    is missing."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"compiled_profile.py {what}: it needs a GPU (or --device cpu for a smoke test).")
    return device


def time_compiled_calls(model) -> list:
    """Has ``model``'s compiled decode step (what transformers' ``get_compiled_call`` returns to ``generate()``)
    append the host time of each call to the returned list."""
    inside, compiled_call = [], model.get_compiled_call

    def get_compiled_call(compile_config):
        call = compiled_call(compile_config)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            output = call(*args, **kwargs)
            inside.append(time.perf_counter() - start)
            return output

        return timed

    model.get_compiled_call = get_compiled_call
    return inside


def run_compiled_host(argv):
    p = argparse.ArgumentParser(prog="compiled_profile.py compiled-host",
                                description="the host time a patched model adds to a compiled decode step")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256, help="small: the GPU time of a step is negligible")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per generate() call")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--device", default="cuda", help="'cpu': a smoke test (no CUDA graphs, no guard profile)")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    device = cuda_or_smoke(args.device, "compiled-host times CUDA-graph decode steps")
    unpatched = llama_model(args.layers, args.hidden, 2 * args.hidden, 256, device, torch.bfloat16)
    models = {"unpatched": unpatched}
    for steps, name in ((1, "1 step"), (4, "4 steps"), (4, FLOOR)):
        models[name] = patched = llama_model(args.layers, args.hidden, 2 * args.hidden, 256, device, torch.bfloat16)
        patch_model(patched, pde_type="diffusion", pde_steps=steps, placement="block_output", init="paper")
        patched.to(device)
    subclass_layers(models[FLOOR])
    prompt = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(3)).to(device)

    calls = {id(model): time_compiled_calls(model) for model in models.values()}

    def generate(model, tokens):
        """(the median time between decoded tokens, the median host time of a compiled call, the tokens)"""
        clock, inside = TokenClock(), calls[id(model)]
        inside.clear()
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                                 min_new_tokens=tokens, do_sample=False, pad_token_id=0, cache_implementation="static",
                                 streamer=clock)
        return clock.median_step(), statistics.median(inside) if inside else float("nan"), out  # (CPU: not compiled)

    cases = {**{name: (model, "package") for name, model in models.items()},
             "4 steps, the identity step": (models["4 steps"], "identity")}
    warm = {}
    for name, (model, variant) in cases.items():  # compiled, CUDA graphs recorded
        with step_variant(variant):
            generate(model, 8), generate(model, 8)
            warm[name] = generate(model, 8)[2]
    floor_exact = bool(torch.equal(warm[FLOOR], warm["4 steps"]))  # (the floor computes the package's tokens)
    times = {name: [] for name in cases}  # [(step, compiled call)] per round
    names = list(cases)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # (the order rotates between rounds)
            model, variant = cases[name]
            with step_variant(variant):
                times[name].append(generate(model, args.tokens)[:2])
    rows = {}
    for name, values in times.items():
        pairs = list(zip(values, times["unpatched"]))
        rows[name] = {"step_us": 1e6 * statistics.median(v[0] for v in values),
                      "added_us": 1e6 * statistics.median(v[0] - u[0] for v, u in pairs),
                      "call_us": 1e6 * statistics.median(v[1] for v in values),
                      "added_call_us": 1e6 * statistics.median(v[1] - u[1] for v, u in pairs)}
    for name, (model, variant) in cases.items():  # Dynamo's guard evaluation per step (the profiler's own event)
        with step_variant(variant), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            generate(model, args.tokens)
        lookups = [e for e in prof.events() if e.name == "TorchDynamo Cache Lookup"]
        rows[name]["guard_us"] = sum(e.cpu_time_total for e in lookups) / max(len(lookups), 1)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    info = dict(device=gpu, torch=torch.__version__, transformers=transformers.__version__, layers=args.layers,
                hidden=args.hidden, tokens=args.tokens, rounds=args.rounds, rows=rows, step_seconds=times,
                floor_tokens_equal_package=floor_exact,
                command="python benchmarks/compiled_profile.py compiled-host " + " ".join(argv))
    lines = [f"# Host time a patched model adds to a compiled decode step ({gpu})", "",
             f"A small Llama ({args.layers} layers x {args.hidden} hidden, bf16: the GPU time of a step is "
             "negligible, so the step time is host time), `generate(cache_implementation=\"static\")` (compiled, "
             f"CUDA graphs), batch 1, {args.tokens} new tokens; PDE after every block (diffusion). Step: the median "
             f"time between decoded tokens, median over {args.rounds} rounds (each times every row, in an order that "
             "rotates); compiled call: the median host time of the call of the compiled step itself (from "
             "transformers' `get_compiled_call`: guards, Dynamo, AOTAutograd's wrappers, the CUDA-graph replay), the "
             "rest of a step being `generate()`'s Python around it and the wait for the GPU; added: the median over "
             "rounds of the row's value minus the unpatched one; guards: the profiler's \"TorchDynamo Cache Lookup\" "
             "per compiled call (guard evaluation), one profiled call per row. transformers "
             f"{info['transformers']}, torch {info['torch']}.", "",
             "| model | µs per step | added | µs per compiled call | added | guard evaluation µs per call |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {row['step_us']:.1f} | {row['added_us']:+.1f} | {row['call_us']:.1f} | "
              f"{row['added_call_us']:+.1f} | {row['guard_us']:.1f} |" for name, row in rows.items()]
    lines += ["", f"The floor's tokens equal the package's (4 steps, same weights): {floor_exact}."]
    write_result_files(os.path.join(args.out, f"compiled_host_{gpu.replace(' ', '_')}"), info, lines)


def run_dynamo_host(argv):
    p = argparse.ArgumentParser(prog="compiled_profile.py dynamo-host",
                                description="Dynamo's host time per compiled decode step, piece by piece (CPU)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--calls", type=int, default=500, help="calls per loop")
    p.add_argument("--loops", type=int, default=15, help="loops per row (the least is kept)")
    p.add_argument("--processes", type=int, default=3,
                   help="fresh processes per row (the median is kept: guard evaluation's time moves with where a "
                        "process put the guarded objects, by up to 20 µs between processes)")
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)  # (one row, in a fresh process: prints its JSON)
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    from transformers import StaticCache

    from cta import patching_hooks

    def call_us(steps, variant):
        model = llama_model(args.layers, args.hidden, 2 * args.hidden, 256, torch.device("cpu"), torch.float32)
        if steps:
            patch_model(model, pde_type="diffusion", pde_steps=steps, placement="block_output", init="paper")
            context = model.model._cta_context  # (PatchContext: the base hooks' handles, the sites with theirs)
            for handle in context.handles if variant in ("classes", "layer no-op") else ():
                handle.remove()
            for site in context.site_hooks if variant in ("classes", "base") else ():
                site.remove()
            if variant in ("subclass", "floor"):
                subclass_layers(model, floor=variant == "floor")
        prompt = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(3))
        cache = StaticCache(config=model.config, max_cache_len=64)
        outputs = {}

        def backend(graph, inputs):  # the graph runs once; every later call returns its outputs
            outputs["value"] = graph(*inputs)
            return lambda *_: outputs["value"]

        rows = {}
        with torch.no_grad():
            model(prompt, past_key_values=cache, use_cache=True)
            step = torch.compile(model.forward, fullgraph=True, backend=backend)
            kwargs = dict(input_ids=prompt[:, :1], past_key_values=cache, use_cache=True,
                          position_ids=torch.tensor([[32]]))
            for skip in (False, True):
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip):
                    rows["without guards" if skip else "with guards"] = per_call_us(
                        lambda: step(**kwargs), args.calls, args.loops, lambda: None, reduce=min)
        torch.compiler.reset()
        return rows

    cases = {"unpatched": (0, None), "patched classes and cache, no hooks": (4, "classes"),
             "the base model's hooks alone": (4, "base"), "the layer hooks as no-ops alone": (4, "layer no-op"),
             "both hooks, the layer hooks as no-ops": (4, "no-op"), "the site without its PDE": (4, "no PDE"),
             "the full site, 1 step": (1, None), "the full site, 4 steps": (4, None),
             "layers subclassed (no hooks), forward calls the class's": (4, "subclass"),
             "floor: subclassed layers, 4 steps from the states alone": (4, "floor")}
    if args.only is not None:  # (a fresh process of its own: the substitutes below die with it)
        steps, variant = cases[args.only]
        if variant in ("layer no-op", "no-op"):
            patching_hooks.LayerSite.after = lambda self, module, args, kwargs, output: output
        if variant == "no PDE":
            PDERefinement.forward = lambda self, hidden_states, *rest, **kw: hidden_states
        print("ROW " + json.dumps(call_us(steps, variant)), flush=True)
        return
    rows, options = {}, ["--layers", str(args.layers), "--hidden", str(args.hidden), "--calls", str(args.calls),
                         "--loops", str(args.loops)]
    for name in cases:
        runs = []
        for _ in range(args.processes):
            command = [sys.executable, os.path.abspath(__file__), "dynamo-host", "--only", name, *options]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            runs.append(json.loads(output.split("ROW ", 1)[1]))
        rows[name] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        rows[name]["processes"] = runs
        print(f"{name}: {rows[name]['with guards']:.1f} / {rows[name]['without guards']:.1f} us", flush=True)
    base = rows["unpatched"]
    info = dict(torch=torch.__version__, transformers=transformers.__version__, layers=args.layers,
                hidden=args.hidden, calls=args.calls, loops=args.loops, us_per_call=rows,
                command="python benchmarks/compiled_profile.py dynamo-host " + " ".join(argv))
    lines = ["# Dynamo's host time per call of a compiled decode step, piece by piece (CPU)", "",
             f"A Llama of {args.layers} layers x {args.hidden} hidden (fp32, CPU), `torch.compile(model.forward, "
             "fullgraph=True)` through a StaticCache with a backend that returns the graph's outputs, so a call is "
             "Dynamo's own work: guard evaluation, gathering the graph's inputs, replaying side effects (no CUDA-graph "
             "wrapper, no kernels). PDE after every block (diffusion). µs per call: the least over "
             f"{args.loops} loops of {args.calls} calls in one process, the median over {args.processes} fresh "
             "processes (guard evaluation's time moves between processes by up to 20 µs). "
             f"transformers {info['transformers']}, torch {info['torch']}.",
             "", "| model | µs per call | added | without guard evaluation | added |", "|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['with guards']:.1f} | {row['with guards'] - base['with guards']:+.1f} | "
                     f"{row['without guards']:.1f} | {row['without guards'] - base['without guards']:+.1f} |")
    write_result_files(os.path.join(args.out, "dynamo_host_cpu"), info, lines)


class BufferInputs(torch.nn.Module):
    """``2 * x`` with ``count`` buffers of ``x``'s shape read (summed in) or, with ``written``, each updated in place:
    as many graph inputs, static ones to CUDA graphs (a module's buffers), as the step buffers of PDE sites."""

    def __init__(self, count, channels, written):
        super().__init__()
        self.written = written
        for index in range(count):
            self.register_buffer(f"state_{index}", torch.zeros(1, channels))

    def forward(self, x):
        out = 2 * x
        for state in self.buffers():
            if self.written:
                state.mul_(0.5).add_(x)
            else:
                out = out + state
        return out


def _call_module(x):
    return module(x)  # noqa: F821  (``module``: the global of each copy that own_code makes)


def own_code(module, tag):
    """A function calling ``module``, with a code object of its own: Dynamo keeps its compiled entries per code
    object, so models compiled through one shared function (or through ``nn.Module.__call__``) would evaluate each
    other's guards and reach the recompile limit after 8."""
    code = _call_module.__code__.replace(co_name=f"call_{tag.replace(' ', '_')}")
    return types.FunctionType(code, {"module": module, "__builtins__": __builtins__})


def run_inputs(argv):
    p = argparse.ArgumentParser(prog="compiled_profile.py inputs",
                                description="what one more tensor input costs a compiled, CUDA-graphed call")
    p.add_argument("--counts", default="0,8,16,32,64", help="inputs (registered buffers) per model")
    p.add_argument("--channels", type=int, default=4096)
    p.add_argument("--calls", type=int, default=500, help="calls per timed loop")
    p.add_argument("--repeats", type=int, default=5, help="timed loops per model and round (their median)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--device", default="cuda", help="'cpu': a smoke test (no CUDA graphs)")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    device = cuda_or_smoke(args.device, "inputs times CUDA-graphed calls")
    counts = [int(c) for c in args.counts.split(",")]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x = torch.randn(1, args.channels, device=device)
    calls = {}
    for written in (False, True):
        for count in counts:
            key = ("written" if written else "read", count)
            module = BufferInputs(count, args.channels, written).to(device)
            compiled = torch.compile(own_code(module, f"{key[0]} {count}"), mode="reduce-overhead", fullgraph=True)
            with torch.no_grad():
                for _ in range(3):  # compile, record the CUDA graph, replay
                    compiled(x)
            calls[key] = compiled
    times = {key: [] for key in calls}
    with torch.no_grad():
        for _ in range(args.rounds):
            for key, compiled in calls.items():
                times[key].append(per_call_us(lambda: compiled(x), args.calls, args.repeats, sync))
    rows = {}
    for kind in ("read", "written"):
        us = [statistics.median(times[(kind, count)]) for count in counts]
        mean_n, mean_us = statistics.mean(counts), statistics.mean(us)
        slope = (sum((n - mean_n) * (u - mean_us) for n, u in zip(counts, us))
                 / max(sum((n - mean_n) ** 2 for n in counts), 1e-9))
        rows[kind] = {"us_per_call": dict(zip(map(str, counts), us)), "us_per_input": slope}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    info = dict(device=name, torch=torch.__version__, channels=args.channels, rounds=args.rounds, rows=rows,
                us_per_round={f"{kind} {count}": values for (kind, count), values in times.items()},
                command="python benchmarks/compiled_profile.py inputs " + " ".join(argv))
    lines = [f"# What one more tensor input costs a compiled, CUDA-graphed call ({name})", "",
             "`torch.compile(fn, mode=\"reduce-overhead\", fullgraph=True)` (CUDA graphs) of a function, a code "
             f"object of its own per model, calling a module that returns `2 * x` (`[1, {args.channels}]`) and reads "
             "n registered buffers of that shape (summed in) or writes each in place (`b.mul_(0.5).add_(x)`, as a PDE "
             "site writes its step buffers): n more graph inputs, static ones. Host µs per call (calls queued "
             f"without synchronising), the median of {args.repeats} loops of {args.calls} calls, the median over "
             f"{args.rounds} rounds that time every model; µs per input: the least-squares slope over n. "
             f"torch {info['torch']}.", "",
             "| buffers | " + " | ".join(f"n = {n}" for n in counts) + " | µs per input |",
             "|---|" + "---|" * (len(counts) + 1)]
    lines += [f"| {kind} | " + " | ".join(f"{row['us_per_call'][str(n)]:.1f}" for n in counts)
              + f" | {row['us_per_input']:.2f} |" for kind, row in rows.items()]
    sites = rows["read"]["us_per_input"] * 8 + rows["written"]["us_per_input"] * 32
    lines += ["", "At these slopes the inputs of `bench_generate.py`'s 8 PDE sites of 4 steps (8 coefficients read, "
                  f"32 step buffers written) cost about {sites:.0f} µs per call."]
    write_result_files(os.path.join(args.out, f"compiled_inputs_{name.replace(' ', '_')}"), info, lines)


if __name__ == "__main__":
    run_command(__doc__, {"compiled-host": run_compiled_host, "dynamo-host": run_dynamo_host, "inputs": run_inputs})
