"""The encode stage (qlora_fsdp/data/formats.py): text and prompt/completion rows, their labels, and BOS.

Labels are checked token by token against the tokenizer's own encoding of each part, and BOS on a Llama-3-style
tokenizer (it adds <|begin_of_text|> itself, and its chat template writes it too) and on SmolLM2's (which adds
none).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from qlora_fsdp.data.formats import IGNORE_INDEX, Example, encode_examples, load_examples, special_prefix
from qlora_fsdp.data.rows import fit_examples
from qlora_fsdp.errors import UserError

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "chat_templates"
BOS = "<|begin_of_text|>"
LLAMA3_SPECIALS = [BOS, "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="module")
def llama3_style(tmp_path_factory: pytest.TempPathFactory):
    """A Llama-3-style tokenizer as a model directory holds it: byte-level BPE whose post-processor puts
    <|begin_of_text|> before every text, and a chat template that writes it as well."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=LLAMA3_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    corpus = ["What is the capital of France? Paris is the capital.", "Continue the text: the cat sat on the mat."]
    tok.train_from_iterator(corpus * 20, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos_id)])  # fmt: skip
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token="<|eot_id|>",
                                   additional_special_tokens=LLAMA3_SPECIALS[1:4])  # fmt: skip
    fast.chat_template = (TEMPLATES / "llama3_style.jinja").read_text()
    path = tmp_path_factory.mktemp("llama3-style-tokenizer")
    fast.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def smollm2_tok(smollm2: Path):
    return AutoTokenizer.from_pretrained(smollm2)


