"""Quantization backends (bnb, HQQ): storage layouts, views that never cast, equality with each library's own
quantizer, accuracy, odd shapes, forward/backward, PEFT integration."""

from __future__ import annotations

import math

import bitsandbytes.functional as bnbf
import pytest
import torch
from hqq.core.quantize import BaseQuantizeConfig, HQQBackend, HQQLinear
from peft import LoraConfig, inject_adapter_in_model
from peft.utils.integrations import dequantize_module_weight
from torch import nn

from qlora_fsdp.config.options import QuantConfig
from qlora_fsdp.quant import make_backend
from qlora_fsdp.quant.base import QuantBackend, QuantizedLinear
from qlora_fsdp.quant.bnb import Bnb4bitLinear
from qlora_fsdp.quant.hqq import HqqLinear

CPU = torch.device("cpu")
IN, OUT = 128, 64  # every dim a multiple of bnb's 64-element blocks and HQQ's group size
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
FLOAT_IDS = ("fp32", "bf16", "fp16")
STORAGES = (torch.uint8, *FLOATS)  # uint8: the FSDP2 layout; a float dtype: the FSDP1 layout
STORAGE_IDS = ("u8", *FLOAT_IDS)
BACKENDS = ("bnb", "hqq")
CLASSES = {"bnb": Bnb4bitLinear, "hqq": HqqLinear}
ODD_SHAPES = ((100, 100), (7, 9))  # [out, in]: neither splits into whole 64-element groups


