"""Rebuild the real-log corpus (docs/detection.md) from its sources, outside this repository.

The log files are public data from other repositories and are never committed here; the manifest
(tests/data/real_logs/manifest.json) names, per run, the repository, the commit, the path and how the
file was trimmed. This script takes each file at its pinned commit from a git clone of its repository,
trims it as the manifest's ``trimmed`` field says, and writes it under the manifest's ``file`` name:

- verl console logs: the header (commit, command, the override lines before the first Ray line), the
  printed config (the pprinted dict of the process that printed it) and the ``step:N - …`` lines, with
  their ``timing/*`` entries dropped; Ray/NCCL/vLLM chatter, validation samples and warnings dropped;
- a file that holds several runs: the line range the manifest's ``lines`` names (1-based, inclusive;
  null: to the end);
- every other file as it is; files whose name ends in ``.gz`` are gzipped (mtime 0, so reproducible).

    python bench/build_corpus.py OUT_DIR --clones DIR   # DIR/<owner>+<name>/ (bare or not, or a fetched
                                                        # mirror's <owner>+<name>/repo), else
                                                        # DIR/<owner>/<name>/; missing ones are cloned
                                                        # from GitHub into DIR/<owner>+<name>
    python bench/build_corpus.py OUT_DIR --clones DIR --part heldout   # one part only
    export RLVITALS_CORPUS_DIR=OUT_DIR                  # where bench/detection.py and the tests look

The clones may be bare mirrors (``git --git-dir``). CI never runs this (it cannot reach GitHub): it has the
tuning part's first 13 files and more/ in ../shared/real_logs. The more/ runs that were converted or
reconstructed from a console log (manifest ``rebuild`` says so) are not rebuilt; their raw source is pinned
and more/SOURCES.txt says how they were made. Exit status 1 if a run's file cannot be extracted.

    python bench/build_corpus.py --assign-split         # once: give every run without a part its part
                                                        # (bench/_detection.py assign_split, seeded)
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "tests" / "data" / "real_logs" / "manifest.json"

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_TAG = re.compile(r"^\s*\((?P<tag>[^()]*?pid=\d+[^()]*)\)\s?")
_STEP = re.compile(r"(?:^|\s)step:\d+\s+-\s+")
_CONFIG_ROW = re.compile(r"\s*(?:['\"{}\[\](),.:\d-]|(?:None|True|False)\s*[,}\]])")
_HEADER_END = ("libgomp", "[I", "20")  # the first Ray/c10d/logging line ends the header


def trim_verl(text: str) -> str:
    """What the manifest keeps of a verl console log (see the module docstring)."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines) and not lines[i].startswith(_HEADER_END) and not _TAG.match(_ANSI.sub("", lines[i])):
        out.append(lines[i])
        i += 1
    config_tag, in_config, depth = None, False, 0
    for line in lines[i:]:
        clean = _ANSI.sub("", line)
        tag = _TAG.match(clean)
        body = clean[tag.end() :] if tag else clean
        if config_tag is None and tag and body.lstrip().startswith("{'"):
            config_tag, in_config = tag.group("tag"), True
        if in_config:
            if tag is None or tag.group("tag") != config_tag:
                continue  # another process interleaved with the printed config
            if _CONFIG_ROW.match(body) and not _STEP.search(body):
                # a row of the pprinted dict (newer verl puts a long value on a row of its own: "None,",
                # "32,", "}}"), until its braces close or a line of prose starts
                out.append(line)
                depth += body.count("{") - body.count("}")
                in_config = depth > 0
                continue
            in_config = False
        if _STEP.search(body):
            out.append(
                " - ".join(item for item in line.split(" - ") if not item.strip().startswith("timing/"))
            )
    return "\n".join(out) + "\n"


def git_dir(clones: Path, repository: str) -> Path:
    owner, name = repository.split("/")
    for candidate in (clones / f"{owner}+{name}" / "repo", clones / f"{owner}+{name}", clones / owner / name):
        if (candidate / "HEAD").is_file():
            return candidate
        if (candidate / ".git").exists():
            return candidate / ".git"
    target = clones / f"{owner}+{name}"
    subprocess.run(["git", "clone", "--bare", f"https://github.com/{repository}", str(target)], check=True)
    return target


def build(out: Path, clones: Path, part: str | None = None) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    problems = []
    for run in json.loads(MANIFEST.read_text())["runs"]:
        if part is not None and run.get("split") != part:
            continue
        if run.get("rebuild", "raw") != "raw":
            print(f"{run['id']}: not rebuilt ({run['rebuild']})")
            continue
        source = run["source"]
        try:
            repository = git_dir(clones, source["repository"])
        except subprocess.CalledProcessError as exc:
            problems.append(f"{run['id']}: no clone of {source['repository']} ({exc})")
            continue
        done = subprocess.run(
            [
                "git",
                f"--git-dir={repository}",
                "show",
                f"{source['commit']}:{source['path']}",
            ],
            capture_output=True,
        )
        if done.returncode != 0:
            problems.append(f"{run['id']}: {done.stderr.decode(errors='replace').strip()}")
            continue
        data = done.stdout
        if run.get("lines"):  # a file holding several runs: the manifest names this run's lines
            first, last = run["lines"]
            data = b"".join(data.splitlines(keepends=True)[first - 1 : last])
        if run["format"] == "verl-console":
            data = trim_verl(data.decode("utf-8", "replace")).encode()
        target = out / run["file"]
        target.parent.mkdir(parents=True, exist_ok=True)
        if run["file"].endswith(".gz"):
            with gzip.GzipFile(target, "wb", mtime=0) as f:
                f.write(data)
        else:
            target.write_bytes(data)
        print(f"{run['id']}: {target} ({target.stat().st_size:,} bytes)")
    return problems


def assign_splits() -> dict[str, str]:
    """Write the split into the manifest for every run that has no part yet, once per ``batch`` (runs added
    together): a batch the manifest's ``heldout_batches`` names is held out whole, any other is drawn by the
    seeded rule (bench/_detection.py ``assign_split``); runs already in a part keep it. Returns the new
    assignments."""
    sys.path.insert(0, str(ROOT))
    from bench._detection import assign_split, split_record

    manifest = json.loads(MANIFEST.read_text())
    pending = [run for run in manifest["runs"] if not run.get("split")]
    whole = set(split_record("heldout_batches", manifest))
    split: dict[str, str] = {}
    for batch in sorted({run.get("batch", 0) for run in pending}):
        of_batch = [run for run in pending if run.get("batch", 0) == batch]
        if batch in whole:  # held out whole
            split.update({run["id"]: "heldout" for run in of_batch})
        else:
            split.update(assign_split(of_batch))
    for run in pending:
        run["split"] = split[run["id"]]
    MANIFEST.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    return split


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "out", type=Path, nargs="?", help="folder to write the corpus files into (outside the repo)"
    )
    parser.add_argument("--clones", type=Path, help="folder of git clones of the sources")
    parser.add_argument("--part", choices=("tuning", "heldout", "more"), help="build one part only")
    parser.add_argument(
        "--assign-split", action="store_true", help="assign parts to the runs without one, then exit"
    )
    args = parser.parse_args(argv)
    if args.assign_split:
        for rid, part in sorted(assign_splits().items(), key=lambda kv: (kv[1], kv[0])):
            print(f"{part:8} {rid}")
        return 0
    if args.out is None or args.clones is None:
        parser.error("OUT_DIR and --clones are required to build")
    problems = build(args.out, args.clones, args.part)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