def _rows_file(tmp_path: Path, rows: list) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _plain(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_llama3_style_tokenizer_adds_bos_itself(llama3_style, smollm2_tok) -> None:
    """The premise of the BOS tests: one tokenizer adds a BOS of its own accord, the other adds nothing."""
    bos_id = llama3_style.convert_tokens_to_ids(BOS)
    assert llama3_style("the cat")["input_ids"] == [bos_id, *_plain(llama3_style, "the cat")]
    assert special_prefix(llama3_style) == [bos_id]
    assert special_prefix(smollm2_tok) == []


def test_text_rows_learn_every_token_and_end_with_eos(tmp_path: Path, llama3_style) -> None:
    text = "the cat sat on the mat."
    (example,) = load_examples(_rows_file(tmp_path, [{"text": text}]))
    assert example == Example("", text)
    ((ids, labels),) = encode_examples([example], llama3_style, train_on_inputs=False)
    bos_id, eos_id = llama3_style.convert_tokens_to_ids(BOS), llama3_style.eos_token_id
    assert ids == [bos_id, *_plain(llama3_style, text), eos_id]
    assert labels == [IGNORE_INDEX, *ids[1:]]


@pytest.mark.parametrize("train_on_inputs", [False, True])
def test_prompt_completion_rows_learn_the_completion(tmp_path: Path, smollm2_tok, train_on_inputs: bool) -> None:
    prompt, completion = "What is the capital of France? ", "Paris."
    (example,) = load_examples(_rows_file(tmp_path, [{"prompt": prompt, "completion": completion}]))
    assert example == Example(prompt, completion)  # used verbatim: --prompt_style frames alpaca rows only
    ((ids, labels),) = encode_examples([example], smollm2_tok, train_on_inputs=train_on_inputs)
    p, c = _plain(smollm2_tok, prompt), _plain(smollm2_tok, completion)
    assert ids == [*p, *c, smollm2_tok.eos_token_id]
    learned_prompt = p if train_on_inputs else [IGNORE_INDEX] * len(p)
    assert labels == [*learned_prompt, *c, smollm2_tok.eos_token_id]


def test_conversational_prompt_completion_learns_only_the_completion_turns(tmp_path: Path, smollm2_tok) -> None:
    """A prompt that holds an earlier assistant turn: that turn is context, only the completion's reply is learned."""
    row = {
        "prompt": [
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"},
        ],
        "completion": [{"role": "assistant", "content": "Rome."}],
    }
    (conv,) = load_examples(_rows_file(tmp_path, [row]))
    assert conv.learn_from == 3
    ((ids, labels),) = encode_examples([conv], smollm2_tok, train_on_inputs=False)
    learned = smollm2_tok.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
    assert learned == "Rome.<|im_end|>"
    # The same conversation as a chat row learns both replies.
    chat = {"messages": [*row["prompt"], *row["completion"]]}
    ((chat_ids, chat_labels),) = encode_examples(load_examples(_rows_file(tmp_path, [chat])), smollm2_tok,
                                                 train_on_inputs=False)  # fmt: skip
    assert chat_ids == ids
    both = smollm2_tok.decode([t for t, label in zip(chat_ids, chat_labels, strict=True) if label != IGNORE_INDEX])
    assert both == "Paris.<|im_end|>Rome.<|im_end|>"


ROWS_OF_EVERY_FORMAT = [
    {"instruction": "Name the capital of France.", "output": "Paris."},
    {"text": "the cat sat on the mat."},
    {"prompt": "What is the capital of France? ", "completion": "Paris."},
    {"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]},
    {"prompt": [{"role": "user", "content": "Capital?"}], "completion": [{"role": "assistant", "content": "Paris."}]},
]


def test_every_format_begins_with_exactly_one_bos_where_the_tokenizer_adds_one(tmp_path: Path, llama3_style) -> None:
    """Alpaca, text and prompt/completion rows get the tokenizer's BOS; chat rows keep the one their template
    writes, with none added before it."""
    bos_id = llama3_style.convert_tokens_to_ids(BOS)
    examples = load_examples(_rows_file(tmp_path, ROWS_OF_EVERY_FORMAT))
    for ids, labels in encode_examples(examples, llama3_style, train_on_inputs=False):
        assert ids[0] == bos_id
        assert ids.count(bos_id) == 1
        assert labels[0] == IGNORE_INDEX


def test_a_prompt_that_already_begins_with_bos_gets_no_second_one(tmp_path: Path, llama3_style) -> None:
    """TRL-style prompts rendered with the template beforehand carry the BOS as text."""
    bos_id = llama3_style.convert_tokens_to_ids(BOS)
    rows = [{"prompt": f"{BOS}What is the capital? ", "completion": "Paris."}, {"text": f"{BOS}the cat"}]
    for ids, _ in encode_examples(load_examples(_rows_file(tmp_path, rows)), llama3_style, train_on_inputs=False):
        assert ids[0] == bos_id and ids.count(bos_id) == 1


def test_no_bos_is_added_where_the_tokenizer_adds_none(tmp_path: Path, smollm2_tok) -> None:
    """SmolLM2 adds no BOS: sequences start with the text's first token, chat rows exactly as the template
    renders them."""
    examples = load_examples(_rows_file(tmp_path, ROWS_OF_EVERY_FORMAT))
    samples = encode_examples(examples, smollm2_tok, train_on_inputs=False)
    assert samples[1][0][: len(_plain(smollm2_tok, "the cat"))] == _plain(smollm2_tok, "the cat")
    rendered = smollm2_tok.apply_chat_template(examples[3].as_dicts(), tokenize=False)
    assert samples[3][0] == _plain(smollm2_tok, rendered)


def test_rows_of_every_format_fit_and_count(tmp_path: Path, smollm2_tok) -> None:
    examples = load_examples(_rows_file(tmp_path, ROWS_OF_EVERY_FORMAT))
    samples, stats = fit_examples(examples, smollm2_tok, context_length=512, train_on_inputs=False)
    assert (stats.rows, stats.samples, stats.dropped, stats.truncated) == (5, 5, 0, 0)
    assert stats.label_tokens == sum(sum(label != IGNORE_INDEX for label in labels[1:]) for _, labels in samples)


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"text": 3}, "row 2: field 'text' must be a string, got int"),
        ({"prompt": "Q: "}, "row 2: missing field 'completion'"),
        ({"completion": "A"}, "row 2: missing field 'prompt'"),
        ({"prompt": "Q", "completion": [{"role": "assistant"}]}, "row 2: 'prompt' and 'completion' must both be"),
        (
            {"prompt": [{"role": "user", "content": "Q"}], "completion": [{"role": "assistant"}]},
            "row 2 completion messages[1]: 'content' must be a string",
        ),
        ({"other": "x"}, "row 2: missing field 'instruction'"),
    ],
)
def test_malformed_rows_name_the_file_and_row_in_one_line(tmp_path: Path, row: dict, expected: str) -> None:
    path = _rows_file(tmp_path, [{"text": "fine"}, row])
    with pytest.raises(UserError) as err:
        load_examples(path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"--dataset {path} ")
    assert expected in message