def source_weight(shape: tuple[int, int] = (OUT, IN), seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * 0.02


def source_bias(size: int = OUT, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(size, generator=gen)


def empty(
    quant: str,
    *,
    storage: torch.dtype,
    compute: torch.dtype = torch.float32,
    shape: tuple[int, int] = (OUT, IN),
    bias: bool = False,
    **cfg: object,
) -> tuple[QuantBackend, QuantizedLinear]:
    backend = make_backend(QuantConfig(quant=quant, **cfg), storage_dtype=storage, compute_dtype=compute)  # type: ignore[arg-type]
    assert backend is not None
    out_features, in_features = shape
    return backend, backend.make_module(nn.Linear(in_features, out_features, bias=bias, device="meta"))


def quantized(
    quant: str,
    weight: torch.Tensor,
    *,
    storage: torch.dtype,
    compute: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    **cfg: object,
) -> tuple[QuantBackend, QuantizedLinear]:
    """A loaded layer; `bias` is put in place the way the loader does (a frozen parameter in `bias`)."""
    backend, module = empty(
        quant, storage=storage, compute=compute, shape=tuple(weight.shape), bias=bias is not None, **cfg
    )
    backend.load_weight(module, weight.clone(), device=CPU)
    if bias is not None:
        module.bias = nn.Parameter(bias.clone(), requires_grad=False)
    return backend, module


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().flatten().view(torch.uint8)


def relative_error(deq: torch.Tensor, weight: torch.Tensor) -> float:
    return ((deq.float() - weight).abs().mean() / weight.abs().mean()).item()


# --- the empty layer ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("storage", STORAGES, ids=STORAGE_IDS)
@pytest.mark.parametrize("quant", BACKENDS)
def test_make_module_gives_an_empty_meta_linear(quant: str, storage: torch.dtype) -> None:
    backend, module = empty(quant, storage=storage, compute=torch.bfloat16, bias=True)
    assert type(module) is CLASSES[quant]
    assert isinstance(module, nn.Linear)  # PEFT wraps it with its plain LoRA layer
    assert (module.in_features, module.out_features) == (IN, OUT)
    assert module.weight.is_meta and module.weight.dtype == storage
    assert not module.weight.requires_grad
    assert module.bias is not None and module.bias.is_meta and not module.bias.requires_grad
    # Before loading, dequantize() already has the final shape and dtype, without allocating anything.
    deq = module.dequantize()
    assert deq.is_meta and deq.shape == (OUT, IN) and deq.dtype == torch.bfloat16
    assert backend.is_quantized(module)
    assert not backend.is_quantized(nn.Linear(2, 2))
    assert backend.module_class is CLASSES[quant]


def test_quant_none_has_no_backend() -> None:
    assert make_backend(QuantConfig(quant="none"), storage_dtype=torch.uint8, compute_dtype=torch.float32) is None


# --- storage layouts ------------------------------------------------------------------------------------------------

# What each layout must expose as state, from the libraries' own quantization state.
STATE_NAMES = {
    ("bnb", True): {"absmax", "code", "nested_absmax", "nested_code", "offset"},
    ("bnb", False): {"absmax", "code"},
    ("hqq", None): {"scale", "zero"},
}


def layout_case(quant: str, double_quant: bool | None) -> tuple[str, dict[str, object], set[str]]:
    cfg = {} if double_quant is None else {"bnb_double_quant": double_quant}
    return quant, cfg, STATE_NAMES[quant, double_quant]


LAYOUT_CASES = [layout_case(*key) for key in STATE_NAMES]
LAYOUT_IDS = ["bnb-dq", "bnb-nodq", "hqq"]


@pytest.mark.parametrize(("quant", "cfg", "state_names"), LAYOUT_CASES, ids=LAYOUT_IDS)
def test_uint8_storage_makes_packed_bytes_and_every_state_tensor_frozen_uint8_parameters(
    quant: str, cfg: dict[str, object], state_names: set[str]
) -> None:
    """FSDP2 layout: FSDP2 shards every parameter with its layer; mixed precision skips non-float ones."""
    _, module = quantized(quant, source_weight(), storage=torch.uint8, **cfg)
    params = dict(module.named_parameters())
    assert set(params) == {"weight"} | state_names
    for name, param in params.items():
        assert isinstance(param, nn.Parameter), name
        assert param.dtype == torch.uint8 and param.dim() == 1, name
        assert not param.requires_grad and not param.is_meta, name
    # 4 bits per weight for bnb and HQQ's default 4 bits.
    assert params["weight"].numel() == IN * OUT // 2
    assert torch.equal(params["weight"], module.packed_bytes())
    state = module.state_tensors()
    assert set(state) == state_names
    for name, tensor in state.items():
        assert torch.equal(params[name], as_bytes(tensor)), name


@pytest.mark.parametrize("storage", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize(("quant", "cfg", "state_names"), LAYOUT_CASES, ids=LAYOUT_IDS)
def test_float_storage_views_the_packed_bytes_and_keeps_state_off_the_parameters(
    quant: str, cfg: dict[str, object], state_names: set[str], storage: torch.dtype
) -> None:
    """FSDP1 layout: the packed bytes, zero-padded to whole elements, viewed as the one float dtype FSDP1 flattens;
    the state tensors are plain attributes (their dtypes differ), as flat bytes."""
    shape = (5, 5)  # bnb: 25 weights in 13 bytes, which no float dtype holds in whole elements
    weight = source_weight(shape)
    _, reference = quantized(quant, weight, storage=torch.uint8, **cfg)
    _, module = quantized(quant, weight, storage=storage, **cfg)
    assert set(dict(module.named_parameters())) == {"weight"}
    assert not dict(module.named_buffers())
    packed = module.weight
    assert isinstance(packed, nn.Parameter) and not packed.requires_grad
    assert packed.dtype == storage and packed.dim() == 1
    nbytes = reference.packed_bytes().numel()
    item = packed.element_size()
    assert packed.numel() * item == math.ceil(nbytes / item) * item
    raw = as_bytes(packed)
    assert torch.equal(raw[:nbytes], reference.packed_bytes())
    assert not raw[nbytes:].any(), "padding must be zero bytes"
    assert torch.equal(module.packed_bytes(), reference.packed_bytes())
    for name in state_names:
        value = getattr(module, name)
        assert not isinstance(value, nn.Parameter), name
        assert value.dtype == torch.uint8 and value.dim() == 1, name
        assert torch.equal(value, getattr(reference, name)), name


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(OUT, IN), (5, 5)], ids=["64x128", "5x5"])
@pytest.mark.parametrize("quant", BACKENDS)
def test_bytes_state_and_dequantize_do_not_depend_on_storage_dtype(
    quant: str, shape: tuple[int, int], compute: torch.dtype
) -> None:
    """The storage is a view of the same bytes, never a cast (a cast would change the bytes and the weight)."""
    weight = source_weight(shape)
    modules = {storage: quantized(quant, weight, storage=storage, compute=compute)[1] for storage in STORAGES}
    reference = modules[torch.uint8]
    ref_state = reference.state_tensors()
    ref_deq = reference.dequantize()
    assert ref_deq.dtype == compute and ref_deq.shape == shape
    for storage, module in modules.items():
        assert module.packed_bytes().dtype == torch.uint8, storage
        assert torch.equal(module.packed_bytes(), reference.packed_bytes()), storage
        state = module.state_tensors()
        assert set(state) == set(ref_state), storage
        for name, tensor in state.items():
            assert (tensor.dtype, tensor.shape) == (ref_state[name].dtype, ref_state[name].shape), (storage, name)
            assert torch.equal(as_bytes(tensor), as_bytes(ref_state[name])), (storage, name)
        assert torch.equal(module.dequantize(), ref_deq), storage


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("quant", BACKENDS)
def test_float_view_survives_a_flat_parameter_copy(quant: str, storage: torch.dtype) -> None:
    """FSDP1 copies the float view into one flat parameter next to other tensors and views it back. Random packed
    bytes include NaN bit patterns, which an arithmetic cast would canonicalise; a copy must keep every bit."""
    _, module = quantized(quant, source_weight((128, 256)), storage=storage)
    packed, deq = module.packed_bytes().clone(), module.dequantize()
    assert torch.isnan(module.weight).any(), "precondition: the float view holds NaN bit patterns"
    other = torch.randn(8).to(storage)
    flat = torch.cat([other, module.weight.detach()])
    module.weight = nn.Parameter(flat[other.numel() :], requires_grad=False)
    assert torch.equal(module.packed_bytes(), packed)
    assert torch.equal(module.dequantize(), deq)


# --- equality with each library's own quantizer ---------------------------------------------------------------------


@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16], ids=["u8", "bf16"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_bnb_equals_bitsandbytes_quantize_4bit(
    quant_type: str, double_quant: bool, compute: torch.dtype, storage: torch.dtype
) -> None:
    weight = source_weight()
    _, module = quantized(
        "bnb", weight, storage=storage, compute=compute, bnb_quant_type=quant_type, bnb_double_quant=double_quant
    )
    packed, qs = bnbf.quantize_4bit(
        weight.to(compute), blocksize=64, compress_statistics=double_quant, quant_type=quant_type
    )
    assert torch.equal(module.packed_bytes(), as_bytes(packed))
    expected = {"absmax": qs.absmax, "code": qs.code}
    if double_quant:
        expected |= {"nested_absmax": qs.state2.absmax, "nested_code": qs.state2.code, "offset": qs.offset}
    state = module.state_tensors()
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert state[name].dtype == tensor.dtype, name
        assert torch.equal(state[name], tensor), name
    deq = module.dequantize()
    assert deq.dtype == compute
    assert torch.equal(deq, bnbf.dequantize_4bit(packed, qs))


HQQ_CASES = [(8, 64), (4, 64), (3, 64), (2, 64), (1, 64), (4, 32), (4, 128)]


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("nbits", "group_size"), HQQ_CASES, ids=[f"{b}bit-g{g}" for b, g in HQQ_CASES])
def test_hqq_equals_hqq_linear(nbits: int, group_size: int, compute: torch.dtype) -> None:
    torch.manual_seed(nbits * 1000 + group_size)
    linear = nn.Linear(IN, OUT, bias=True)
    with torch.no_grad():
        linear.bias.normal_()
    HQQLinear.set_backend(HQQBackend.PYTORCH)
    reference = HQQLinear(
        linear,
        BaseQuantizeConfig(nbits=nbits, group_size=group_size),
        compute_dtype=compute,
        device="cpu",
        del_orig=False,
    )
    _, module = quantized(
        "hqq",
        linear.weight.detach(),
        storage=torch.uint8,
        compute=compute,
        bias=linear.bias.detach(),
        hqq_bits=nbits,
        hqq_group_size=group_size,
    )
    assert torch.equal(module.packed_bytes(), as_bytes(reference.W_q))
    state = module.state_tensors()
    for name in ("scale", "zero"):
        assert state[name].dtype == compute, name
        assert torch.equal(state[name], reference.meta[name]), name
    deq = module.dequantize()
    assert deq.dtype == compute
    assert torch.equal(deq, reference.dequantize())
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(2)).to(compute)
    with torch.no_grad():
        torch.testing.assert_close(module(x), reference(x))


