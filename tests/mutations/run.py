"""Run the mutation check: apply each deliberate break to a copy of the tree and run the tests that
should catch it. A break is *killed* when those tests fail, *survived* when they pass (the suite has
a hole), *stale* when its code is no longer in the tree (update ``mutants.py``).

    python -m tests.mutations.run              # every mutant
    python -m tests.mutations.run --only drift_every_sample --keep

It needs what the tests need (NATS and Postgres as for the suite); each mutant runs the selected
tests in a fresh copy with ``PYTHONPATH`` pointing at it, so the working tree is never modified.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.mutations.mutants import MUTANTS, Mutant

REPO = Path(__file__).resolve().parents[2]


def tracked_files(repo: Path) -> list[str]:
    """Tracked files and untracked ones git does not ignore: what a clean checkout plus the change holds."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, check=True, capture_output=True
    ).stdout
    return [p for p in out.decode().split("\0") if p and (repo / p).is_file()]


def copy_tree(repo: Path, into: Path) -> None:
    for rel in tracked_files(repo):
        target = into / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, target)
    shared = repo.parent / "shared"  # the brief's handouts beside the checkout, read by some tests
    if shared.is_dir() and not (into.parent / "shared").exists():
        (into.parent / "shared").symlink_to(shared)


def apply(mutant: Mutant, root: Path) -> bool:
    """Apply the break; False when the code it names is not (exactly once) in the file."""
    path = root / mutant.file
    if not path.is_file():
        return False
    text = path.read_text()
    if text.count(mutant.find) != 1:
        return False
    path.write_text(text.replace(mutant.find, mutant.replace))
    return True


def run_one(mutant: Mutant, *, keep: bool, timeout_s: float) -> str:
    base = Path(tempfile.mkdtemp(prefix=f"hetsched-mutant-{mutant.name}-"))
    root = base / "main"
    try:
        copy_tree(REPO, root)
        if not apply(mutant, root):
            return "stale"
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutant.tests]
        try:
            result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return "killed (timeout)"
        if result.returncode == 0:
            return "SURVIVED"
        if result.returncode in (1,):
            return "killed"
        tail = "\n".join(result.stdout.splitlines()[-5:])
        return f"error (pytest exit {result.returncode}): {tail}"
    finally:
        if keep:
            print(f"  kept {root}")
        else:
            shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", help="run only this mutant (repeatable)")
    parser.add_argument("--keep", action="store_true", help="keep the mutated copies")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    outcomes: dict[str, str] = {}
    for mutant in chosen:
        started = time.monotonic()
        outcomes[mutant.name] = run_one(mutant, keep=args.keep, timeout_s=args.timeout)
        print(f"{mutant.name:<36} {outcomes[mutant.name]:<10} {time.monotonic() - started:6.1f} s  ({mutant.what})")
    killed = sum(1 for o in outcomes.values() if o.startswith("killed"))
    print(f"mutation score: {killed}/{len(outcomes)} killed")
    return 0 if killed == len(outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
