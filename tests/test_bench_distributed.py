"""benchmarks/bench_distributed.py on CPU at tiny size: 2 gloo processes (accelerate's multi-CPU data parallel; its
FSDP and DeepSpeed paths need GPUs, see results/distributed.md) give the one-process losses, the PDE coefficients
move, the gathered checkpoint reloads patched with equal weights and generates the same with and without cache."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--size", "tiny", "--steps", "3", "--warmup", "1", "--global_batch", "4", "--seq_len", "32",
        "--phases", "full_pde,lora_pde"]

pytest.importorskip("accelerate")
pytest.importorskip("peft")


def _launch(tmp_path, processes):
    # torchrun with accelerate's CPU switch: Accelerator() then runs gloo data parallel over the processes.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, ACCELERATE_USE_CPU="true",
               ACCELERATE_MIXED_PRECISION="no")
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                "--master_port", str(29500 + os.getpid() % 1000)] if processes > 1 else []
    command = [sys.executable, *launcher, os.path.join(ROOT, "benchmarks", "bench_distributed.py"),
               *ARGS, "--results_dir", str(tmp_path), "--work_dir", str(tmp_path / "work")]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_two_cpu_processes_match_one(tmp_path):
    _launch(tmp_path, 1)
    _launch(tmp_path, 2)
    runs = {name: json.loads((tmp_path / f"{name}.json").read_text())
            for name in ("distributed_single_1cpu", "distributed_ddp_2cpu")}
    one, two = runs["distributed_single_1cpu"], runs["distributed_ddp_2cpu"]
    assert two["num_processes"] == 2 and two["per_process_batch"] == 2 and one["per_process_batch"] == 4
    for phase in ("full_pde", "lora_pde"):
        a, b = one["phases"][phase], two["phases"][phase]
        assert b["losses"] == pytest.approx(a["losses"], rel=1e-5), phase  # fp32: only the reduction order differs
        assert b["losses"][-1] < b["losses"][0], phase
        for record in (a, b):
            assert record["pde_coefficients"] > 0 and record["pde_all_moved"], (phase, record)
            assert record["reload_weights_equal"] and record["generate_cached_equals_uncached"], (phase, record)