# --- accuracy -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("storage", STORAGES, ids=STORAGE_IDS)
@pytest.mark.parametrize("quant", BACKENDS)
def test_dequantize_is_close_to_the_original(quant: str, storage: torch.dtype) -> None:
    """Mean |error| < 0.2 std for 4 bits in 64-weight groups.

    A group of 64 Gaussian weights spans about 4.6 std; 16 uniform levels over that range (HQQ) are 0.31 std apart,
    so rounding costs about a quarter step, 0.08 std, on average. NF4's levels are densest near zero, where most
    weights are, and are scaled by the block's absmax: same order. 0.2 std leaves a 2.5x margin, while a garbled
    weight (e.g. bytes reinterpreted by a cast) would be off by about 1.1 std (mean |a - b| of two N(0, 1) draws).
    """
    weight = source_weight()
    _, module = quantized(quant, weight, storage=storage)
    deq = module.dequantize()
    assert deq.shape == (OUT, IN)
    assert deq.dtype == torch.float32
    error = (deq - weight).abs().mean()
    assert error < 0.2 * weight.std()
    assert error > 0  # it really went through 4 bits
    assert torch.corrcoef(torch.stack([deq.flatten(), weight.flatten()]))[0, 1] > 0.98


@pytest.mark.parametrize("nbits", [1, 2, 3, 8])
def test_hqq_error_shrinks_with_more_bits(nbits: int) -> None:
    weight = source_weight()
    _, module = quantized("hqq", weight, storage=torch.float16, hqq_bits=nbits)
    # 2**-nbits of a 4.6-std group range, generously doubled (1 bit is just 2 levels).
    assert (module.dequantize() - weight).abs().mean() < 2 * 4.6 * weight.std() / 2**nbits


