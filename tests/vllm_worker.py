"""One vLLM engine for tests/test_vllm.py, in its own process (an engine per process: vLLM's process-wide state):
``python vllm_worker.py job.json result.json``. The job names a checkpoint, the engine's arguments and batches of
token-id prompts with their sampling parameters, run one after the other on the same engine; the result holds each
output's tokens and log-probs, vLLM's count of cached prompt tokens and of preemptions, or the error the engine
raised while starting (its whole traceback: the plugin's refusals are read from it)."""

import json
import os
import sys
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: its errors raise here
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB


def _output(completion):
    steps = completion.logprobs or []
    return {"tokens": list(completion.token_ids),
            "logprobs": [{str(token): entry.logprob for token, entry in step.items()} for step in steps]}


def _preemptions(llm) -> float:
    return sum(getattr(metric, "value", 0) for metric in llm.get_metrics() if metric.name == "vllm:num_preemptions")


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as file:
        job = json.load(file)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    try:
        llm = LLM(model=job["model"], skip_tokenizer_init=True, dtype="float32", seed=0, disable_log_stats=False,
                  **job["engine"])
    except Exception:  # noqa: BLE001 - the test reads the refusal from the traceback
        result = {"error": traceback.format_exc()}
    else:
        batches = []
        for batch in job["batches"]:
            params = SamplingParams(detokenize=False, **batch["sampling"])
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch["prompts"]], params,
                                   use_tqdm=False)
            batches.append([{"cached": output.num_cached_tokens or 0,
                             "completions": [_output(c) for c in output.outputs]} for output in outputs])
        result = {"batches": batches, "preemptions": _preemptions(llm)}
    with open(result_path, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(*sys.argv[1:3])
