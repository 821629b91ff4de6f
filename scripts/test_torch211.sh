#!/usr/bin/env bash
# The stack of the lent GPU machine and of many clusters (Python 3.12, torch 2.11.0, transformers 5.17.0), on the
# CPU: a focused set of the suite in a second venv (scripts/install_torch211.sh). There FSDP2 cannot shard uint8
# parameters, so the default command takes the float-view layout; the losses must equal those of the CPU suite's
# torch (.venv). Then the tests marked gpu_machine: the GPU suite's dry run, whole plan, in a venv holding only what
# that machine has plus the wheels carried to it (scripts/install_gpu_machine.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_torch211.sh
bash scripts/install_gpu_machine.sh
VENV=${VENV_TORCH211:-.venv-torch211}
"$VENV/bin/python" -c 'import sys, torch, transformers
print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")'
# 2-rank bnb and HQQ training under both FSDP versions; storage integrity; exact resume; after training (merge,
# export and generate against PEFT and the training-time model; SmolLM2's end-to-end runs stay in the CPU suite, as
# the losses here equal that suite's); the default command against the CPU suite's torch; mixture-of-experts
# loading, quantization, adapters and merge (transformers 5.17's conversion mapping), and the saved adapter config
# PEFT 0.21.2 loads (names it would read as experts saved by their weights); DPO, IPO and KTO across ranks
# (a second forward with the adapters off, inside the same FSDP units); GRPO across ranks and its sampling (a KV
# cache through the root, its units gathered by FSDP2's unshard, in its float view); sequence parallelism at S = 2 against one
# rank (gloo's all-to-all); DCP checkpoints resumed on other world sizes and FSDP versions (an FSDP1 save resumed by
# FSDP1 on 4 ranks and by FSDP2's float view on 1; the bnb cases, saved by FSDP2, run in the CPU suite, and of the
# kill-and-resume cases only the default command's, saved and resumed in FSDP2's float view, runs here), torch
# 2.11's async save, and checkpoints shipped quantized (a bnb 4-bit release and gpt-oss's MXFP4 kept packed, in
# FSDP2's float view here; DeepSeek's FP8 dequantized).
export QLORA_REFERENCE_PYTHON="$PWD/${VENV_CPU:-.venv}/bin/python"
export QLORA_GPU_PYTHON="$PWD/${VENV_GPU_MACHINE:-.venv-gpu-machine}/bin/python"
"$VENV/bin/python" -m pytest -q -n "${PYTEST_WORKERS:-2}" --durations=15 --dist loadfile --no-loadscope-reorder \
    tests/distributed/test_train_e2e.py \
    tests/distributed/test_packed_layout.py \
    tests/distributed/test_storage_integrity.py \
    "tests/distributed/test_reliability.py::test_sigkill_then_resume_matches_uninterrupted[bnb-2-auto]" \
    "tests/distributed/test_preference.py::test_ranks_times_batch_is_one_rank_with_the_whole_batch[dpo]" \
    "tests/distributed/test_sequence_parallel.py::test_two_ranks_splitting_each_row_train_as_one_rank[bnb]" \
    "tests/distributed/test_preference.py::test_ranks_times_batch_is_one_rank_with_the_whole_batch[ipo]" \
    tests/unit/objectives/test_preference_objectives.py \
    "tests/distributed/test_kto.py::test_ranks_times_batch_is_one_rank_with_the_whole_batch" \
    "tests/distributed/test_grpo.py::test_ranks_times_batch_is_one_rank_with_the_whole_batch[dapo-gathered-2]" \
    tests/unit/objectives/test_sampling.py \
    "tests/distributed/test_elastic_resume.py::test_other_world_size_continues_the_uninterrupted_run[hqq-fsdp1-to-4x1]" \
    "tests/distributed/test_elastic_resume.py::test_other_world_size_continues_the_uninterrupted_run[hqq-fsdp1-to-1x4-fsdp2]" \
    "tests/distributed/test_elastic_resume.py::test_async_save_writes_what_a_synchronous_save_writes" \
    "tests/distributed/test_elastic_resume.py::test_dcp_async_save_writes_the_state_as_it_was_when_called" \
    tests/unit/data/test_global_order.py \
    tests/distributed/test_vlm.py::test_first_step_matches_transformers_with_peft tests/unit/model/test_vision.py \
    "tests/distributed/test_vlm.py::test_image_rows_first_step_matches_transformers_with_peft[qwen2_vl-hqq-fsdp1]" \
    tests/unit/tools/test_export.py tests/unit/quant/test_backends.py tests/unit/parallel/test_sharding.py tests/unit/model/test_moe.py \
    "tests/unit/model/test_moe_families.py::test_names_peft_reads_as_experts_are_adapted_and_saved_by_their_weights" \
    tests/unit/model/test_moe_families.py::test_adapter_config_builds_the_same_keys_in_peft \
    "tests/distributed/test_quantized_checkpoints_e2e.py::test_trains_and_the_adapter_loads_on_transformers_loading[gpt_oss-mxfp4-kept-bnb]" \
    "tests/distributed/test_quantized_checkpoints_e2e.py::test_trains_and_the_adapter_loads_on_transformers_loading[llama-bnb-4bit]" \
    "tests/distributed/test_quantized_checkpoints_e2e.py::test_trains_and_the_adapter_loads_on_transformers_loading[deepseek_v3-fp8-hqq]" \
    tests/benchmarks/test_harness.py::test_gpu_script_dry_run "$@"