# --- odd shapes -----------------------------------------------------------------------------------------------------

ODD_CASES = [("bnb", 4, shape) for shape in ODD_SHAPES] + [
    ("hqq", nbits, shape) for nbits in (8, 4, 3, 2, 1) for shape in ODD_SHAPES
]


@pytest.mark.parametrize(
    ("quant", "nbits", "shape"), ODD_CASES, ids=[f"{q}-{b}bit-{o}x{i}" for q, b, (o, i) in ODD_CASES]
)
def test_odd_shape_round_trips_with_the_usual_error(quant: str, nbits: int, shape: tuple[int, int]) -> None:
    """A weight that does not split into whole groups quantizes (HQQ pads zero groups; bnb handles it natively)
    and dequantizes to its own shape with the error a 64-multiple shape has."""
    cfg = {"hqq_bits": nbits} if quant == "hqq" else {}
    weight = source_weight(shape, seed=3)
    _, module = quantized(quant, weight, storage=torch.uint8, **cfg)
    deq = module.dequantize()
    assert deq.shape == shape and deq.dtype == torch.float32
    _, regular = quantized(quant, source_weight(seed=3), storage=torch.uint8, **cfg)
    odd_error, regular_error = relative_error(deq, weight), relative_error(regular.dequantize(), source_weight(seed=3))
    assert odd_error > 0
    # Same order: 100x100 has 10,000 weights, so its mean is as tight as the reference's; 7x9 has only 63.
    assert odd_error < (1.5 if shape == (100, 100) else 2.5) * regular_error, (odd_error, regular_error)
    if quant == "hqq":
        # The configured group size is kept: whole 64-weight groups, the last ones padded with zeros.
        assert module.meta["group_size"] == 64
        groups = math.ceil(weight.numel() / 64)
        assert groups <= module.state_tensors()["scale"].numel() < groups + 8  # at most one packed row of padding


