"""Language models in process: the GPT's shape, FLOPs count and blocks, the text data set (its
windows, its token cache, its tokenizers), the language-model task, tokens/s and MFU, and the
one-line errors of bad text, tokenizers and vocabularies."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from dpt.data.text import TextData, TokenWindows, text_files
from dpt.data.tokenizer import ByteTokenizer, load_tokenizer
from dpt.errors import ConfigError, DptError
from dpt.models import build_model
from dpt.models.blocks import blocks
from dpt.models.gpt import GPT
from dpt.observe.flops import Throughput, peak_tflops
from dpt.observe.metrics import throughput_text
from dpt.targets import Targets
from dpt.tasks import fit
from tests.helpers import compose

LINES = "".join(f"{a}+{b}={a + b}\n" for a in range(30) for b in range(30))


def _gpt(**sizes: int) -> GPT:
    shape = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8} | sizes
    return GPT(num_outputs=40, dropout=0.0, bias=True, **shape)


# --- the model ------------------------------------------------------------------------------------


def test_the_gpt_maps_token_ids_to_next_token_logits_with_tied_embeddings() -> None:
    model = _gpt()
    logits = model(torch.randint(0, 40, (3, 8)))
    assert logits.shape == (3, 8, 40)
    assert model.lm_head.weight is model.wte.weight
    assert blocks(model) == list(model.h) and len(model.h) == 2
    with pytest.raises(
        DptError, match=r"^a sequence of 9 tokens is longer than model.block_size=8$"
    ):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_its_attention_is_causal() -> None:
    """A later token changes no earlier position's logits."""
    model = _gpt().eval()
    ids = torch.randint(0, 40, (1, 8))
    changed = ids.clone()
    changed[0, 5] = (ids[0, 5] + 1) % 40
    a, b = model(ids), model(changed)
    assert torch.equal(a[0, :5], b[0, :5]) and not torch.allclose(a[0, 5:], b[0, 5:])


def test_the_flops_count_is_the_palm_appendix_count_by_hand() -> None:
    """6N + 12 L H Q T for L=2 layers, H=2 heads of Q=8, T=8, d=16, V=40, with biases."""
    model = _gpt()
    d, v, layers = 16, 40, 2
    per_block = (2 * d) + (3 * d * d + 3 * d) + (d * d + d) + (2 * d) + (4 * d * d + 4 * d) + (
        4 * d * d + d)  # fmt: skip
    n = v * d + layers * per_block + 2 * d  # token embedding (tied head), blocks, final norm
    assert model.num_params() == n
    assert model.flops_per_token(8) == 6 * n + 12 * layers * 2 * 8 * 8


def test_mfu_is_the_flops_over_the_devices_peak() -> None:
    counted = Throughput(tokens_per_sample=8, flops_per_token=1e9, peak_flops=1e12)
    found = counted.scalars(samples_per_s=50.0, devices=2)  # 400 tokens/s over 2 devices
    assert found == {"train/tokens_per_s": 400.0, "perf/mfu": pytest.approx(400 * 1e9 / 2e12)}
    cpu = Throughput(8, 1e9, None).scalars(50.0)
    assert cpu == {"train/tokens_per_s": 400.0, "perf/tflops": pytest.approx(0.4)}
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16-mixed", None) == 989.4
    assert peak_tflops("NVIDIA A100-SXM4-40GB", "32", None) == 156.0
    assert peak_tflops("NVIDIA GeForce RTX 4090", "bf16-mixed", None) is None
    assert peak_tflops("NVIDIA GeForce RTX 4090", "bf16-mixed", 165.0) == 165.0


def test_the_console_line_shows_tokens_and_mfu_to_a_slivers_digits() -> None:
    line = throughput_text({"train/tokens_per_s": 51_200.0, "perf/mfu": 0.385})
    assert line == " | 51,200 tokens/s | MFU 38.5%"
    # The tiny GPT on an H200: 30,000 tokens/s of 0.5 MFLOP each, 0.0015 % of its peak.
    assert throughput_text({"perf/mfu": 1.5e-5}) == " | MFU 0.0015%"
    assert throughput_text({"perf/tflops": 0.05213}) == " | 0.0521 TFLOP/s"


