"""The `dpt-generate` command: text from a language model's run (`task=language_model`).

`dpt-generate RUN_DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K]
[--seed S] [--stop TEXT] [--prompts FILE] [--last]` rebuilds the run's model (as dpt-predict
does: dpt/commands/run_model.py), loads `model_best.pt` (or `model.pt`), encodes the prompt with
the run's tokenizer (data.json; a tokenizers file is kept in the run folder) and samples one token
at a time: the last position's logits divided by the temperature, the `top-k` most likely kept,
drawn from a generator seeded with `--seed` (temperature 0: the most likely token, no draw). The
context is the last `model.block_size` tokens. On a terminal the text is printed as it comes;
otherwise once, at the end. `--stop TEXT` ends a completion where TEXT appears (left out).
`--prompts FILE`: one prompt a line, one completion a line (a newline in it written as `\\n`).

A run of chat data (dataset=chat: its folder keeps chat_format.json) is asked as it trained: the
prompt is the user's turn in the run's chat template (or prompt template), up to where the answer
starts, the end of an answer stops it (`--stop` where given), and the answer alone is printed.
`--raw` sends the prompt as given.

torch is imported only after the arguments are parsed: `--help` and bad arguments answer fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dpt import user_code
from dpt.commands.command import run_command
from dpt.config.tasks import LANGUAGE_MODEL
from dpt.errors import DptError
from dpt.state.results import RunData, read_run_data

if TYPE_CHECKING:
    import torch

    from dpt.commands.run_model import Predictor
    from dpt.data.conversations import ChatFormat
    from dpt.data.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what a cut multi-byte character decodes to, until its last byte comes


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dpt-generate", description="Sample text from a language model's run (dpt)."
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (holds data.json)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the text to continue")
    source.add_argument("--prompts", metavar="FILE", help="one prompt a line: one completion each")
    parser.add_argument(
        "--max-new-tokens", type=int, default=100, metavar="N",
        help="tokens to sample at most (default 100)",
    )  # fmt: skip
    parser.add_argument(
        "--temperature", type=float, default=1.0, metavar="T",
        help="<1 sharper, >1 flatter; 0: always the most likely (default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--top-k", type=int, default=None, metavar="K",
        help="draw among the K most likely tokens only (default: all)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="the draws' seed (0)")
    parser.add_argument(
        "--stop", metavar="TEXT", default=None,
        help="end a completion where TEXT appears, e.g. a newline: $'\\n'",
    )  # fmt: skip
    parser.add_argument(
        "--last", action="store_true", help="use model.pt (the last epoch), not model_best.pt"
    )
    parser.add_argument(
        "--raw", action="store_true",
        help="a chat run: the prompt as given, not as the user's turn in its chat template",
    )  # fmt: skip
    return parser.parse_args(argv)


def _check(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise DptError(f"--max-new-tokens {args.max_new_tokens}: must be 1 or more")
    if args.temperature < 0:
        raise DptError(f"--temperature {args.temperature}: must be 0 or more")
    if args.top_k is not None and args.top_k < 1:
        raise DptError(f"--top-k {args.top_k}: must be 1 or more")


def language_model_run(run_dir: Path) -> RunData:
    """The run's data.json, refused in one line where the run is not a language model's."""
    from dpt.commands.run_model import run_folder

    data = read_run_data(run_folder(run_dir))
    if data.task != LANGUAGE_MODEL or data.tokenizer is None:
        raise DptError(
            f"{run_dir} is a run of task={data.task}, not a language model's: dpt-generate "
            "samples from runs of task=language_model (dpt-predict serves the others)"
        )
    return data


def sample(
    predictor: Predictor,
    ids: list[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator,
    vocabulary: int,
) -> Iterator[int]:
    """Token after token: each drawn from the model's next-token distribution given the last
    `block_size` tokens (the model waits for the device at each token: one at a time), over
    the tokenizer's `vocabulary` ids (a model may have more outputs: a vocabulary padded to a
    multiple, a fresh config's default; no text has those ids)."""
    import torch

    block_size = int(getattr(predictor.model, "block_size", len(ids) + max_new_tokens))
    context = torch.tensor([ids], dtype=torch.long, device=predictor.device)
    for _ in range(max_new_tokens):
        with torch.no_grad(), predictor.autocast():
            logits = predictor.model(context[:, -block_size:])[0, -1, :vocabulary].float()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None:
                kept = torch.topk(logits, min(top_k, logits.numel()))
                logits = torch.full_like(logits, float("-inf")).scatter(0, kept.indices,
                                                                        kept.values)  # fmt: skip
            probabilities = torch.softmax(logits, dim=0).cpu()
            token = int(torch.multinomial(probabilities, 1, generator=generator))
        yield token
        context = torch.cat([context, context.new_tensor([[token]])], dim=1)


