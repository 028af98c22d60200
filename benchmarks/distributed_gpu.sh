#!/usr/bin/env bash
# The GPU runs behind results/distributed*.{json,md,png} and results/qlora/ (2 GPUs of one host; one mode a call).
#
#   bash benchmarks/distributed_gpu.sh sanity  # tiny model through every engine, script and test; QLoRA run
#   bash benchmarks/distributed_gpu.sh check   # tiny engines, the QLoRA test, the 1.1B 1-GPU reference
#   bash benchmarks/distributed_gpu.sh single  # the 1.1B model on 1 GPU (the reference), one process per phase
#   bash benchmarks/distributed_gpu.sh fsdp2   # the 1.1B model under FSDP2 on 2 GPUs, one process per phase
#   bash benchmarks/distributed_gpu.sh zero3   # the 1.1B model under DeepSpeed ZeRO-3 on 2 GPUs, likewise
#   bash benchmarks/distributed_gpu.sh overhead  # the PDE's share of a step under FSDP2 and ZeRO-3, paired rounds; ENGINES="zero3": one of them;
#       OVERHEAD_ARGS="--global_batch 16" SUFFIX=_b16: another per-GPU batch, into its own file
#   bash benchmarks/distributed_gpu.sh tp      # tensor parallel: tp_plan="auto" on 2 GPUs vs one (check_tensor_parallel)
# PHASES="lora_pde" (single / fsdp2 / zero3): only those phases, merged into the result file already in OUT.
#   python benchmarks/summarize_distributed.py  # results/distributed.{json,md,png} from the JSON files
#
# OUT (default results/gpu_run) receives the JSON files and logs. Wheels the machine lacks (DeepSpeed's sdist,
# bitsandbytes, hjson, pydantic, ...) are installed from .whl/ when present; the stories260K model and the
# TinyStories sample come from DATA (default ../shared, or .gpu_data where it was carried).
set -u
MODE=${1:-sanity}
OUT=${OUT:-results/gpu_run}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
DATA=${DATA:-$([ -d .gpu_data ] && echo .gpu_data || echo ../shared)}
LOG="$OUT/$MODE.log"
FSDP=examples/accelerate/fsdp2.yaml
ZERO3=examples/accelerate/deepspeed_zero3.yaml
launch=("$PY" -m accelerate.commands.launch)  # (an array: `timeout` cannot run a shell function)
step() {  # step NAME COMMAND...: runs it, logs it, records its status
    local name=$1; shift
    local start=$SECONDS
    echo "=== $name: $*" >>"$LOG"
    timeout "${STEP_TIMEOUT:-0}" "$@" >>"$LOG" 2>&1  # STEP_TIMEOUT (s): a hung collective ends there (0: none)
    local rc=$?
    echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$OUT/$MODE.status"
}

if [ -d .whl ]; then
    for pkg in hjson:hjson pydantic_core:pydantic-core pydantic:pydantic annotated_types:annotated-types \
               typing_inspection:typing-inspection msgpack:msgpack cpuinfo:py-cpuinfo einops:einops \
               bitsandbytes:bitsandbytes; do
        "$PY" -c "import ${pkg%%:*}" 2>/dev/null || "$PY" -m pip install -q --no-index --no-deps --find-links .whl \
            "${pkg##*:}" >>"$LOG" 2>&1
    done
    "$PY" -c "import deepspeed" 2>/dev/null || DS_BUILD_OPS=0 "$PY" -m pip install -q --no-index --no-deps \
        --no-build-isolation .whl/deepspeed-*.tar.gz >>"$LOG" 2>&1
