"""Section `baseline` (not run by default): this checkout's dpt against another commit's, side by
side, on the workloads of section `loops`.

`--baseline REV` (any git revision) is checked out in a temporary `git worktree` (removed
afterwards, also on failure), and for every workload of benchmarks/loops.py (`--models`,
`--quick`, `--smoke`) dpt at REV and dpt of this checkout (its working tree, uncommitted changes
included) run as a pair, single and ddp at every `--world-sizes`, alternated round by round
(`run_rounds`) exactly as section `loops` pairs the plain loop and dpt. REV's runs start the
worktree's `train.py` in the worktree, with the worktree first on PYTHONPATH
(`benchmarks.jobs.checkout_env` says why); before the rounds, a probe checks that the package
imported there is the worktree's. Report: benchmarks/report/baseline.py, between its own markers,
so `--sections baseline` leaves the rest of the report as it was.

    python -m benchmarks --sections baseline --baseline 265ee25 --rounds 5
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.jobs import Job, checkout_env, child_env, run_rounds
from benchmarks.loops import loop_ratio_row, workloads
from benchmarks.runner import REPO, RunError, Say

WORKTREE = "baseline"  # the worktree's folder in the run's temporary folder
CODE = ("dpt", "hydra_plugins")  # with train.py: what a dpt run imports or starts


def git(*args: str, cwd: Path = REPO) -> str:
    """A git command's output (stripped); a failure raises RunError with git's own message."""
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        message = (done.stderr or done.stdout).strip().splitlines()
        raise RunError(
            f"git {' '.join(args)} failed: {message[-1] if message else done.returncode}"
        )
    return done.stdout.strip()


def resolve(rev: str) -> str:
    """`rev`'s full commit hash; RunError if it names no commit of this repository."""
    return git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")


def run(args: argparse.Namespace, tmp: Path, say: Say) -> dict[str, Any]:
    """The pairs (dpt at `args.baseline`, dpt of this checkout) of every workload and strategy."""
    if not args.baseline:
        raise SystemExit("error: --sections baseline needs --baseline REV (a git revision)")
    started, load_before = time.time(), os.getloadavg()
    commit = resolve(args.baseline)
    head_hash, head_subject = git("log", "-1", "--format=%H%x00%s").split("\0", 1)
    changed = git("status", "--porcelain", "--untracked-files=all").splitlines()
    code = [line[3:] for line in changed if _is_code(line[3:])]
    fingerprint = code_fingerprint()
    tree = tmp / WORKTREE
    git("worktree", "add", "--detach", str(tree), commit)
    try:
        say(f"  {args.baseline} checked out in {tree}")
        measured = _measure(args, tmp, tree, say)
        base_hash, base_subject = git("log", "-1", "--format=%H%x00%s", cwd=tree).split("\0", 1)
    finally:
        _remove(tree)
    head_end = git("rev-parse", "HEAD")
    code_changed = code_fingerprint() != fingerprint
    if code_changed:
        say("  dpt's code in this checkout changed while the section ran (said in the report)")
    return {"baseline": {
        **measured,
        "rev": args.baseline,
        "short": base_hash[:7],
        "hash": base_hash,
        "subject": base_subject,
        "head": head_hash,
        "head_subject": head_subject,
        "head_end": head_end,  # HEAD once the runs were done (a commit made meanwhile)
        "uncommitted_code": code,  # dpt's files that differ from HEAD: the runs include them
        "uncommitted_other": len(changed) - len(code),  # not run by dpt (benchmarks, docs, ...)
        "code_changed": code_changed,  # dpt's code edited while the section ran
        "quick": args.quick,
        "smoke": args.smoke,
        "rounds": args.rounds,
        "models": args.models,
        "worlds": [] if args.smoke else list(args.worlds),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "duration_s": time.time() - started,
        "load": (load_before, os.getloadavg()),
    }}  # fmt: skip


def _is_code(path: str) -> bool:
    """Whether a path of the repo is part of what a dpt run imports or starts."""
    return path == "train.py" or path.split("/", 1)[0] in CODE


def code_fingerprint(root: Path = REPO) -> str:
    """A digest of dpt's sources and configs in `root` as they stand on disk (committed or not):
    the same before and after the rounds, or someone edited the code the runs measured."""
    digest = hashlib.sha1()
    files = [root / "train.py", *(f for d in CODE for f in (root / d).rglob("*"))]
    for path in sorted(files):
        if path.suffix in (".py", ".yaml") and path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _remove(tree: Path) -> None:
    """The worktree and git's record of it, whatever happened (a failure here is only said)."""
    for command in (("worktree", "remove", "--force", str(tree)), ("worktree", "prune")):
        try:
            git(*command)
        except RunError as error:
            print(f"  {error}", file=sys.stderr)


def _measure(args: argparse.Namespace, tmp: Path, tree: Path, say: Say) -> dict[str, Any]:
    rev = git("rev-parse", "--short=7", "HEAD", cwd=tree)
    imported = {"base": _imported_dpt(tree), "this": _imported_dpt(None)}
    for name, (checkout, path) in {"base": (tree, imported["base"]),
                                   "this": (REPO, imported["this"])}.items():  # fmt: skip
        if not Path(path).resolve().is_relative_to(checkout.resolve()):
            raise RunError(f"the {name} runs would import dpt from {path}, not from {checkout}")
    say(f"  dpt@{rev} imports {imported['base']}; this checkout's, {imported['this']}")
    models = args.models.split(",")
    works = [w for w in workloads(args.quick, args.device, args.smoke) if w.model in models]
    worlds = [] if args.smoke else args.worlds
    plans = []
    for work in works:
        strategies = [("single", 1), *(("ddp", n) for n in worlds)]
        plans += [
            (Job("dpt", s, n, work, checkout=tree, rev=rev), Job("dpt", s, n, work))
            for s, n in strategies
        ]
    env = child_env(args, args.device)
    results = run_rounds(plans, args.rounds, tmp / "baseline-runs", env, say, args.retried)
    rows = []
    for base, this in plans:
        row = loop_ratio_row(results, base, this)  # its "plain" is REV's dpt, its "dpt" ours
        rows.append({**row, "base": row.pop("plain"), "this": row.pop("dpt")})
    return {"rows": rows, "workloads": works, "imported": imported}


def _imported_dpt(checkout: Path | None) -> str:
    """Where `import dpt` finds the package in a process started as the runs of `checkout`
    (None: this one) start theirs: in that folder, with that environment. `python -c`, as
    multiprocessing starts the forkserver that ddp's ranks fork from: its sys.path begins with
    the working directory, not with an entry script's folder."""
    env = {**os.environ} | (checkout_env(checkout) if checkout is not None else {})
    done = subprocess.run(
        [sys.executable, "-c", "import dpt; print(dpt.__file__)"],
        cwd=checkout or REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RunError(f"import dpt failed in {checkout or REPO}:\n{done.stderr[-2000:]}")
    return done.stdout.strip()
