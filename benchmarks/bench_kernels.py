"""The fused Triton PDE kernels against the copy roof, the PyTorch reference and ``torch.compile`` of it: the tables
``kernels_<gpu>[_scalar]_targets.md`` and the plot ``kernels_<gpu>.png`` of docs/kernels.md.

    python benchmarks/bench_kernels.py                      # full sweep (~5 min on an H100): kernels_<gpu>.*
    python benchmarks/bench_kernels.py --coefficients scalar --pde-types diffusion   # kernels_<gpu>_scalar.*
    python benchmarks/bench_kernels.py --replot benchmarks/results/kernels_<gpu>.json   # rewrite .md, _targets.md, .png

Per shape x steps x PDE type x {causal, bidirectional}, medians of ``triton.testing.do_bench``: ``copy`` (the roof),
the Triton forward and forward+backward (per-channel or scalar coefficients), also as a CUDA graph (``*_graph``: GPU
time) and as back-to-back eager calls (``*_loop``: host time too), the reference and its ``torch.compile``
(``--compile`` cells), the memory held for backward; then the targets table (diffusion: forward <= 1.25x copy,
forward+backward <= 3x, memory <= 1.1x). Host time per site: ``bench_train_step``.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from results_io import RESULTS, device_name, on_gpu, pyplot, sync

import torch  # noqa: E402  (after results_io: it puts the repository on the path)

from cta.pde_cta import PDE_TYPES, pde_refine_reference  # noqa: E402

TARGETS = {"fwd": 1.25, "fwdbwd": 3.0, "saved": 1.1}
SHAPES = "1x4096x4096,1x16384x4096,8x4096x4096,1x65536x512"
COEFS = {"diffusion": (0.2, None), "wave": (0.1, None), "reaction_diffusion": (0.2, 0.1),
         "advection_diffusion": (0.2, 0.1)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--coefficients", default="per-channel", choices=("per-channel", "scalar"), help="(_scalar files)")
    p.add_argument("--shapes", default=SHAPES, help="BxLxC comma list")
    p.add_argument("--steps", default="1,2,4,8", help="comma list of steps")
    p.add_argument("--pde-types", default=",".join(PDE_TYPES), help="comma list")
    p.add_argument("--compile", default="diffusion:4", help="'pde:steps,...' cells timing torch.compile, 'all', 'none'")
    p.add_argument("--rep-ms", type=float, default=60.0, help="do_bench repetition budget per measurement (ms)")
    p.add_argument("--loop-calls", type=int, default=50, help="back-to-back eager calls of the *_loop timings")
    p.add_argument("--replot", metavar="JSON", help="only rewrite .md, _targets.md, .png from a kernels_*.json")
    p.add_argument("--out", default=RESULTS)
    return p.parse_args(argv)


def bench(fn, rep_ms):
    from triton.testing import do_bench

    return do_bench(fn, warmup=max(5.0, rep_ms / 4), rep=rep_ms, return_mode="median")


def bench_graph(fn, rep_ms):
    """``fn`` captured once as a CUDA graph and replayed, timed like :func:`bench`: GPU time, no host time."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture needs (and compiles the kernels)
        [fn() for _ in range(3)]
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay, rep_ms)