fi
"$PY" - <<'EOF' | tee -a "$LOG"
import importlib, torch
print("cuda", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ("torch", "transformers", "accelerate", "peft", "deepspeed", "bitsandbytes", "pydantic"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as error:  # noqa: BLE001 - report what is missing and go on
        print(name, "MISSING", type(error).__name__, error)
EOF

TINY=(--size tiny --steps 3 --warmup 1 --global_batch 4 --seq_len 64 --work_dir /tmp/bd_tiny --results_dir "$OUT/tiny")
BIG=(--size 1b --steps 10 --warmup 3 --global_batch 8 --seq_len 1024 --work_dir /tmp/bd_1b --results_dir "$OUT")
FT=(examples/finetune_patched_llama.py --model_name_or_path "$DATA/models/stories260K" --data_dir "$DATA/data"
    --seeds 0 --bf16 --save_models --per_device_eval_batch_size 8 --max_eval_samples 16 --logging_steps 5)
CLM=(examples/run_clm.py --train_file /tmp/clm/train.txt --validation_file /tmp/clm/validation.txt
     --block_size 64 --hidden_size 64 --intermediate_size 128 --num_attention_heads 2 --num_hidden_layers 2
     --max_steps 4 --per_device_train_batch_size 4 --per_device_eval_batch_size 8 --report_to none
     --tokenizer_name byte --bf16 --save_strategy steps --save_steps 1000 --disable_tqdm true)
CLS=(examples/run_classification.py --train_file /tmp/clm/train.csv --validation_file /tmp/clm/validation.csv
     --text_column_name text --label_column_name label --max_seq_length 64 --hidden_size 64 --intermediate_size 128
     --num_attention_heads 2 --num_hidden_layers 2 --max_steps 4 --per_device_train_batch_size 4 --report_to none
     --tokenizer_name byte --bf16 --save_strategy steps --save_steps 1000 --disable_tqdm true)

case "$MODE" in
sanity)
    mkdir -p /tmp/clm && "$PY" - <<'EOF'
import csv, random
random.seed(0)
words = "the cat sat on a mat and ran far away from home".split()
for split, n in (("train", 400), ("validation", 40)):
    rows = [" ".join(random.choice(words) for _ in range(12)) for _ in range(n)]
    open(f"/tmp/clm/{split}.txt", "w").write("\n".join(rows))
    with open(f"/tmp/clm/{split}.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        writer.writerows([(r, "pos" if "cat" in r else "neg") for r in rows])
EOF
    step bench_single "${launch[@]}" --num_processes 1 --mixed_precision bf16 benchmarks/bench_distributed.py "${TINY[@]}"
    step bench_fsdp2 "${launch[@]}" --config_file $FSDP benchmarks/bench_distributed.py "${TINY[@]}"
    step bench_zero3 "${launch[@]}" --config_file $ZERO3 benchmarks/bench_distributed.py "${TINY[@]}"
    step test_gpu_qlora env CTA_TEST_GPU=1 "$PY" -m pytest -q -x tests/test_gpu_qlora.py
    step ft_fsdp2 "${launch[@]}" --config_file $FSDP "${FT[@]}" --modes lora_pde,pde --max_steps 3 --output_dir /tmp/ftf --results_dir /tmp/ftf
    step ft_zero3 "${launch[@]}" --config_file $ZERO3 "${FT[@]}" --modes lora_pde,pde --max_steps 3 --output_dir /tmp/ftz --results_dir /tmp/ftz
    step clm_fsdp2 "${launch[@]}" --config_file $FSDP "${CLM[@]}" --output_dir /tmp/clm_f
    step clm_zero3 "${launch[@]}" --config_file $ZERO3 "${CLM[@]}" --output_dir /tmp/clm_z
    step cls_fsdp2 "${launch[@]}" --config_file $FSDP "${CLS[@]}" --output_dir /tmp/cls_f
    step cls_zero3 "${launch[@]}" --config_file $ZERO3 "${CLS[@]}" --output_dir /tmp/cls_z
    step qlora_finetune "$PY" "${FT[@]}" --load_in_4bit --modes lora,lora_pde --max_steps 100 --learning_rate 2e-3 \
        --per_device_train_batch_size 16 --output_dir /tmp/qlora --results_dir "$OUT/qlora"
    for d in /tmp/clm_f /tmp/clm_z /tmp/cls_f /tmp/cls_z /tmp/ftf/lora_pde-seed0 /tmp/ftf/pde-seed0; do
        echo "$d: $(ls "$d" 2>/dev/null | tr '\n' ' ')" >>"$LOG"
    done
    ;;
check)  # one device call: the engines at tiny size, QLoRA (test and run), the 1-GPU reference at 1.1B
    step bench_fsdp2 "${launch[@]}" --config_file $FSDP benchmarks/bench_distributed.py "${TINY[@]}"
    step bench_zero3 "${launch[@]}" --config_file $ZERO3 benchmarks/bench_distributed.py "${TINY[@]}"
    step test_gpu_qlora env CTA_TEST_GPU=1 "$PY" -m pytest -q -x tests/test_gpu_qlora.py
    step bench_single_1b "${launch[@]}" --num_processes 1 --mixed_precision bf16 benchmarks/bench_distributed.py "${BIG[@]}"
    ;;
fsdp2|zero3)  # one device call per engine, one process per phase (--merge collects them in one file)
    config=$([ "$MODE" = fsdp2 ] && echo $FSDP || echo $ZERO3)
    for phase in ${PHASES:-full full_pde lora lora_pde native}; do
        step "bench_${MODE}_1b_$phase" "${launch[@]}" --config_file "$config" benchmarks/bench_distributed.py \
            "${BIG[@]}" --phases "$phase" --merge
    done
    ;;
single)  # the one-GPU reference, one process per phase like the sharded runs
    for phase in ${PHASES:-full full_pde lora lora_pde native}; do
        step "bench_single_1b_$phase" "${launch[@]}" --num_processes 1 --mixed_precision bf16 \
            benchmarks/bench_distributed.py "${BIG[@]}" --phases "$phase" --merge
    done
    ;;
overhead)  # per engine and patched phase, one process: sites on / off in paired rounds (<engine>_overhead.json)
    for engine in ${ENGINES:-fsdp2 zero3}; do
        config=$([ "$engine" = fsdp2 ] && echo $FSDP || echo $ZERO3)
        for phase in ${PHASES:-full_pde lora_pde native}; do
            step "overhead_${engine}_1b_$phase" "${launch[@]}" --config_file "$config" benchmarks/bench_distributed.py \
                "${BIG[@]}" --steps 4 --warmup 1 --no_save --overhead_rounds "${ROUNDS:-16}" --phases "$phase" \
                --name "distributed_${engine}_2gpu_overhead${SUFFIX:-}" --merge ${OVERHEAD_ARGS:-}
        done
    done
    ;;
tp)  # issue 34: a saved patched Llama loaded with tp_plan="auto" on 2 GPUs decodes the 1-GPU tokens
    step tensor_parallel "$PY" -m torch.distributed.run --nproc_per_node 2 benchmarks/check_tensor_parallel.py \
        --out "$OUT/tensor_parallel_2gpu.json"
    ;;
*)
    echo "usage: $0 sanity|check|single|fsdp2|zero3|overhead|tp" >&2
    exit 2
    ;;
esac
