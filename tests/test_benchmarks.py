"""The benchmark scripts (benchmarks/): each answers ``--help``; each runs on the CPU at a tiny shape in seconds (the
GPU-only ones, the kernel sweep and its host overhead, say so and are run here only on a GPU); the result files the
documents show render again from their JSON; the distributed run on 2 gloo processes gives the one-process losses and
its checks hold (on 2 GPUs also under FSDP2 and DeepSpeed ZeRO-3, and tensor parallel decodes the one-GPU tokens).
And the directory keeps its shape: at most 8 scripts and 1,600 lines, one ``sync()``, no patched package internals."""

import ast
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name != "results_io.py")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2 or not os.environ.get("CTA_TEST_GPU"),
                              reason="needs 2 CUDA GPUs (and CTA_TEST_GPU=1)")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ONE_GPU = pytest.mark.skipif(not torch.cuda.is_available() or not os.environ.get("CTA_TEST_GPU"),
                             reason="needs a CUDA GPU (and CTA_TEST_GPU=1)")


def run(script, *args, env=None, timeout=300, expect=0):
    """Runs ``benchmarks/<script> args`` in a fresh process (one thread: the scripts set their own); its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    done = subprocess.run([sys.executable, str(BENCH / script), *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == expect, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_directory_keeps_its_budget():
    files = sorted(BENCH.glob("*.py")) + sorted(BENCH.glob("*.sh"))
    lines = sum(len(p.read_text().splitlines()) for p in files)
    assert len(files) <= 8 and lines <= 1800, f"{len(files)} files, {lines} lines (at most 8 and 1,800)"


def test_one_sync_and_no_patched_package_internals():
    """``sync()`` is defined once (results_io); no script imports a private name of ``cta`` or assigns to an
    attribute of something it imported from ``cta`` (a class's method, say)."""
    for name in SCRIPTS + ["results_io.py"]:
        tree = ast.parse((BENCH / name).read_text())
        defined = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "sync"]
        assert defined == ([] if name != "results_io.py" else ["sync"]), name
        from_cta = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and (node.module or "").split(".")[0] == "cta" for alias in node.names}
        assert not [n for n in from_cta if n.startswith("_")], (name, from_cta)
        for node in ast.walk(tree):
            for target in getattr(node, "targets", []) if isinstance(node, ast.Assign) else []:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    assert target.value.id not in from_cta | {"cta"}, f"{name} assigns {target.value.id}.{target.attr}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    assert exit_.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out


def test_distributed_gpu_sh_parses_and_names_its_modes(tmp_path):
    assert subprocess.run(["bash", "-n", str(BENCH / "distributed_gpu.sh")]).returncode == 0
    done = subprocess.run(["bash", str(BENCH / "distributed_gpu.sh"), "nonsense"], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, OUT=str(tmp_path)), timeout=120)
    assert done.returncode == 2 and "single|fsdp2|zero3|overhead|tp|tests|examples" in done.stderr


def test_cpu_decode_smoke(tmp_path):
    run("bench_patched_model.py", "--cpu-decode", "--layers", 2, "--hidden", 64, "--intermediate", 128, "--vocab", 128,
        "--decode-prefill", 8, "--decode-tokens", 4, "--decode-pair-tokens", 4, "--processes", 2, "--out", tmp_path)
    rows = json.loads((tmp_path / "cpu_decode.json").read_text())["rows"]
    assert [r["pde_type"] for r in rows] == ["diffusion", "reaction_diffusion"] and all(r["pairs"] == 8 for r in rows)
    for row in rows:  # (4 pairs from each of 2 processes, pooled: the pooled median lies between the processes')
        processes = row["process_overheads_percent"]
        assert len(processes) == 2 and min(processes) <= row["overhead_percent"] <= max(processes)
    assert "| diffusion |" in (tmp_path / "cpu_decode.md").read_text()


def test_generate_smoke(tmp_path):
    run("bench_generate.py", "--device", "cpu", "--dtype", "float32", "--layers", 2, "--hidden", 128, "--vocab", 128,
        "--prompt", 8, "--new-tokens", 4, "--rounds", 2, "--batches", 1, "--modes", "eager,compiled", "--out", tmp_path)
    info = json.loads((tmp_path / "generate_cpu.json").read_text())
    assert [(r["mode"], len(r["step_rounds_s"])) for r in info["rows"]] == [("eager", 2), ("compiled", 2)]
    assert set(info["step_kernels"]["1"]) == {"unpatched", "patched"}  # (on the CPU traced and run, not counted)
    assert (tmp_path / "generate_cpu.md").exists()


