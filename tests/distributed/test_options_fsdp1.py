"""test_options.py's checks of what FSDP1 does its own way, in a file of their own: a second test worker runs them
alongside FSDP2's.

FSDP1 has its own mixed precision, float view of packed bytes, units, gradient clipping, checkpointing wrappers,
state dicts and profiler traces, so the scenarios that exercise those run again here. What no FSDP version touches
(which optimizer, the schedule, the prompt template, the data, the nan policy, the block expansion script) is
checked once, under FSDP2 (pairwise: each of those against the FSDP version, not the full product).
"""

from __future__ import annotations

import pytest

from qlora_fsdp.config.options import choices
from tests.distributed.test_options import (  # noqa: F401 - collected here again, under FSDP1
    four,
    models,
    odd_model,
    pro_model,
    pytest_generate_tests,
    test_accumulation_matches_larger_batch,
    test_bf16_halves_exactly_the_unquantized_bytes,
    test_chunked_loss_equals_whole_logits_on_two_ranks,
    test_dora_adapter_loads_in_peft,
    test_dora_trains_on_quantized_base,
    test_first_step_equals_the_unsharded_computation,
    test_fp16_steps_the_scaler_skips_are_logged_as_skipped,
    test_full_finetune_trains_every_weight_and_saves_a_loadable_model,
    test_gradient_clipping_limits_the_update,
    test_hybrid_sharding_on_four_ranks,
    test_llama_pro_trains_only_the_new_block,
    test_lora_on_the_head_trains_the_head,
    test_lora_trains_exactly_the_adapters,
    test_memory_savers_save_fewer_activations_and_keep_the_losses,
    test_odd_layer_widths_train_and_save_an_adapter_peft_loads,
    test_plain_lora_saves_an_adapter,
    test_precision_mode_computes_close_to_fp32_in_its_own_dtype,
    test_profile_traces_count_the_collectives_of_a_step,
    test_sharding_strategies_agree_and_full_shard_shrinks_with_world_size,
    test_tied_embeddings_train_and_save,
    test_tiled_mlp_trains_as_the_untiled_mlp,
    tied_model,
    two,
)

pytestmark = pytest.mark.distributed

SCENARIOS = (
    *(f"precision-{p}-{q}" for q in ("bnb", "hqq") for p in choices("precision")),
    "sharding-full_shard", "sharding-shard_grad_op", "sharding-no_shard",
    "ckpt-off", "ckpt-nonreentrant", "ckpt-reentrant", "activation-offload", "tiled-mlp", "accum-2x1", "accum-1x2",
    "optimizer-sgd", "optimizer-sgd-clipped", "dora-bnb", "dora-hqq", "odd-shapes-bnb", "odd-shapes-hqq",
    "full-finetune", "plain-lora", "llama-pro-hqq", "profile", "tied-embeddings", "loss-whole-logits", "lora-on-head",
)  # fmt: skip


@pytest.fixture(scope="module")
def version() -> int:
    return 1