@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16], ids=["u8", "bf16"])
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=[f"{o}x{i}" for o, i in ODD_SHAPES])
@pytest.mark.parametrize("quant", BACKENDS)
def test_odd_shape_forward_and_backward(quant: str, shape: tuple[int, int], storage: torch.dtype) -> None:
    out_features, in_features = shape
    bias = source_bias(out_features)
    _, module = quantized(quant, source_weight(shape, seed=4), storage=storage, bias=bias)
    deq = module.dequantize()
    x = torch.randn(2, 3, in_features, generator=torch.Generator().manual_seed(5), requires_grad=True)
    out = module(x)
    assert out.shape == (2, 3, out_features)
    torch.testing.assert_close(out, x @ deq.T + bias, rtol=1e-4, atol=1e-5)
    grad = torch.randn(2, 3, out_features, generator=torch.Generator().manual_seed(6))
    out.backward(grad)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, grad @ deq, rtol=1e-4, atol=1e-5)


# --- forward and backward -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("storage", STORAGES, ids=STORAGE_IDS)
@pytest.mark.parametrize("quant", BACKENDS)
def test_forward_matches_dequantized_matmul(quant: str, storage: torch.dtype) -> None:
    _, module = quantized(quant, source_weight(), storage=storage)
    assert module.bias is None
    deq = module.dequantize()
    packed = module.packed_bytes().clone()
    # Batched, single-row (bitsandbytes' inference path) and 3-D inputs, in training and eval mode.
    for mode in (True, False):
        module.train(mode)
        for shape in ((3, IN), (1, IN), (2, 4, IN)):
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
            with torch.no_grad():
                out = module(x)
            assert out.shape == (*shape[:-1], OUT)
            torch.testing.assert_close(out, x @ deq.T, rtol=1e-4, atol=1e-5)
    # The forward reads the packed bytes, never rewrites them (bnb's own Linear4bit repacks on CPU in eval).
    assert torch.equal(module.packed_bytes(), packed)


@pytest.mark.parametrize(
    ("x_dtype", "compute"),
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float32)],
    ids=["bf16-in-fp32-compute", "fp32-in-bf16-compute", "fp16-in-fp32-compute"],
)
@pytest.mark.parametrize("quant", BACKENDS)
def test_output_and_input_gradient_keep_the_input_dtype(quant: str, x_dtype: torch.dtype, compute: torch.dtype) -> None:
    bias = source_bias()
    _, module = quantized(quant, source_weight(), storage=torch.uint8, compute=compute, bias=bias)
    deq = module.dequantize()
    assert deq.dtype == compute
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(7)).to(x_dtype).requires_grad_()
    out = module(x)
    assert out.dtype == x_dtype
    expected = x.detach().to(compute) @ deq.T + bias.to(compute)
    tol = {"rtol": 2e-2, "atol": 2e-2}  # one rounding to the lower of the two precisions
    torch.testing.assert_close(out.float(), expected.float(), **tol)
    grad = torch.randn(3, OUT, generator=torch.Generator().manual_seed(8)).to(x_dtype)
    out.backward(grad)
    assert x.grad is not None and x.grad.dtype == x_dtype
    torch.testing.assert_close(x.grad.float(), (grad.to(compute) @ deq).float(), **tol)


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("quant", BACKENDS)
def test_bias_enters_forward(quant: str, compute: torch.dtype) -> None:
    bias = source_bias()
    _, module = quantized(quant, source_weight(), storage=torch.bfloat16, compute=compute, bias=bias)
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(6)).to(compute)
    with torch.no_grad():
        out = module(x)
    deq = module.dequantize()
    expected = x.float() @ deq.float().T + bias
    tol = {"rtol": 1e-4, "atol": 1e-4} if compute == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out.float(), expected, **tol)
    # The bias is really in there: without it the output is far off.
    assert (out.float() - (x.float() @ deq.float().T)).abs().mean() > 0.5


