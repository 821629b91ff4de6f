"""Quantization backends (bnb, HQQ): storage dtype, float views that never cast, keep=False, accuracy, forward."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch
from hqq.core.quantize import HQQBackend, HQQLinear, Quantizer, hqq_base_quant_config
from torch import nn

import qlora_fsdp.quant.hqq  # noqa: F401 - importing it selects HQQ's pure-PyTorch backend
from qlora_fsdp.config import QuantConfig
from qlora_fsdp.quant import make_backend
from qlora_fsdp.quant.base import QuantBackend

CPU = torch.device("cpu")
IN, OUT = 128, 64  # every dim a multiple of bnb's 64-element blocks and HQQ's group size
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
FLOAT_IDS = ("fp32", "bf16", "fp16")
BACKENDS = ("bnb", "hqq")


def source_weight(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(OUT, IN, generator=gen) * 0.02


def source_bias(seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(OUT, generator=gen)


def quantized(
    quant: str,
    weight: torch.Tensor,
    *,
    storage: torch.dtype,
    compute: torch.dtype = torch.float32,
    keep: bool = True,
    bias: bool = False,
    **cfg: object,
) -> tuple[QuantBackend, nn.Module]:
    backend = make_backend(QuantConfig(quant=quant, **cfg), storage_dtype=storage, compute_dtype=compute)  # type: ignore[arg-type]
    module = backend.make_module(nn.Linear(IN, OUT, bias=bias, device="meta"), device=CPU)
    backend.load_weight(module, weight.clone(), device=CPU, keep=keep)
    return backend, module


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).flatten()


# --- HQQ's packed ints survive being viewed as any float dtype (what FSDP flattens) -------------------------------


def test_importing_the_backend_selects_hqq_pytorch() -> None:
    assert HQQLinear.backend is HQQBackend.PYTORCH
    # PYTORCH names HQQ's autograd-friendly forward (dequantize, matmul, bias) that runs on CPU too.
    assert HQQLinear.forward is getattr(HQQLinear, HQQBackend.PYTORCH.value)


@pytest.mark.parametrize("float_dtype", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize("nbits", [8, 4, 3, 2, 1])
def test_hqq_packed_ints_round_trip_through_a_float_view(nbits: int, float_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(nbits)
    rows = 80  # divisible by every packing factor (1, 2, 4, 8 per byte; 10 per int32)
    ints = torch.randint(0, 2**nbits, (rows, 64), generator=gen, dtype=torch.uint8)
    packing = Quantizer.bit_to_packing[nbits]
    packed = Quantizer.pack[packing](ints)
    int_dtype = Quantizer.unpack_view_dtype[packing]
    assert packed.dtype == int_dtype

    as_float = packed.view(float_dtype)
    assert as_float.dtype == float_dtype
    assert torch.equal(as_float.view(int_dtype), packed)

    # FSDP copies the float view into a flat parameter next to other tensors; a copy must keep every bit too
    # (random bytes include NaN patterns, which an arithmetic cast would canonicalise). The offset keeps int32
    # alignment, as it is in FSDP's flat parameter where the packed tensor follows even-sized tensors.
    other = torch.randn(8).to(float_dtype)
    flat = torch.cat([other, as_float.flatten()])
    back = flat[other.numel() :].view(as_float.shape).view(int_dtype)
    assert torch.equal(back, packed)

    unpacked = Quantizer.unpack[packing](back)[:rows]
    assert torch.equal(unpacked.to(torch.uint8), ints)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("nbits", [8, 4, 3, 2, 1])
def test_hqq_view_as_float_gives_the_same_forward(nbits: int, compute_dtype: torch.dtype) -> None:
    torch.manual_seed(nbits)
    linear = nn.Linear(IN, OUT, bias=True)
    layers = {
        view: HQQLinear(
            linear,
            hqq_base_quant_config(nbits=nbits, group_size=64, view_as_float=view),
            compute_dtype=compute_dtype,
            device="cpu",
            del_orig=False,
        )
        for view in (True, False)
    }
    assert layers[True].W_q.dtype == compute_dtype
    assert layers[False].W_q.dtype == Quantizer.unpack_view_dtype[Quantizer.bit_to_packing[nbits]]
    x = torch.randn(5, IN).to(compute_dtype)
    with torch.no_grad():
        floats, ints = layers[True](x), layers[False](x)
    # Observed: exactly equal (the float view is only a reinterpretation of the same bytes).
    assert torch.equal(floats, ints)
    assert torch.equal(as_bytes(layers[True].W_q), as_bytes(layers[False].W_q))


# --- both backends through the QuantBackend interface -----------------------------------------------------------


@pytest.mark.parametrize("storage", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize("quant", BACKENDS)
def test_packed_tensor_has_the_storage_dtype(quant: str, storage: torch.dtype) -> None:
    backend, module = quantized(quant, source_weight(), storage=storage)
    packed = backend.packed(module)
    assert isinstance(packed, nn.Parameter)
    assert not packed.requires_grad
    assert packed.dtype == storage
    assert packed.device.type == "cpu"
    assert backend.is_quantized(module)
    # 4 bits per weight: the float tensor holds exactly in*out/2 bytes.
    assert packed.numel() * packed.element_size() == IN * OUT // 2


def reference_packed_bytes(quant: str, weight: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """The library's own integer packing of `weight` (uint8 storage, no float view)."""
    if quant == "bnb":
        ints, _ = bnb.functional.quantize_4bit(
            weight.to(compute), blocksize=64, compress_statistics=True, quant_type="nf4"
        )
    else:
        ints, _ = Quantizer.quantize(
            weight,
            nbits=4,
            channel_wise=True,
            group_size=64,
            optimize=True,
            round_zero=True,
            axis=1,
            compute_dtype=compute,
            view_as_float=False,
            device="cpu",
        )
    assert ints.dtype == torch.uint8
    return ints.flatten()