@pytest.mark.slow  # torch.compile: seconds
@pytest.mark.timeout(240)
def test_recomputed_blocks_compile_to_the_same_gradients() -> None:
    """model.activation_checkpointing with trainer.compile (experiment=gpt2_small): torch.compile
    refuses the contexts that keep BatchNorm's statistics in eager recomputation, so a compiled
    model's blocks are wrapped without them (the old wrapper fails here, as it did on an H200).
    Compiled with aot_eager: dynamo and AOT autograd, where the refusal comes from (the old
    wrapper fails under it too), without inductor's C++ build of the kernels (30 s on 2 cores;
    the GPU machine ran this test under inductor)."""
    torch.manual_seed(0)
    shape = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8, "dropout": 0.0}
    node = OmegaConf.create(
        {"_target_": "dpt.models.gpt.GPT", "bias": True, "activation_checkpointing": True} | shape
    )
    recomputed = build_model(node, (8,), 40, compiled=True)
    plain = _gpt()
    plain.load_state_dict(recomputed.state_dict())
    ids = torch.randint(0, 40, (4, 8))
    for model in (torch.compile(recomputed, backend="aot_eager"), plain):
        model(ids).logsumexp(-1).sum().backward()
    for a, b in zip(recomputed.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)


# --- text, tokens, windows ------------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "text"
    (root / "val").mkdir(parents=True)
    (root / "b.txt").write_text(LINES[len(LINES) // 2 :])
    (root / "a.txt").write_text(LINES[: len(LINES) // 2])
    (root / "val" / "v.txt").write_text("1+2=3\n" * 20)
    (root / ".hidden.txt").write_text("not read")
    return root


def test_a_folders_texts_in_order_and_its_val_folder(corpus: Path) -> None:
    train, val = text_files(corpus)
    assert [p.name for p in train] == ["a.txt", "b.txt"] and [p.name for p in val] == ["v.txt"]


def test_windows_are_the_next_token_one_later_and_cached_once(corpus: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    data = TextData(str(corpus), None, block_size=8, val_fraction=0.1, cache_dir=str(cache),
                    num_workers=0, seed=0)  # fmt: skip
    ids = np.frombuffer(LINES.encode(), dtype=np.uint8).astype(np.int64)
    assert len(data.train) == (len(ids) - 1) // 8
    x, y = data.train[3]
    assert torch.equal(x, torch.from_numpy(ids[24:32])) and torch.equal(
        y, torch.from_numpy(ids[25:33])
    )
    assert data.val is not None and len(data.val) == (20 * 6 - 1) // 8  # val/ holds 120 bytes
    assert data.target_spec == Targets(True, (8,), 256) and data.input_dtype is torch.long
    batch = data.train.__getitems__([0, 3])  # one gather for a batch
    assert torch.equal(batch.inputs[1], x) and torch.equal(batch.labels[1], y)
    files = sorted(cache.iterdir())
    again = TextData(str(corpus), None, 8, 0.1, str(cache), 0, 0)  # the same text: the same files
    assert sorted(cache.iterdir()) == files and len(again.train) == len(data.train)
    (corpus / "b.txt").write_text("changed\n" * 100)
    TextData(str(corpus), None, 8, 0.1, str(cache), 0, 0)
    assert len(list(cache.glob("*.json"))) == 2  # another text: tokenized anew


def test_a_file_without_a_val_folder_holds_out_the_last_share(tmp_path: Path) -> None:
    text = tmp_path / "lines.txt"
    text.write_text(LINES)
    data = TextData(str(text), None, 8, 0.25, str(tmp_path / "cache"), 0, 0)
    total = len(LINES.encode())
    assert data.val is not None
    assert data.val.count == total - (total - int(total * 0.25))


def test_windows_pickle_for_loader_workers(corpus: Path, tmp_path: Path) -> None:
    import pickle

    data = TextData(str(corpus), None, 8, 0.1, str(tmp_path / "c"), 0, 0)
    copy = pickle.loads(pickle.dumps(data.train))
    assert isinstance(copy, TokenWindows) and torch.equal(copy[5][0], data.train[5][0])


def test_a_bpe_trained_by_dpt_tokenizer_round_trips_and_names_its_file(
    corpus: Path, tmp_path: Path
) -> None:
    from dpt.commands.tokenizer import main

    out = tmp_path / "tok.json"
    main(["--text", str(corpus), "--vocab-size", "300", "--out", str(out)])
    tokenizer = load_tokenizer(str(out))
    assert tokenizer.vocab_size == 300
    ids = tokenizer.encode("12+34=46\n")
    assert len(ids) < 9 and tokenizer.decode(ids) == "12+34=46\n"
    assert tokenizer.describe() == {
        "kind": "tokenizers",
        "vocab_size": 300,
        "file": "tokenizer.json",
    }
    assert ByteTokenizer().decode(list("é".encode())[:1]) == "\ufffd"  # a cut character


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: (root / "t.txt").write_text(""),
         "dataset.root={root}/t.txt: the text is empty"),
        (lambda root: (root / "t.txt").write_text("short"),
         "dataset.root={root}/t.txt: the text has 5 tokens, shorter than one window of "
         "dataset.block_size + 1 = 9 tokens"),
        (lambda root: (root / "t.txt").write_text(LINES) and (root / "tok.json").write_text("{"),
         "dataset.tokenizer={root}/tok.json: not a tokenizers file (…"),
    ],
)  # fmt: skip
def test_bad_text_and_tokenizers_are_one_line(tmp_path: Path, make, message: str) -> None:
    make(tmp_path)
    tokenizer = str(tmp_path / "tok.json") if (tmp_path / "tok.json").exists() else None
    with pytest.raises(DptError) as caught:
        TextData(str(tmp_path / "t.txt"), tokenizer, 8, 0.0, str(tmp_path / "c"), 0, 0)
    expected = message.format(root=tmp_path)
    text = str(caught.value)
    assert text.startswith(expected[:-1]) if expected.endswith("…") else text == expected


def test_a_folder_of_other_files_reads_with_its_extensions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder of `.py` files: dataset=text and the text commands read it once told which
    extension (`dataset.extensions`, `--ext`); until then one line says what is there, each
    in the words of where it was asked."""
    from dpt.commands.shards import main as shards
    from dpt.commands.tokenizer import main as tokenizer

    code = tmp_path / "code"
    code.mkdir()
    (code / "a.py").write_text(LINES)
    (code / "val.py").write_text(LINES[:200])
    with pytest.raises(DptError) as caught:
        TextData(str(code), None, 8, 0.0, str(tmp_path / "c"), 0, 0)
    assert str(caught.value) == (
        f"dataset.root={code}: no .txt file here; it holds .py files: "
        "dataset.extensions=[.py] reads those"
    )
    data = TextData(str(code), None, 8, 0.0, str(tmp_path / "c"), 0, 0, extensions=[".py"])
    assert data.val is not None and len(data.val) == (200 - 1) // 8  # val.py: 200 bytes
    out = tmp_path / "tok.json"
    for command, args, said in (
        (tokenizer, ["--vocab-size", "300", "--out", str(out)],
         f"--text {code}: no .txt file here; it holds .py files: --ext .py reads those"),
        (shards, ["--block-size", "8", "--out", str(tmp_path / "s"), "--tokenizer", "bad.json"],
         f"--text {code}: no .txt file here; it holds .py files: --ext .py reads those"),
        (shards, ["--block-size", "8", "--out", str(tmp_path / "s"), "--tokenizer", "bad.json",
                  "--ext", "py"],
         "--tokenizer bad.json: file not found (or `bytes`)"),
    ):  # fmt: skip
        with pytest.raises(SystemExit):
            command(["--text", str(code), *args])
        assert capsys.readouterr().err.strip() == f"Error: {said}"
    tokenizer(["--text", str(code), "--ext", ".py", "--vocab-size", "300", "--out", str(out)])
    assert load_tokenizer(str(out)).vocab_size == 300


# --- the task -------------------------------------------------------------------------------------


def test_the_task_is_next_token_cross_entropy_and_perplexity() -> None:
    from dpt.tasks.task import build_task

    cfg = compose("task=language_model")
    task = build_task(cfg.task, Targets(True, (8,), 40), 40, [])
    outputs, targets = torch.randn(3, 8, 40), torch.randint(0, 40, (3, 8))
    expected = nn.functional.cross_entropy(outputs.reshape(-1, 40), targets.reshape(-1))
    assert torch.allclose(task.loss(outputs, targets), expected)
    assert torch.allclose(task.sample_losses(outputs, targets).mean(), expected)
    metrics = task.metrics()
    task.update(metrics, outputs, targets)
    assert float(metrics["perplexity"].compute()) == pytest.approx(float(expected.exp()), rel=1e-5)
    assert task.tokens_per_sample == 8


@pytest.mark.parametrize(
    ("targets", "output", "message"),
    [
        (Targets.labels(10), None, "task=language_model takes token ids (B, T): the data set's "
         "targets are integer class labels (B,); use dataset=text, or a data set of windows of "
         "token ids"),
        (Targets(True, (8,), 300), (8, 256), "task=language_model: the vocabulary has 300 tokens, "
         "more than the model's 256 outputs per position (model.vocab_size=256: raise it, or "
         "null for the data's)"),
        (Targets(True, (8,), 300), (300,), "task=language_model takes logits (B, T, V) for token "
         "ids (B, T): the model's output is (B, 300), the target integer (B, 8)"),
    ],
)  # fmt: skip
def test_a_language_model_that_cannot_train_is_one_line(
    targets: Targets, output: tuple[int, ...] | None, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        fit.check("language_model", targets, output, targets.classes or 1)
    assert str(caught.value) == message


def test_the_config_of_a_language_model() -> None:
    cfg = compose("experiment=gpt_tiny", "dataset.root=/nowhere")
    assert cfg.dataset.block_size == cfg.model.block_size == 32
    assert cfg.trainer.early_stopping.metric == "val/loss"
    data = json.loads(json.dumps(dict(cfg.task)))
    assert data["_target_"] == "dpt.tasks.language_model.LanguageModel"
