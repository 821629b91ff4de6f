"""DeepSeek-V3.2, GLM-5 and DeepSeek-V4: sparse attention with a lightning indexer, and V4's layout (hyper-connections,
a grouped output projection, hash-routed first layers, its own checkpoint names), each built and saved by
transformers' own classes (tests/moe_models.py).

The bar is transformers' own model of the same files: one process in fp32 without quantization, a fresh adapter
(B zero), the first step's loss over a padded batch equals the mean label loss of `from_pretrained`'s model on
each row alone. With bnb, the indexers' linears stay plain, frozen and unadapted (they only choose keys: no
gradient reaches them), and so does V4's grouped output projection (a linear with a forward of its own), while
every other linear of attention is quantized and adapted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from qlora_fsdp.config.options import LoraConfig, ModelConfig, QuantConfig
from qlora_fsdp.model.attention import indexer_linears
from qlora_fsdp.model.lora import inject_lora, peft_lora_layers
from qlora_fsdp.model.skeleton import build_skeleton
from qlora_fsdp.quant import make_backend
from qlora_fsdp.quant.base import QuantizedLinear
from tests.moe_models import build_moe_model
from tests.unit.model.test_checkpoint_formats import first_loss, transformers_label_loss

FAMILIES = ("deepseek_v32", "glm_moe_dsa", "deepseek_v4")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sparse-attention")
    return {f: build_moe_model(f, root / f, tokenizer_from=tiny_model, seed=3 + i) for i, f in enumerate(FAMILIES)}


@pytest.mark.parametrize("family", FAMILIES)
def test_first_step_loss_equals_transformers(no_launcher: None, models: dict[str, Path], rows: Path, tmp_path: Path,
                                             family: str) -> None:  # fmt: skip
    """A padded batch of 4 rows: V3.2's and GLM-5's indexer scores against the padding mask (once, it was handed
    quantized bytes and stopped at step 1: "result type Float can't be cast to the desired output type Byte"), V4's
    names are read as transformers reads them (its final norm was once renamed by a rule meant for attention's)."""
    model = models[family]
    ours = first_loss(model, rows, tmp_path, "none")
    theirs = transformers_label_loss(model, rows)
    print(f"{family}: step-1 loss {ours:.6f}, transformers {theirs:.6f}, relative {abs(ours - theirs) / theirs:.1e}")
    assert ours == pytest.approx(theirs, rel=2e-4)


@pytest.mark.parametrize("family", FAMILIES[:2])
def test_packed_rows_first_step_loss_equals_transformers(no_launcher: None, models: dict[str, Path], rows: Path,
                                                         tmp_path: Path, family: str) -> None:  # fmt: skip
    """The rows packed into shared sequences, told apart by their position ids: each still attends (and its
    indexer chooses) within itself alone."""
    model = models[family]
    ours = first_loss(model, rows, tmp_path, "none", packing=True, batch_size=2)  # the 4 rows fill 2 sequences
    assert ours == pytest.approx(transformers_label_loss(model, rows), rel=2e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_indexers_and_grouped_projections_stay_plain_frozen_and_unadapted(models: dict[str, Path],
                                                                           family: str) -> None:  # fmt: skip
    backend = make_backend(QuantConfig(quant="bnb"), storage_dtype=torch.uint8, compute_dtype=torch.float32)
    skeleton = build_skeleton(ModelConfig(model=str(models[family])), backend=backend, param_dtype=torch.float32)
    model = skeleton.model
    indexers = indexer_linears(model)
    assert indexers and all(".indexer." in name for name in indexers)
    grouped = {n for n, m in model.named_modules() if type(m).__name__.endswith("GroupedLinear")}
    assert bool(grouped) == (family == "deepseek_v4")
    for name in indexers | grouped:
        assert not isinstance(model.get_submodule(name), QuantizedLinear) and name not in skeleton.quantized, name
    attention = [n for n, m in model.named_modules() if ".self_attn." in n and isinstance(m, nn.Linear)]
    plain = sorted(set(attention) - indexers - grouped)
    assert plain and all(name in skeleton.quantized for name in plain)

    peft_model = inject_lora(model, LoraConfig(lora_rank=4, lora_alpha=8), dtype=torch.float32)
    lora = {id(m) for m in peft_lora_layers(peft_model)}
    adapted = {n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if id(m) in lora}
    assert set(plain) <= adapted and not adapted & (indexers | grouped)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert not [n for n in trainable if ".indexer." in n or "o_a_proj" in n]
