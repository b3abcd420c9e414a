"""`dataset=chat`: instruction or chat rows (JSON lines, Parquet, CSV; read with the `datasets`
library from local files only) as windows of token ids whose targets are the answers alone.

- `dataset.root`: a file (its last `dataset.val_fraction` of rows validate), or a folder with
  `train.<ext>` and `val.<ext>`, and `test.<ext>` for dpt-evaluate (read only when asked for).
- Each row becomes tokens and which of them are answer tokens (dpt/data/conversations.py); a
  target outside the answers is IGNORE_INDEX, which task=language_model leaves out of its loss
  and perplexity. A row longer than `block_size + 1` tokens is cut (said once); one whose
  window keeps no answer token is refused in one line.
- Packing (`dataset.packing=true`): examples in file order fill windows of `block_size`
  positions, none split or crossing windows, the rest padded. A sample is then (2, block_size):
  the token ids and each example's positions from 0, from which the model keeps attention within
  each example (dpt/models/gpt.py, dpt/models/hf.py). `packing=false`: one example a window.
- The windows are the same on every rank and world size; dpt's samplers order them (a resume
  reads the same examples).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dpt.data.conversations import ChatFormat, folder_format, segments
from dpt.data.loaders import StackedBatch
from dpt.data.row_files import missing_split_file, read_rows, test_rows
from dpt.data.tokenizer import Tokenizer, load_tokenizer
from dpt.errors import DptError
from dpt.loggers import ONCE_LOGGER_NAME
from dpt.targets import IGNORE_INDEX, Targets

once = logging.getLogger(ONCE_LOGGER_NAME)  # what every rank says alike: rank 0 says it

PAD_ID = 0  # the padding's token id (its targets are ignored, its attention its own)


class ChatData:
    """What dpt.contract.DataModule asks, for a language model on chat rows."""

    def __init__(
        self,
        root: str,
        tokenizer: str | None,
        block_size: int,
        packing: bool,
        template: dict[str, str] | None,
        chat_template: str | None,
        val_fraction: float,
        num_workers: int,
        seed: int,
    ) -> None:
        self.tokenizer = load_tokenizer(tokenizer)
        self.chat_format = chat_format(tokenizer, template, chat_template)
        train_rows, val_rows = read_rows(Path(root), val_fraction)
        made = [Examples(rows, self.tokenizer, self.chat_format, block_size)
                for rows in (train_rows, val_rows)]  # fmt: skip
        self.train = ChatWindows(made[0], block_size, packing)
        self.val = ChatWindows(made[1], block_size, packing) if val_rows else None
        self.input_shape: tuple[int, ...] = (2, block_size) if packing else (block_size,)
        self.input_dtype = torch.long  # token ids (and positions)
        self.num_classes = self.tokenizer.vocab_size
        self.target_spec = Targets(integer=True, shape=(block_size,), classes=self.num_classes)
        self.num_workers = num_workers
        # Its targets leave the prompts out: the loss is weighed by the answers' tokens per
        # micro-batch and rank (dpt.loop.trainer.Trainer.scored_shares).
        self.masks_targets = True
        self.root, self.block_size, self.packing = Path(root), block_size, packing  # for `test`
        cut = made[0].cut + made[1].cut
        if cut:
            once.warning(f"chat: {cut} example(s) longer than model.block_size={block_size} + 1 "
                         "tokens were cut at the end")  # fmt: skip
        once.info(f"chat: {len(train_rows):,} training examples in {len(self.train):,} windows "
                  f"of {block_size} ({'packed' if packing else 'one example each'}), "
                  f"{made[0].answer_tokens:,} answer tokens; {len(val_rows):,} validation "
                  "examples")  # fmt: skip

    @functools.cached_property
    def test(self) -> ChatWindows | None:
        """A folder's `test.<ext>` rows as windows; None where it has none (or root is a file)."""
        rows = test_rows(self.root)
        if rows is None:
            return None
        examples = Examples(rows, self.tokenizer, self.chat_format, self.block_size)
        return ChatWindows(examples, self.block_size, self.packing)

    def missing_split(self, split: str) -> str:
        """Why there is no `split` (dpt.data.splits), naming the split files there are."""
        return missing_split_file(self.root, split, "chat")


