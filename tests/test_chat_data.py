"""dataset=chat: rows of JSON lines, Parquet or CSV as windows whose targets are the answers
alone; packed examples that train exactly as one by one (attention kept within each); the
one-line errors for bad rows; dpt-generate asking a chat run as it trained."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from dpt.commands import generate
from dpt.data.chat import ChatData
from dpt.data.conversations import ChatFormat
from dpt.errors import DptError
from dpt.models.gpt import GPT
from dpt.targets import IGNORE_INDEX, Targets
from dpt.tasks.language_model import LanguageModel
from scripts.make_chat_fixture import conversation
from tests import hf_folders

BLOCK = 160  # ChatML in bytes: about 70 a conversation
ROWS = [conversation(a, b) for a, b in ((7, 35), (12, 3), (99, 99), (40, 2), (5, 61), (23, 8))]
CHATML_ANSWER_END = "<|im_end|>\n"


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def chat_data(root: Path, packing: bool = True, tokenizer: str | None = None,
              **extra: object) -> ChatData:  # fmt: skip
    settings = {"template": None, "chat_template": None, "val_fraction": 0.0} | extra
    return ChatData(root=str(root), tokenizer=tokenizer, block_size=BLOCK, packing=packing,
                    num_workers=0, seed=0, **settings)  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_folders.llama(tmp_path_factory.mktemp("chat") / "llama")


def test_the_targets_are_the_answers_and_the_end_of_their_turn(tmp_path: Path) -> None:
    data = chat_data(_write_jsonl(tmp_path / "chat.jsonl", ROWS), packing=False)
    for i, row in enumerate(ROWS):
        _, targets = data.train[i]
        scored = targets[targets != IGNORE_INDEX].tolist()
        assert bytes(scored).decode() == row["messages"][1]["content"] + CHATML_ANSWER_END
    inputs, _ = data.train[0]
    assert bytes(inputs[inputs != 0].tolist()).decode() == (
        "<|im_start|>user\n07+35=<|im_end|>\n<|im_start|>assistant\n042<|im_end|>"
    )  # the last token is only a target


def test_jsonl_parquet_and_csv_give_the_same_windows(tmp_path: Path) -> None:
    import pandas as pd

    frame = pd.DataFrame({"prompt": [f"{a}+{b}=" for a, b in ((1, 2), (30, 4), (5, 66))],
                          "response": ["3", "34", "71"]})  # fmt: skip
    template = {"prompt": "Q: {prompt}\nA: ", "response": "{response}\n"}
    (tmp_path / "j").mkdir()
    frame.to_json(tmp_path / "j" / "train.jsonl", orient="records", lines=True)
    (tmp_path / "p").mkdir()
    frame.to_parquet(tmp_path / "p" / "train.parquet")
    (tmp_path / "c").mkdir()
    frame.to_csv(tmp_path / "c" / "train.csv", index=False)
    made = [chat_data(tmp_path / kind, template=template) for kind in "jpc"]
    first = made[0].train.__getitems__([0])
    assert (
        bytes(first.labels[0][first.labels[0] != IGNORE_INDEX].tolist()).decode() == "3\n34\n71\n"
    )
    for other in made[1:]:
        batch = other.train.__getitems__([0])
        assert torch.equal(batch.inputs, first.inputs) and torch.equal(batch.labels, first.labels)


def _loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    task = LanguageModel(targets=Targets(integer=True, shape=(BLOCK,)), num_outputs=256, names=[],
                         watch="val/loss", mode="min")  # fmt: skip
    return task.loss(model(inputs), targets)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(num_outputs=256, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32, dropout=0.0,
               bias=True).eval()  # fmt: skip


def test_the_loss_follows_the_answers_targets_and_not_the_prompts(tmp_path: Path) -> None:
    data = chat_data(_write_jsonl(tmp_path / "chat.jsonl", ROWS))
    batch = data.train.__getitems__(range(len(data.train)))
    model = _gpt()
    with torch.no_grad():
        loss = _loss(model, batch.inputs, batch.labels)
        # The tokens one after each position, unmasked: the prompt's next tokens changed.
        prompt = batch.labels.clone()
        prompt[batch.labels == IGNORE_INDEX] = 7  # scored, these would change the loss
        masked_again = torch.where(batch.labels == IGNORE_INDEX, IGNORE_INDEX, prompt)
        assert _loss(model, batch.inputs, masked_again) == loss
        assert _loss(model, batch.inputs, prompt) != loss  # (were they scored)
        answers = torch.where(batch.labels == IGNORE_INDEX, batch.labels, (batch.labels + 1) % 256)
        assert _loss(model, batch.inputs, answers) != loss


def _examples_loss(model: torch.nn.Module, data: ChatData) -> torch.Tensor:
    """The mean loss per answer token over the whole training set, in one batch."""
    batch = data.train.__getitems__(range(len(data.train)))
    with torch.no_grad():
        return _loss(model, batch.inputs, batch.labels)


def _hf_llama(folder: Path) -> torch.nn.Module:
    from dpt.models.hf import pretrained

    return pretrained("language_model", hf_folders.VOCAB, (2, BLOCK), path=str(folder)).eval()


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_packed_windows_train_as_the_examples_one_by_one(
    kind: str, tmp_path: Path, llama: Path
) -> None:
    root = _write_jsonl(tmp_path / "chat.jsonl", ROWS)
    tokenizer = None if kind == "gpt" else str(llama)
    packed, alone = (chat_data(root, packing, tokenizer) for packing in (True, False))
    assert len(packed.train) < len(alone.train) == len(ROWS)  # several examples a window
    model = _gpt() if kind == "gpt" else _hf_llama(llama)
    assert abs(_examples_loss(model, packed) - _examples_loss(model, alone)) < 1e-5


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_attention_never_crosses_examples_in_a_window(
    kind: str, tmp_path: Path, llama: Path
) -> None:
    tokenizer = None if kind == "gpt" else str(llama)
    data = chat_data(_write_jsonl(tmp_path / "chat.jsonl", ROWS), True, tokenizer)
    window = data.train[0][0][None]
    positions = window[0, 1]
    second = int((positions == 0).nonzero()[1])  # where the second example starts
    changed = window.clone()
    changed[0, 0, :second] = (changed[0, 0, :second] + 1) % 200  # the first example's tokens
    model = _gpt() if kind == "gpt" else _hf_llama(llama)
    with torch.no_grad():
        before, after = model(window), model(changed)
    assert not torch.allclose(before[0, :second], after[0, :second])
    assert torch.equal(before[0, second:], after[0, second:])


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"messages": [{"role": "user"}]}, "row 2: messages[0] has no 'content'"),
        (
            {"conversation": []},
            "row 2 has no 'messages' (or set dataset.template for rows of 'prompt' and 'response')",
        ),
        (
            {"messages": [{"role": "bot", "content": "hi"}]},
            "row 2: messages[0] has the role 'bot' (roles: system, user, assistant)",
        ),
    ],
)
def test_a_bad_row_is_one_line_naming_it(row: dict, message: str, tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "chat.jsonl", [ROWS[0], row])
    with pytest.raises(DptError) as error:
        chat_data(path)
    assert str(error.value) == f"dataset.root={path}: {message}"


def test_a_window_without_an_answer_token_is_one_line(tmp_path: Path) -> None:
    long = {"messages": [{"role": "user", "content": "x" * 200},
                         {"role": "assistant", "content": "42"}]}  # fmt: skip
    path = _write_jsonl(tmp_path / "chat.jsonl", [ROWS[0], long])
    with pytest.raises(DptError) as error:
        chat_data(path)
    assert str(error.value) == (
        f"dataset.root={path}: row 2: no answer token within model.block_size=160 tokens (the "
        "row has 263 tokens, its answer 13): raise model.block_size, or shorten the prompt"
    )


def test_examples_cut_at_the_window_say_which_setting_sets_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    long = {"messages": [{"role": "user", "content": "1+1="},
                         {"role": "assistant", "content": "2" * 200}]}  # fmt: skip
    path = _write_jsonl(tmp_path / "chat.jsonl", [ROWS[0], long])
    with caplog.at_level("WARNING"):
        chat_data(path)
    assert "chat: 1 example(s) longer than model.block_size=160 + 1 tokens were cut at the " \
        "end" in caplog.text  # fmt: skip


def test_dpt_generate_asks_a_chat_run_in_its_template(monkeypatch: pytest.MonkeyPatch) -> None:
    fmt = ChatFormat()  # ChatML
    assert (
        fmt.generation_prompt("07+35=")
        == "<|im_start|>user\n07+35=<|im_end|>\n<|im_start|>assistant\n"
    )
    assert fmt.stop() == "<|im_end|>"
    seen: list[list[int]] = []

    def answer(predictor, ids, *rest):  # the model's answer, then the end of its turn
        seen.append(ids)
        yield from list(b"042<|im_end|>\nmore")

    monkeypatch.setattr(generate, "sample", answer)
    from dpt.data.tokenizer import ByteTokenizer

    args = argparse.Namespace(seed=0, max_new_tokens=20, temperature=0, top_k=None, stop=fmt.stop())
    text = generate.complete(None, ByteTokenizer(), fmt.generation_prompt("07+35="), args)
    assert text == "042" and bytes(seen[0]).decode().endswith("<|im_start|>assistant\n")


@pytest.mark.slow  # two training runs
@pytest.mark.timeout(300)
def test_the_step_weighs_each_answer_token_alike_across_micro_batches(tmp_path: Path) -> None:
    """Windows hold different numbers of answer tokens: a step of 2 micro-batches of 4 takes
    the mean per answer token of all 8, as one batch of 8 does (not the mean of two means)."""
    from tests.helpers import load_weights, max_abs_diff, run_here

    (tmp_path / "chat").mkdir()
    answers = [{"messages": [{"role": "user", "content": f"{i}?"},
                             {"role": "assistant", "content": "ab" * (i % 13 + 1)}]}
               for i in range(60)]  # fmt: skip
    _write_jsonl(tmp_path / "chat" / "train.jsonl", answers)
    common = ["model=gpt", "model.block_size=160", "model.n_layer=1", "model.n_head=2",
              "model.n_embd=32", "model.dropout=0", "task=language_model", "dataset=chat",
              f"dataset.root={tmp_path / 'chat'}", "optimizer=sgd", "optimizer.lr=0.5",
              "optimizer.momentum=0", "trainer.max_steps=4",
              "checkpoint.enabled=false"]  # fmt: skip
    run_here(tmp_path / "one", *common, "trainer.batch_size=8")
    run_here(tmp_path / "two", *common, "trainer.batch_size=4", "trainer.grad_accum_steps=2")
    assert max_abs_diff(load_weights(tmp_path / "one"), load_weights(tmp_path / "two")) < 1e-6


def test_a_pipeline_of_chat_data_is_one_line(tmp_path: Path) -> None:
    from dpt.launch.validate import validate
    from tests.helpers import compose

    _write_jsonl(tmp_path / "chat.jsonl", ROWS)
    cfg = compose("model=gpt", "model.block_size=160", "task=language_model", "dataset=chat",
                  f"dataset.root={tmp_path / 'chat.jsonl'}", "strategy=pipeline")  # fmt: skip
    with pytest.raises(Exception) as error:
        validate(cfg)
    assert str(error.value) == (
        "strategy=pipeline: dataset=chat is not trained in pipeline stages yet (its loss weighs "
        "answer tokens across micro-batches, its packed windows carry positions); use ddp or fsdp"
    )


def test_a_template_that_leaves_no_answer_is_one_line(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "chat.jsonl", ROWS)
    users_only = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}"
                  "{% endif %}{% endfor %}")  # fmt: skip
    with pytest.raises(DptError) as error:
        chat_data(path, chat_template=users_only)
    assert str(error.value) == (
        f"dataset.root={path}: row 1: its text holds no answer (an assistant turn's text, or the "
        "response) to train on: check the row, or the template (dataset.chat_template, "
        "dataset.template)"
    )


def test_a_file_alone_validates_on_its_last_rows(tmp_path: Path) -> None:
    data = chat_data(_write_jsonl(tmp_path / "chat.jsonl", ROWS), packing=False, val_fraction=0.5)
    assert len(data.train) == len(data.val) == 3
    _, targets = data.val[0]
    answer = ROWS[3]["messages"][1]["content"] + CHATML_ANSWER_END  # the fourth of six
    assert bytes(targets[targets != IGNORE_INDEX].tolist()).decode() == answer


def _with_special_tokens(llama: Path, folder: Path) -> Path:
    """The llama's folder with a tokenizer as real ones are: a BOS put before every text it
    encodes, and `<|im_end|>` one special token."""
    import shutil

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    shutil.copytree(llama, folder)
    tokenizer = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens(["<s>", "<|im_end|>"])
    tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_a_tokenizer_adding_a_bos_adds_none_inside_a_conversation(
    tmp_path: Path, llama: Path
) -> None:
    folder = _with_special_tokens(llama, tmp_path / "bos")
    data = chat_data(_write_jsonl(tmp_path / "chat.jsonl", ROWS[:2]), False, str(folder))
    bos = data.tokenizer.impl.token_to_id("<s>")
    for i in range(2):
        inputs, targets = data.train[i]
        assert bos not in inputs.tolist() and bos not in targets.tolist()
        scored = targets[targets != IGNORE_INDEX].tolist()
        assert data.tokenizer.decode(scored) == ROWS[i]["messages"][1]["content"] + "\n"


def test_a_template_refusing_a_row_is_one_line(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "chat.jsonl", [ROWS[0], {"messages": ROWS[1]["messages"][1:]}])
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations start "
                "with the user') }}{% endif %}{% for m in messages %}{{ m['content'] }}\n"
                "{% endfor %}")  # fmt: skip
    with pytest.raises(DptError) as error:
        chat_data(path, chat_template=template)
    assert str(error.value) == (
        f"dataset.root={path}: row 2: the chat template fails on it (Conversations start with "
        "the user)"
    )


def test_templates_render_as_transformers_renders_them(llama: Path) -> None:
    from transformers import AutoTokenizer

    template = (
        "{{ bos_token }}{{ strftime_now('%Y') | length }}{% for m in messages %}"
        "{% if loop.index > 3 %}{% break %}{% endif %}{{ m | tojson }}"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% endif %}\n{% endfor %}"
    )
    messages = [
        {"role": role, "content": text}
        for role, text in (
            ("user", "<a & b>"),
            ("assistant", "é"),
            ("user", "x"),
            ("assistant", "y"),
        )
    ]
    tokenizer = AutoTokenizer.from_pretrained(llama)
    expected = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert ChatFormat(template=template, bos_token=tokenizer.bos_token or "").render(messages) == (
        expected
    )


def test_dpt_generate_stops_at_a_special_end_of_turn(
    tmp_path: Path, llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dpt.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(_with_special_tokens(llama, tmp_path / "special")))
    fmt = ChatFormat()  # ChatML: its end of turn, <|im_end|>, one special token
    seen: list[list[int]] = []

    def answer(predictor, ids, *rest):
        seen.append(ids)
        yield from tokenizer.encode("042<|im_end|>\nmore", special=False)

    monkeypatch.setattr(generate, "sample", answer)
    args = argparse.Namespace(seed=0, max_new_tokens=40, temperature=0, top_k=None, stop=fmt.stop())
    prompt = fmt.generation_prompt("07+35=")
    assert generate.complete(None, tokenizer, prompt, args, chat=True) == "042"
    assert seen[0] == tokenizer.encode(prompt, special=False)  # no BOS before the template's text