@pytest.mark.parametrize("storage", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize("quant", BACKENDS)
def test_storage_is_a_view_of_the_packed_ints_never_a_cast(quant: str, storage: torch.dtype) -> None:
    weight = source_weight()
    backend, module = quantized(quant, weight, storage=storage)
    packed = backend.packed(module)
    raw = packed.data.view(torch.uint8)
    assert torch.equal(as_bytes(raw.view(storage)), raw.flatten())
    assert torch.equal(raw.flatten(), reference_packed_bytes(quant, weight, torch.float32))


@pytest.mark.parametrize("storage", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize("quant", BACKENDS)
def test_keep_false_leaves_packed_on_meta_with_real_identical_state(quant: str, storage: torch.dtype) -> None:
    weight = source_weight()
    kept_backend, kept = quantized(quant, weight, storage=storage, keep=True)
    lean_backend, lean = quantized(quant, weight, storage=storage, keep=False)
    kept_packed, lean_packed = kept_backend.packed(kept), lean_backend.packed(lean)
    assert lean_packed.is_meta
    assert not kept_packed.is_meta
    assert (lean_packed.shape, lean_packed.dtype) == (kept_packed.shape, kept_packed.dtype)
    kept_state, lean_state = kept_backend.quant_state_tensors(kept), lean_backend.quant_state_tensors(lean)
    assert kept_state, "a quantized module has scales/zeros"
    assert set(lean_state) == set(kept_state)
    for key, value in lean_state.items():
        assert not value.is_meta, key
        assert value.dtype == kept_state[key].dtype, key
        assert torch.equal(as_bytes(value), as_bytes(kept_state[key])), key


@pytest.mark.parametrize("storage", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize("quant", BACKENDS)
def test_dequantize_is_close_to_the_original(quant: str, storage: torch.dtype) -> None:
    """Mean |error| < 0.2 std for 4 bits in 64-weight groups.

    A group of 64 Gaussian weights spans about 4.6 std; 16 uniform levels over that range (HQQ) are 0.31 std apart,
    so rounding costs about a quarter step, 0.08 std, on average. NF4's levels are densest near zero, where most
    weights are, and are scaled by the block's absmax: same order. 0.2 std leaves a 2.5x margin, while a garbled
    weight (e.g. bytes reinterpreted by a cast) would be off by about 1.1 std (mean |a - b| of two N(0, 1) draws).
    """
    weight = source_weight()
    backend, module = quantized(quant, weight, storage=storage)
    deq = backend.dequantize(module)
    assert deq.shape == (OUT, IN)
    assert deq.dtype == torch.float32
    error = (deq - weight).abs().mean()
    assert error < 0.2 * weight.std()
    assert error > 0  # it really went through 4 bits
    assert torch.corrcoef(torch.stack([deq.flatten(), weight.flatten()]))[0, 1] > 0.98


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("quant", BACKENDS)
def test_dequantize_does_not_depend_on_storage_dtype(quant: str, compute: torch.dtype) -> None:
    weight = source_weight()
    results = {}
    for storage in FLOATS:
        backend, module = quantized(quant, weight, storage=storage, compute=compute)
        results[storage] = backend.dequantize(module)
        assert results[storage].dtype == compute
    reference = results[torch.float32]
    for storage, deq in results.items():
        assert torch.equal(deq, reference), storage


@pytest.mark.parametrize("storage", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("nbits", [1, 2, 3, 8])
def test_hqq_other_bit_widths_through_the_backend(nbits: int, storage: torch.dtype) -> None:
    weight = source_weight()
    backend, module = quantized("hqq", weight, storage=storage, hqq_bits=nbits)
    _, reference = quantized("hqq", weight, storage=torch.bfloat16, hqq_bits=nbits)
    assert backend.packed(module).dtype == storage
    assert torch.equal(as_bytes(backend.packed(module)), as_bytes(backend.packed(reference)))
    deq = backend.dequantize(module)
    assert torch.equal(deq, backend.dequantize(reference))
    # More bits, smaller error: 2**-nbits of a 4.6-std group range, generously doubled (1 bit is just 2 levels).
    assert (deq - weight).abs().mean() < 2 * 4.6 * weight.std() / 2**nbits


@pytest.mark.parametrize("storage", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize("quant", BACKENDS)
def test_forward_matches_dequantized_matmul(quant: str, storage: torch.dtype) -> None:
    backend, module = quantized(quant, source_weight(), storage=storage)
    assert module._parameters.get("bias") is None
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = module(x)
    expected = x @ backend.dequantize(module).T
    assert out.shape == (3, OUT)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("quant", BACKENDS)
def test_bias_survives_loading_and_enters_forward(quant: str, compute: torch.dtype) -> None:
    backend, module = quantized(quant, source_weight(), storage=torch.bfloat16, compute=compute, bias=True)
    # load_weight must leave the bias slot in place for the loader to fill (it sets module._parameters["bias"]).
    slot = module._parameters.get("bias")
    assert isinstance(slot, nn.Parameter), "load_weight dropped the bias parameter"
    assert tuple(slot.shape) == (OUT,)
    bias = source_bias()
    module.bias = nn.Parameter(bias.clone(), requires_grad=False)
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(6)).to(compute)
    with torch.no_grad():
        out = module(x)
    deq = backend.dequantize(module)
    expected = x.float() @ deq.float().T + bias
    tol = {"rtol": 1e-4, "atol": 1e-4} if compute == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out.float(), expected, **tol)
    # The bias is really in there: without it the output is far off.
    assert (out.float() - (x.float() @ deq.float().T)).abs().mean() > 0.5


@pytest.mark.parametrize("quant", BACKENDS)
def test_replace_linears_swaps_only_accepted_names(quant: str) -> None:
    with torch.device("meta"):
        model = nn.Module()
        model.proj = nn.Linear(IN, OUT)
        model.norm = nn.LayerNorm(OUT)
        model.block = nn.Module()
        model.block.up = nn.Linear(OUT, IN, bias=False)
        model.block.head = nn.Linear(IN, OUT, bias=False)
        model.head = nn.Linear(IN, OUT, bias=False)
    backend = make_backend(QuantConfig(quant=quant), storage_dtype=torch.bfloat16, compute_dtype=torch.bfloat16)
    asked: list[str] = []

    def should_quantize(name: str) -> bool:
        asked.append(name)
        return name.rpartition(".")[2] != "head"

    swapped = backend.replace_linears(model, should_quantize=should_quantize, device=CPU)
    assert sorted(swapped) == ["block.up", "proj"]
    assert sorted(asked) == ["block.head", "block.up", "head", "proj"]  # asked about linears only
    assert backend.is_quantized(model.proj) and backend.is_quantized(model.block.up)
    assert type(model.head) is nn.Linear and type(model.block.head) is nn.Linear
    assert type(model.norm) is nn.LayerNorm
    # The replacement keeps the shape it will be filled with.
    assert (model.proj.in_features, model.proj.out_features) == (IN, OUT)
    assert (model.block.up.in_features, model.block.up.out_features) == (OUT, IN)


@pytest.mark.parametrize("quant", BACKENDS)
def test_input_gradient_flows_through_the_frozen_layer(quant: str) -> None:
    """LoRA on earlier layers needs d(out)/d(x) = W through the quantized base layer."""
    backend, module = quantized(quant, source_weight(), storage=torch.bfloat16)
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(7), requires_grad=True)
    grad_out = torch.randn(3, OUT, generator=torch.Generator().manual_seed(8))
    module(x).backward(grad_out)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, grad_out @ backend.dequantize(module), rtol=1e-4, atol=1e-5)
    assert not backend.packed(module).requires_grad


@pytest.mark.parametrize(("quant_type", "double_quant"), [("nf4", True), ("nf4", False), ("fp4", True), ("fp4", False)])
def test_bnb_flags_reach_the_quantizer(quant_type: str, double_quant: bool) -> None:
    weight = source_weight()
    backend, module = quantized(
        "bnb", weight, storage=torch.bfloat16, bnb_quant_type=quant_type, bnb_double_quant=double_quant
    )
    assert module.quant_state.quant_type == quant_type
    state = backend.quant_state_tensors(module)
    # Double quantization stores the per-block absmax as 8-bit codes plus a second-level absmax.
    assert ("nested_absmax" in state) is double_quant
    assert state["absmax"].dtype == (torch.uint8 if double_quant else torch.float32)
    assert (backend.dequantize(module) - weight).abs().mean() < 0.2 * weight.std()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_hqq_group_size_reaches_the_quantizer(group_size: int) -> None:
    weight = source_weight()
    backend, module = quantized("hqq", weight, storage=torch.float32, hqq_group_size=group_size)
    state = backend.quant_state_tensors(module)
    # One scale and one zero per group of `group_size` weights.
    assert state["scale"].numel() == state["zero"].numel() == IN * OUT // group_size
    assert module.meta["group_size"] == group_size