def test_generate_replot_renders_a_committed_result(tmp_path):
    source = RESULTS / "generate_NVIDIA_H100_80GB_HBM3.json"
    copy = tmp_path / source.name
    copy.write_text(source.read_text())
    run("bench_generate.py", "--replot", copy)
    assert (tmp_path / source.name.replace(".json", ".md")).read_text().startswith("# model.generate(), patched")


def test_patched_model_smoke(tmp_path):
    run("bench_patched_model.py", "--device", "cpu", "--dtype", "float32", "--layers", 2, "--hidden", 128,
        "--vocab", 128, "--lengths", "32,64", "--train-length", 32, "--decode-prefill", 8, "--decode-tokens", 4,
        "--decode-pair-tokens", 4, "--rounds", 3, "--out", tmp_path)
    info = json.loads((tmp_path / "patched_model_cpu.json").read_text())
    assert set(info["overhead_percent"]) == {"prefill_32", "prefill_64", "train_step", "decode_tokens_per_s",
                                             "decode_tokens_per_s_masked"}
    assert info["patch"]["pde_sites"] == 2 and len(info["paired_rounds_s"]["train_step"]) == 3
    assert "| training step fwd+bwd 32 tokens (ms) |" in (tmp_path / "patched_model_cpu.md").read_text()


def test_kernels_needs_a_gpu_and_renders_its_committed_targets(tmp_path):
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in run("bench_kernels.py", "--shapes", "1x64x32", expect=1)
    for stem in ("kernels_NVIDIA_H200", "kernels_NVIDIA_H200_scalar"):
        run("bench_kernels.py", "--replot", RESULTS / f"{stem}.json", "--out", tmp_path)
        assert (tmp_path / f"{stem}_targets.md").read_text() == (RESULTS / f"{stem}_targets.md").read_text()


@ONE_GPU
@pytest.mark.gpu
def test_kernels_gpu_smoke(tmp_path):
    run("bench_kernels.py", "--shapes", "1x256x128", "--steps", 1, "--pde-types", "diffusion", "--rep-ms", 5,
        "--loop-calls", 2, "--compile", "none", "--out", tmp_path)
    rows = json.loads(next(tmp_path.glob("kernels_*.json")).read_text())["rows"]
    assert len(rows) == 2 and all(r["triton_fwd_x_copy"] > 0 for r in rows)
    assert next(tmp_path.glob("kernels_*_targets.md")).exists()


def test_train_step_cpu_smoke(tmp_path):
    """bench_train_step on a tiny Llama shape: host time per site (the site alone), the step of
    each of the five models, and the five overheads, in one result file."""
    run("bench_train_step.py", "--layers", 1, "--hidden", 64, "--vocab", 128, "--batch", 1, "--seq", 16, "--rounds", 2,
        "--steps", 1, "--site_hidden", 64, "--site_calls", 1, "--out", tmp_path)
    record = json.loads((tmp_path / "train_step_cpu_1x64_1x16.json").read_text())  # (a shape of its own: named)
    chain = record["host_per_site"]  # (no Triton op on the CPU: the site runs the reference there)
    assert set(chain["over_torch_mul_us"]) == {"pde_site"} and chain["torch_mul_us"] > 0 and chain["sites"] == 8
    models = {"llama", "patched", "native_0", "native_4", "llama_gain"}  # (llama_gain: one `mul` per block, the floor)
    assert set(record["step_ms"]) == models and min(record["step_ms"].values()) > 0
    assert set(record["overhead"]) == {"patched_vs_llama", "native_0_vs_llama", "native_4_vs_native_0",
                                       "llama_gain_vs_llama", "patched_vs_llama_gain"}
    # the host's part of each step (queued, before the closing synchronisation) never exceeds the step
    assert all(0 < record["host_ms"][name] <= record["step_ms"][name] for name in record["step_ms"])
    assert set(record["in_model_host_per_site_us"]) == {"patched", "native_4", "llama_gain"}
    # and the forward's share of it (timed until the loss): as many entries, each a number
    assert set(record["in_model_forward_host_per_site_us"]) == set(record["in_model_host_per_site_us"])
    assert all(isinstance(v, float) for v in record["in_model_forward_host_per_site_us"].values())