def complete(
    predictor: Predictor,
    tokenizer: Tokenizer,
    prompt: str,
    args: argparse.Namespace,
    show: Callable[[str], None] | None = None,
    chat: bool = False,
) -> str:
    """The completion of `prompt` (without it), shown piece by piece through `show` as its text
    becomes final, cut at `--stop`. `chat`: a prompt rendered by a chat template, which writes
    its own special tokens (none added, as dataset=chat encodes), and an answer whose end may be
    one (`<|im_end|>`: decoded spelled out, or the stop would never be seen)."""
    import torch

    ids = tokenizer.encode(prompt, special=not chat)
    if not ids:
        raise DptError("--prompt: empty (the model needs at least one token to continue)")
    generator = torch.Generator().manual_seed(args.seed)
    new: list[int] = []
    shown = 0
    for token in sample(predictor, ids, args.max_new_tokens, args.temperature, args.top_k,
                        generator, tokenizer.vocab_size):  # fmt: skip
        new.append(token)
        text = tokenizer.decode(new, special=chat)
        if args.stop and args.stop in text:
            text = text[: text.index(args.stop)]
            break
        final = text.rstrip(REPLACEMENT)  # a character still waiting for its last bytes
        if show is not None and len(final) > shown:
            show(final[shown:])
            shown = len(final)
    else:
        text = tokenizer.decode(new, special=chat)
    if show is not None and len(text) > shown:
        show(text[shown:])
    return text


def run(args: argparse.Namespace) -> None:
    from dpt.commands.run_model import Predictor, run_tokenizer

    _check(args)
    run_dir = Path(args.run_dir)
    data = language_model_run(run_dir)  # the cheap checks before the model loads
    prompts = _prompts(args)
    tokenizer = run_tokenizer(run_dir, data)
    predictor = Predictor.from_run(run_dir, last=args.last)
    if predictor.notice:
        print(f"Note: {predictor.notice}", file=sys.stderr)
    chat = None if args.raw else run_chat_format(run_dir)
    if chat is not None:  # the user's turn in; the answer, to its end, out
        args = argparse.Namespace(**{**vars(args), "stop": args.stop or chat.stop()})
    live = sys.stdout.isatty() and args.prompt is not None
    for prompt in prompts:
        if chat is not None:
            answer = complete(predictor, tokenizer, chat.generation_prompt(prompt), args,
                              chat=True)  # fmt: skip
            print(answer.replace("\n", "\\n") if args.prompts else answer)
        elif live:
            print(prompt, end="", flush=True)
            complete(predictor, tokenizer, prompt, args, lambda s: print(s, end="", flush=True))
            print()
        else:
            text = complete(predictor, tokenizer, prompt, args)
            print(text.replace("\n", "\\n") if args.prompts else prompt + text)


def run_chat_format(run_dir: Path) -> ChatFormat | None:
    """How the run's chat data was made text (chat_format.json); None: not a chat run."""
    import json

    from dpt.data.conversations import ChatFormat
    from dpt.state.results import CHAT_FORMAT_FILE

    path = run_dir / CHAT_FORMAT_FILE
    return ChatFormat.of(json.loads(path.read_text())) if path.is_file() else None


def _prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    try:
        lines = Path(args.prompts).read_text().splitlines()
    except OSError as error:
        raise DptError(f"--prompts {args.prompts}: {error.strerror or error}") from error
    return [line for line in lines if line]


def main(argv: Sequence[str] | None = None) -> None:
    """`dpt-generate`: errors as one line on stderr (exit 1), never a traceback."""
    args = parse_args(argv)
    user_code.add_start_folder()  # a run's own model imports as under `dpt`
    run_command(lambda: run(args))


if __name__ == "__main__":
    main()