@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16], ids=["u8", "bf16"])
@pytest.mark.parametrize("quant", BACKENDS)
def test_input_gradient_flows_through_the_frozen_layer(quant: str, storage: torch.dtype) -> None:
    """LoRA on earlier layers needs d(out)/d(x) = W through the quantized base layer; the base gets no gradient."""
    _, module = quantized(quant, source_weight(), storage=storage, bias=source_bias())
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(7), requires_grad=True)
    grad_out = torch.randn(3, OUT, generator=torch.Generator().manual_seed(8))
    module(x).backward(grad_out)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, grad_out @ module.dequantize(), rtol=1e-4, atol=1e-5)
    for name, param in module.named_parameters():
        assert not param.requires_grad and param.grad is None, name


def test_hqq_forward_saves_nothing_for_backward() -> None:
    """HQQ's forward dequantizes again in backward from the layer's own (by then re-gathered) packed weights: it
    hands nothing to saved-tensor hooks, so --activation_offload never copies a layer's packed weights to the host
    and no [out, in] float weight is kept."""
    _, module = quantized("hqq", source_weight(), storage=torch.uint8)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(9), requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    assert saved == []
    grad = torch.randn(3, OUT, generator=torch.Generator().manual_seed(10))
    out.backward(grad)
    torch.testing.assert_close(x.grad, grad @ module.dequantize(), rtol=1e-4, atol=1e-5)


# --- replacing linears ----------------------------------------------------------------------------------------------


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
    assert backend is not None
    asked: list[str] = []

    def should_quantize(name: str) -> bool:
        asked.append(name)
        return name.rpartition(".")[2] != "head"

    swapped = backend.replace_linears(model, should_quantize=should_quantize)
    assert sorted(swapped) == ["block.up", "proj"]
    assert sorted(asked) == ["block.head", "block.up", "head", "proj"]  # asked about linears only
    assert type(model.proj) is CLASSES[quant] and type(model.block.up) is CLASSES[quant]
    assert type(model.head) is nn.Linear and type(model.block.head) is nn.Linear
    assert type(model.norm) is nn.LayerNorm
    # The replacement keeps the shape and bias it will be filled with, and is still empty.
    assert (model.proj.in_features, model.proj.out_features) == (IN, OUT)
    assert (model.block.up.in_features, model.block.up.out_features) == (OUT, IN)
    assert model.proj.bias is not None and model.block.up.bias is None
    assert model.proj.is_meta and model.block.up.is_meta


# --- PEFT -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16], ids=["u8", "bf16"])
@pytest.mark.parametrize("quant", BACKENDS)
def test_peft_dequantizes_the_layer_through_dequantize(quant: str, storage: torch.dtype) -> None:
    """PEFT's DoRA reads a base weight with dequantize_module_weight, which calls module.dequantize() on any module
    that has `W_q`; without it, it would take the packed bytes in `weight` for the weight."""
    _, module = quantized(quant, source_weight(), storage=storage)
    assert module.W_q is module.weight
    weight = dequantize_module_weight(module)
    assert weight.shape == (OUT, IN)
    assert torch.equal(weight, module.dequantize())


@pytest.mark.parametrize("quant", BACKENDS)
def test_dora_on_a_quantized_layer_equals_dora_on_its_dequantized_weight(quant: str) -> None:
    class Wrapper(nn.Module):
        def __init__(self, proj: nn.Linear) -> None:
            super().__init__()
            self.proj = proj

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x)

    _, module = quantized(quant, source_weight(), storage=torch.uint8)
    plain = nn.Linear(IN, OUT, bias=False)
    with torch.no_grad():
        plain.weight.copy_(module.dequantize())
    # Random (not identity) adapters, so the weight norm DoRA takes from the base weight matters.
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["proj"], use_dora=True, init_lora_weights=False)
    torch.manual_seed(11)
    ours = inject_adapter_in_model(cfg, Wrapper(module))
    torch.manual_seed(11)
    theirs = inject_adapter_in_model(cfg, Wrapper(plain))
    assert ours.proj.base_layer is module
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        out = ours(x)
        torch.testing.assert_close(out, theirs(x), rtol=1e-5, atol=1e-6)
        assert (out - module(x)).abs().mean() > 1e-3  # the adapter really changes the output