def test_train_step_context_parallel_cpu_smoke(tmp_path):
    """bench_train_step --context_parallel on 2 gloo processes: torch's context_parallel shards each step's buffers
    and the patched sites exchange their halos (the attention made position-local, as tests/context_parallel_worker.py
    does: torch has no CPU ring attention); one record of both models' steps and their overhead, from rank 0."""
    wrapper = tmp_path / "position_local.py"
    wrapper.write_text(
        "import runpy, sys\n"
        f"sys.path[:0] = [{str(ROOT / 'tests')!r}, {str(BENCH)!r}]\n"
        "from context_parallel_worker import position_local_attention\n"
        "from transformers import AttentionInterface\n"
        "AttentionInterface.register('sdpa', position_local_attention)\n"
        f"sys.argv[0] = {str(BENCH / 'bench_train_step.py')!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(wrapper), "--context_parallel", "--layers", "1", "--hidden", "64", "--vocab", "128",
                           "--seq", "32", "--rounds", "2", "--steps", "1", "--out", str(tmp_path)], cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "train_step_cp2_cpu.json").read_text())
    assert (record["world_size"], record["seq"], record["local_seq"], record["probe"]) == (2, 32, 16, None)
    assert set(record["step_ms"]) == {"llama", "patched"} and set(record["overhead"]) == {"patched_vs_llama"}
    assert record["shape"]["layers"] == 1 and "host_per_site" not in record


def test_distributed_summary_renders_the_committed_table(tmp_path):
    for path in (ROOT / "results").glob("distributed_*.json"):
        (tmp_path / path.name).write_text(path.read_text())
    run("bench_distributed.py", "--summarize", "--results_dir", tmp_path)
    assert json.loads((tmp_path / "distributed.json").read_text()) == json.loads(
        (ROOT / "results" / "distributed.json").read_text())
    assert (tmp_path / "distributed.md").read_text() == (ROOT / "results" / "distributed.md").read_text()


DISTRIBUTED = ["--size", "tiny", "--steps", 3, "--warmup", 1, "--global_batch", 4, "--seq_len", 32,
               "--phases", "full_pde,lora_pde"]


def _launch(tmp_path, launcher, env):
    """bench_distributed.py at tiny size under ``launcher`` (a list, empty for one process)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **env)
    command = [sys.executable, *launcher, str(BENCH / "bench_distributed.py"), *map(str, DISTRIBUTED),
               "--results_dir", str(tmp_path), "--work_dir", str(tmp_path / "work")]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _checks_hold(record, phase):
    assert record["losses"][-1] < record["losses"][0], phase
    assert record["pde_coefficients"] > 0 and record["pde_all_moved"], (phase, record)
    assert record["reload_weights_equal"] and record["generate_cached_equals_uncached"], (phase, record)


def test_distributed_two_cpu_processes_match_one(tmp_path):
    """2 gloo processes (accelerate's multi-CPU data parallel through torchrun; FSDP and DeepSpeed need GPUs) give
    the one-process losses; the coefficients move; the gathered checkpoint reloads equal and generates the same with
    and without cache."""
    pytest.importorskip("accelerate")
    pytest.importorskip("peft")
    cpu = {"ACCELERATE_USE_CPU": "true", "ACCELERATE_MIXED_PRECISION": "no"}
    _launch(tmp_path, [], cpu)
    _launch(tmp_path, ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                       str(29500 + os.getpid() % 1000)], cpu)
    one, two = (json.loads((tmp_path / f"{name}.json").read_text())
                for name in ("distributed_single_1cpu", "distributed_ddp_2cpu"))
    assert two["num_processes"] == 2 and two["per_process_batch"] == 2 and one["per_process_batch"] == 4
    for phase in ("full_pde", "lora_pde"):
        a, b = one["phases"][phase], two["phases"][phase]
        assert b["losses"] == pytest.approx(a["losses"], rel=1e-5), phase  # fp32: only the reduction order differs
        for record in (a, b):
            _checks_hold(record, phase)


@TWO_GPUS
@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed_zero3"])
def test_distributed_engines_on_two_gpus(tmp_path, engine):
    if engine.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    config = ROOT / "examples" / "accelerate" / f"{engine}.yaml"
    _launch(tmp_path, ["-m", "accelerate.commands.launch", "--config_file", str(config)], NO_MULTICAST)
    run_file = json.loads(next(tmp_path.glob("distributed_*_2gpu.json")).read_text())
    for phase in ("full_pde", "lora_pde"):
        _checks_hold(run_file["phases"][phase], phase)


@TWO_GPUS
@pytest.mark.gpu
def test_tensor_parallel_decodes_the_one_gpu_tokens(tmp_path):
    out = tmp_path / "tensor_parallel.json"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           str(ROOT / "tests" / "tensor_parallel_worker.py"), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, **NO_MULTICAST))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(out.read_text())["passed"]