def bench_loop(fn, calls, rounds=7):
    """Median over ``rounds`` of the time per call of ``calls`` back-to-back eager calls between two CUDA events: the
    larger of the GPU time and the host time per call."""
    fn()
    sync()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        [fn() for _ in range(calls)]
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def measure(fn, x, alpha, beta, grad, kw, rep_ms, graph_and_loop):
    """``{fwd_ms, fwdbwd_ms, [fwd|fwdbwd]_[graph|loop]_ms, saved_x, peak_x}`` of ``fn`` (memory over the input)."""
    xx = x.detach().requires_grad_(True)

    fwd = lambda: fn(x, alpha=alpha, beta=beta, **kw)  # noqa: E731

    def fwdbwd():
        xx.grad = alpha.grad = None
        fn(xx, alpha=alpha, beta=beta, **kw).backward(grad)

    with torch.no_grad() if not graph_and_loop else torch.enable_grad():  # (the reference's forward: no autograd)
        row = {"fwd_ms": bench(fwd, rep_ms)}
    row["fwdbwd_ms"] = bench(fwdbwd, rep_ms)
    for name, call in (("fwd", fwd), ("fwdbwd", fwdbwd)) if graph_and_loop else ():
        row[name + "_loop_ms"] = bench_loop(call, graph_and_loop)
        row[name + "_graph_ms"] = bench_graph(call, rep_ms)
    xx = x.detach().requires_grad_(True)  # (fresh: the peak includes allocating its gradient)
    sync()
    torch.cuda.reset_peak_memory_stats()
    start, size = torch.cuda.memory_allocated(), x.numel() * x.element_size()
    y = fn(xx, alpha=alpha, beta=beta, **kw)
    sync()
    row["saved_x"] = (torch.cuda.memory_allocated() - start - size) / size
    y.backward(grad)
    sync()
    row["peak_x"] = (torch.cuda.max_memory_allocated() - start - size) / size
    return row


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        data = json.loads(Path(args.replot).read_text())
        return write_files(os.path.join(args.out, Path(args.replot).stem), data["meta"], data["rows"])
    if not on_gpu("bench_kernels.py"):
        return 1
    import triton  # (after on_gpu(): it clears TRITON_INTERPRET, which triton reads)
    from cta.triton_cta import pde_refine_triton

    dtype, gpu = getattr(torch, args.dtype), device_name("cuda")
    cells = {"all": None, "none": set()}.get(args.compile) if args.compile in ("all", "none") else {
        (c.split(":")[0], int(c.split(":")[1])) for c in args.compile.split(",")}
    compiled_ref = torch.compile(pde_refine_reference, dynamic=False)
    rows, t_start = [], time.time()
    base = os.path.join(args.out, f"kernels_{gpu}" + ("_scalar" if args.coefficients == "scalar" else ""))
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                dtype=args.dtype, coefficients=args.coefficients, compile_cells="all" if cells is None else sorted(cells),
                command="python benchmarks/bench_kernels.py " + " ".join(sys.argv[1:]),
                note="medians of triton.testing.do_bench; *_graph = the call captured as a CUDA graph and replayed "
                     "(GPU time, no host time); *_loop = back-to-back eager calls between two CUDA events; *_x_copy = "
                     "time / y.copy_(x) time of the same tensor; saved_x = bytes held for backward after the forward "
                     "/ input bytes; peak_x = peak extra bytes of forward+backward (incl. the input gradient and the "
                     "reference's temporaries) / input bytes")
    for shape in [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]:
        x = torch.randn(shape, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(0))
        y = torch.empty_like(x)
        copy_ms = bench(lambda: y.copy_(x), args.rep_ms)
        grad = torch.randn_like(x)
        for pde in args.pde_types.split(","):
            a, b = COEFS[pde]
            coef = dict(size=(shape[-1],) if args.coefficients == "per-channel" else (), device="cuda",
                        requires_grad=True)
            alpha, beta = torch.full(fill_value=a, **coef), None if b is None else torch.full(fill_value=b, **coef)
            for steps in (int(s) for s in args.steps.split(",")):
                for causal in (False, True):
                    kw = dict(pde_type=pde, steps=steps, causal=causal)
                    row = dict(shape=list(shape), dtype=args.dtype, pde_type=pde, steps=steps, causal=causal,
                               coefficients=args.coefficients, copy_ms=copy_ms)
                    for name, fn, rep, extra in (("triton", pde_refine_triton, args.rep_ms, args.loop_calls),
                                                 ("torch", pde_refine_reference, args.rep_ms / 3, 0)):
                        row.update({f"{name}_{k}": v for k, v in
                                    measure(fn, x, alpha, beta, grad, kw, rep, extra).items()})
                    if cells is None or (pde, steps) in cells:
                        with torch.no_grad():
                            row["compile_fwd_ms"] = bench(lambda: compiled_ref(x, alpha=alpha, beta=beta, **kw),
                                                          args.rep_ms / 3)
                    row.update({k[:-3] + "_x_copy": v / copy_ms for k, v in list(row.items())
                                if k.endswith("_ms") and k != "copy_ms"})
                    rows.append(row)
                    print(f"  {shape} {pde} S={steps} {'causal' if causal else 'bidi'}: " + ", ".join(
                        f"{k[:-7]} {v:.2f}x" for k, v in row.items() if k.endswith("_x_copy"))
                        + f" [{time.time() - t_start:.0f}s]", flush=True)
        x = y = grad = None  # (freed before the next shape)
        torch.cuda.empty_cache()
        os.makedirs(args.out, exist_ok=True)  # (after every shape, so a cut-off run keeps its rows)
        Path(base + ".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        write_files(base, meta, rows)
    return 0


def write_files(base, meta, rows):
    """``<base>.md`` (every cell), ``<base>_targets.md`` (the diffusion cells against :data:`TARGETS`) and
    ``<base>.png`` (time over copy time against steps at 1x16384x4096, or the first shape)."""
    fmt = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [f"# PDE kernels on {meta['gpu']} ({meta['dtype']}, {meta.get('coefficients', 'per-channel')} "
             f"coefficients, torch {meta['torch']}, triton {meta['triton']})", "",
             meta["note"] + f". torch.compile timed for: {meta['compile_cells']}.", "",
             "Targets (diffusion, steps <= 8): forward <= 1.25x copy, forward+backward <= 3x "
             "copy, extra activation memory <= 1.1x the input.", "",
             "| shape | pde | steps | mode | copy us | triton fwd x | triton fwd+bwd x | graph fwd x | "
             "graph fwd+bwd x | loop fwd x | loop fwd+bwd x | saved x | peak x | torch fwd x | torch fwd+bwd x | "
             "torch saved x | compile fwd x |", "|---" * 17 + "|"]
    for r in rows:
        cells = [r[k] if k in ("triton_fwd_x_copy", "triton_fwdbwd_x_copy") else r.get(k) for k in (
            "triton_fwd_x_copy", "triton_fwdbwd_x_copy", "triton_fwd_graph_x_copy", "triton_fwdbwd_graph_x_copy",
            "triton_fwd_loop_x_copy", "triton_fwdbwd_loop_x_copy", "triton_saved_x", "triton_peak_x",
            "torch_fwd_x_copy", "torch_fwdbwd_x_copy", "torch_saved_x", "compile_fwd_x_copy")]
        lines.append(f"| {'x'.join(map(str, r['shape']))} | {r['pde_type']} | {r['steps']} | "
                     f"{'causal' if r['causal'] else 'bidi'} | {r['copy_ms'] * 1e3:.1f} | "
                     + " | ".join(map(fmt, cells)) + " |")
    Path(base + ".md").write_text("\n".join(lines) + "\n")
    Path(base + "_targets.md").write_text(targets(meta, rows, Path(base).name))
    plt = pyplot()
    if plt is None:
        return
    pdes = sorted({r["pde_type"] for r in rows}, key=list(PDE_TYPES).index)
    shape = [1, 16384, 4096] if any(r["shape"] == [1, 16384, 4096] for r in rows) else rows[0]["shape"]
    fig, axes = plt.subplots(1, len(pdes), figsize=(4.5 * len(pdes), 4), squeeze=False, sharey=True)
    for ax, pde in zip(axes[0], pdes):
        for causal, ls in ((False, "-"), (True, "--")):
            for key, color in (("triton_fwd_x_copy", "C0"), ("triton_fwdbwd_x_copy", "C1"), ("torch_fwd_x_copy", "C2"),
                               ("compile_fwd_x_copy", "C3")):
                sel = [r for r in rows if r["pde_type"] == pde and r["causal"] == causal and r["shape"] == shape
                       and key in r]
                if sel:
                    ax.plot([r["steps"] for r in sel], [r[key] for r in sel], ls, color=color, marker="o",
                            label=f"{key.replace('_x_copy', '')} {'causal' if causal else 'bidi'}")
        ax.axhline(1.25, color="k", lw=0.5)
        ax.axhline(3.0, color="k", lw=0.5, ls=":")
        ax.set_yscale("log")
        ax.set_xlabel("steps")
        ax.set_title(f"{pde}, {'x'.join(map(str, shape))}")
    axes[0][0].set_ylabel("time / copy time")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(base + ".png", dpi=120)


def _cell(value, target):
    digits = 3 if round(value, 2) == target else 2  # 1.25x ✗ would read as a contradiction
    return value <= target, f"{value:.{digits}f}x {'✓' if value <= target else '✗'}"


def targets(meta, rows, stem) -> str:
    """The target cells (diffusion, steps <= 8) as markdown: eager, and (where the sweep has them) CUDA-graph times."""
    rows = [r for r in rows if r["pde_type"] == "diffusion" and r["steps"] <= 8]
    graphs = all("triton_fwdbwd_graph_x_copy" in r for r in rows)
    lines = [
        f"Diffusion, {meta.get('coefficients', 'per-channel')} coefficients, {meta['dtype']}, {meta['gpu']} "
        f"(torch {meta['torch']}, triton {meta['triton']}): time as a multiple "
        "of `y.copy_(x)` of the same tensor, and bytes kept for backward / input bytes. "
        f"Targets: forward <= {TARGETS['fwd']}x, forward+backward <= {TARGETS['fwdbwd']}x, memory <= {TARGETS['saved']}x "
        "(✓ met, ✗ missed). "
        + ("Forward and forward+backward twice: the eager call (`do_bench`, host time included) and the same call "
           "captured as a CUDA graph and replayed (the kernels' GPU time). " if graphs else "")
        + "PyTorch reference forward for scale.", "",
        "| shape | steps | mode | forward | fwd+bwd | " + ("forward (graph) | fwd+bwd (graph) | " if graphs else "")
        + "saved | reference fwd |", "|---|---|---|---|---|" + ("---|---|" if graphs else "") + "---|---|"]
    eager = graph = 0
    for row in rows:
        (ok_f, fwd), (ok_b, fb), (ok_s, saved) = (_cell(row[k], TARGETS[t]) for k, t in (
            ("triton_fwd_x_copy", "fwd"), ("triton_fwdbwd_x_copy", "fwdbwd"), ("triton_saved_x", "saved")))
        cells, ok_gf, ok_g = [fwd, fb], ok_f, ok_b
        if graphs:
            (ok_gf, fg), (ok_g, fbg) = (_cell(row["triton_fwd_graph_x_copy"], TARGETS["fwd"]),
                                        _cell(row["triton_fwdbwd_graph_x_copy"], TARGETS["fwdbwd"]))
            cells += [fg, fbg]
        eager += ok_f + ok_b + ok_s
        graph += ok_gf + ok_g + ok_s
        lines.append(f"| {'x'.join(map(str, row['shape']))} | {row['steps']} | "
                     f"{'causal' if row['causal'] else 'bidirectional'} | {' | '.join(cells + [saved])} | "
                     f"{row['torch_fwd_x_copy']:.1f}x |")
    count = f"{eager} of {3 * len(rows)} target cells met"
    if graphs:
        count += f" with the eager times, {graph} of {3 * len(rows)} with the CUDA-graph times"
    return "\n".join(lines + ["", f"{count}. Full sweep: `{stem}.md`."]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