def chat_format(
    tokenizer: str | None, template: dict[str, str] | None, chat_template: str | None
) -> ChatFormat:
    """`dataset.template` (prompt and response rows), else the chat template: dataset's, the
    model folder's, or ChatML; the folder's special tokens either way."""
    found = folder_format(tokenizer) or ChatFormat()
    if template:
        if "{prompt}" not in template.get("prompt", "") or "{response}" not in template.get(
            "response", ""
        ):
            raise DptError("dataset.template: needs a prompt holding {prompt} and a response "
                           "holding {response}")  # fmt: skip
        return ChatFormat(prompt=template["prompt"], response=template["response"],
                          bos_token=found.bos_token, eos_token=found.eos_token)  # fmt: skip
    return ChatFormat(template=chat_template or found.template, bos_token=found.bos_token,
                      eos_token=found.eos_token)  # fmt: skip


class Examples:
    """Rows as token ids: each example's inputs and targets (IGNORE_INDEX outside answers),
    one after another in flat arrays, with their offsets."""

    def __init__(
        self,
        rows: Sequence[tuple[str, dict[str, Any]]],
        tokenizer: Tokenizer,
        fmt: ChatFormat,
        block_size: int,
    ) -> None:
        inputs, targets, lengths, self.cut = [], [], [], 0
        for where, row in rows:
            ids, answer = _tokens(segments(fmt, row, where), tokenizer)
            if not answer[1:].any():
                raise DptError(f"{where}: its text holds no answer (an assistant turn's text, or "
                               "the response) to train on: check the row, or the template "
                               "(dataset.chat_template, dataset.template)")  # fmt: skip
            row_tokens, row_answer = len(ids), int(answer.sum())  # before any cut
            if len(ids) > block_size + 1:
                ids, answer, self.cut = (
                    ids[: block_size + 1],
                    answer[: block_size + 1],
                    self.cut + 1,
                )
            scored = np.where(answer[1:], ids[1:], IGNORE_INDEX)
            if not (scored != IGNORE_INDEX).any():
                raise DptError(
                    f"{where}: no answer token within model.block_size={block_size} tokens (the "
                    f"row has {row_tokens} tokens, its answer {row_answer}): raise "
                    "model.block_size, or shorten the prompt"
                )
            inputs.append(ids[:-1])
            targets.append(scored)
            lengths.append(len(ids) - 1)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.inputs = np.concatenate(inputs) if inputs else np.zeros(0, np.int64)
        self.targets = np.concatenate(targets) if targets else np.zeros(0, np.int64)
        self.answer_tokens = int((self.targets != IGNORE_INDEX).sum())


def _tokens(pieces: list[tuple[str, bool]], tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Each piece tokenized on its own: ids, and which are the answer's. No special tokens
    added: a tokenizer that puts a BOS before a text would put one before every piece (and the
    template writes its own)."""
    ids, answer = [], []
    for text, is_answer in pieces:
        encoded = tokenizer.encode(text, special=False)
        ids += encoded
        answer += [is_answer] * len(encoded)
    return np.asarray(ids, dtype=np.int64), np.asarray(answer, dtype=bool)


def pack(lengths: np.ndarray, block_size: int, packing: bool) -> list[tuple[int, int]]:
    """Windows as ranges of examples [first, last): in order, as many whole examples as fit
    in `block_size` positions (one each without packing)."""
    if not packing:
        return [(i, i + 1) for i in range(len(lengths))]
    windows, first, used = [], 0, 0
    for i, length in enumerate(lengths):
        if used + length > block_size and i > first:
            windows.append((first, i))
            first, used = i, 0
        used += int(length)
    if len(lengths):
        windows.append((first, len(lengths)))
    return windows


class ChatWindows(Dataset):
    """Windows of `block_size` positions: item i is (inputs, targets) as int64, inputs the
    token ids (block_size,), or with packing the ids and positions (2, block_size)."""

    def __init__(self, examples: Examples, block_size: int, packing: bool) -> None:
        self.examples, self.block_size, self.packing = examples, block_size, packing
        self.windows = pack(examples.lengths, block_size, packing)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.__getitems__([index])
        return batch.inputs[0], batch.labels[0]

    def __getitems__(self, indices: Sequence[int]) -> StackedBatch:
        made = [self._window(i) for i in indices]
        inputs = torch.from_numpy(np.stack([m[0] for m in made]))
        return StackedBatch(inputs, torch.from_numpy(np.stack([m[1] for m in made])))

    def _window(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        first, last = self.windows[index]
        ex = self.examples
        start, end = ex.offsets[first], ex.offsets[last]
        pad = self.block_size - (end - start)
        ids = np.concatenate([ex.inputs[start:end], np.full(pad, PAD_ID, np.int64)])
        targets = np.concatenate([ex.targets[start:end], np.full(pad, IGNORE_INDEX, np.int64)])
        if not self.packing:
            return ids, targets
        positions = [np.arange(n) for n in ex.lengths[first:last]] + [np.arange(pad)]
        return np.stack([ids, np.concatenate(positions)]), targets
