#!/usr/bin/env bash
# The 2-GPU runs behind results/distributed*.{json,md} and results/tensor_parallel_2gpu.json, one mode a call:
#   single | fsdp2 | zero3   the 1.1B model on 1 GPU / under FSDP2 / ZeRO-3 on 2 GPUs, a process per phase (PHASES=...)
#   overhead                 the PDE's share of a step per ENGINES, paired rounds (OVERHEAD_ARGS, SUFFIX: other batches)
#   tp | tests | examples    tp_plan="auto" vs one GPU | the GPU tests of benchmarks, QLoRA | the examples
# then: python benchmarks/bench_distributed.py --summarize --results_dir OUT (OUT default results/gpu_run). Wheels the
# machine lacks come from .whl/; DATA (../shared or .gpu_data) holds stories260K. Status: OUT/MODE.status, log: .log.
set -u
MODE=${1:-tests}
OUT=${OUT:-results/gpu_run}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
DATA=${DATA:-$([ -d .gpu_data ] && echo .gpu_data || echo ../shared)}
LOG="$OUT/$MODE.log"
FSDP=examples/accelerate/fsdp2.yaml ZERO3=examples/accelerate/deepspeed_zero3.yaml
launch=("$PY" -m accelerate.commands.launch)
step() {  # step NAME COMMAND...: runs it (STEP_TIMEOUT seconds at most; 0: none), logs it, records its status
    local name=$1 start=$SECONDS; shift
    echo "=== $name: $*" >>"$LOG"
    timeout "${STEP_TIMEOUT:-0}" "$@" >>"$LOG" 2>&1
    echo "$name rc=$? $((SECONDS - start))s" | tee -a "$OUT/$MODE.status"
}
if [ -d .whl ]; then  # (pip leaves what is installed alone; DeepSpeed from its sdist)
    "$PY" -m pip install -q --no-index --no-deps --find-links .whl hjson pydantic-core pydantic annotated-types \
        typing-inspection msgpack py-cpuinfo einops bitsandbytes >>"$LOG" 2>&1
    "$PY" -c "import deepspeed" 2>/dev/null || DS_BUILD_OPS=0 "$PY" -m pip install -q --no-index --no-deps \
        --no-build-isolation .whl/deepspeed-*.tar.gz >>"$LOG" 2>&1
fi
BIG=(--size 1b --steps 10 --warmup 3 --global_batch 8 --seq_len 1024 --work_dir /tmp/bd_1b --results_dir "$OUT")
FT=(examples/finetune_patched_llama.py --model_name_or_path "$DATA/models/stories260K" --data_dir "$DATA/data"
    --seeds 0 --bf16 --modes lora_pde,pde --max_steps 3 --per_device_eval_batch_size 8 --max_eval_samples 16)
case "$MODE" in
single|fsdp2|zero3)
    engine=$([ "$MODE" = single ] && echo "--num_processes 1 --mixed_precision bf16" \
             || echo "--config_file $([ "$MODE" = fsdp2 ] && echo $FSDP || echo $ZERO3)")
    for phase in ${PHASES:-full full_pde lora lora_pde native}; do
        step "bench_${MODE}_1b_$phase" "${launch[@]}" $engine benchmarks/bench_distributed.py "${BIG[@]}" \
            --phases "$phase" --merge
    done ;;
overhead)
    for engine in ${ENGINES:-fsdp2 zero3}; do
        for phase in ${PHASES:-full_pde lora_pde native}; do
            step "overhead_${engine}_1b_$phase" "${launch[@]}" --config_file "$([ "$engine" = fsdp2 ] && echo $FSDP \
                || echo $ZERO3)" benchmarks/bench_distributed.py "${BIG[@]}" --steps 4 --warmup 1 --no_save \
                --overhead_rounds "${ROUNDS:-16}" --phases "$phase" --merge \
                --name "distributed_${engine}_2gpu_overhead${SUFFIX:-}" ${OVERHEAD_ARGS:-}
        done
    done ;;
tp) step tensor_parallel "$PY" -m torch.distributed.run --nproc_per_node 2 tests/tensor_parallel_worker.py \
        --out "$OUT/tensor_parallel_2gpu.json" ;;
tests) step gpu_tests env CTA_TEST_GPU=1 "$PY" -m pytest -q -m gpu tests/test_benchmarks.py tests/test_gpu_qlora.py ;;
examples)
    for engine in fsdp2 zero3; do
        step "finetune_$engine" "${launch[@]}" --config_file "$([ "$engine" = fsdp2 ] && echo $FSDP || echo $ZERO3)" \
            "${FT[@]}" --output_dir "/tmp/ft_$engine" --results_dir "/tmp/ft_$engine"
    done ;;
*) echo "usage: $0 single|fsdp2|zero3|overhead|tp|tests|examples" >&2; exit 2 ;;
esac
