"""Every relative link in the README and docs/, and every docs path named in the code, resolves.

Links are checked as GitHub renders them: a path relative to the Markdown file, and a `#fragment`
against the target's heading anchors (lower-cased, punctuation dropped, spaces to hyphens, repeats
numbered -1, -2, …). Code (comments and docstrings included) may name `docs/…` files and
`README.md#anchor` sections; each must exist.
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_LINK = re.compile(r"""(?:src|href)=["']([^"']+)["']""")
CODE_REF = re.compile(r"(?<![\w/.-])((?:docs/[\w./-]*\w)|(?:README\.md(?:#[\w-]+)?))")
CODE_SUFFIXES = {".py", ".js", ".sh", ".yml", ".yaml", ".toml", ".html", ".css", ".cfg", ".ini"}
CODE_NAMES = {"Dockerfile", "Makefile", ".dockerignore"}


def _tracked() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [REPO / p for p in out if (REPO / p).is_file()]


def github_slug(heading: str) -> str:
    text = re.sub(r"`|\*\*|__|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        if in_fence or not re.match(r"#{1,6} ", line):
            continue
        slug = github_slug(line.lstrip("#"))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(found)


def _check(target: str, base: Path) -> str | None:
    """None when ``target`` (relative to folder ``base``) resolves, else why not."""
    path, _, fragment = target.partition("#")
    file = (base / path).resolve() if path else None
    if file is not None and not file.exists():
        return "no such file"
    if fragment and (file is None or file.suffix == ".md"):
        md = file
        if md is None:
            return None  # an in-page link, checked by the caller with its own file
        if fragment not in anchors(md):
            return f"no heading #{fragment} in {md.relative_to(REPO)}"
    return None


def _markdown_files() -> list[Path]:
    return [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = []
    for md in _markdown_files():
        # inline code is text, not a link (a log format such as `Epoch:[e/E](i/N)` reads like one)
        text = re.sub(r"`[^`\n]+`", "``", md.read_text())
        for target in MD_LINK.findall(text) + HTML_LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
                continue  # http(s), mailto: not ours to check offline
            if target.startswith("#"):
                problem = None if target[1:] in anchors(md) else f"no heading {target}"
            elif target.startswith("/"):
                continue  # a path on a running server (/docs, /api/v1/…), not a file
            else:
                problem = _check(target, md.parent)
            if problem:
                broken.append(f"{md.relative_to(REPO)}: ({target}) {problem}")
    assert not broken, "\n".join(broken)


def test_every_docs_path_named_in_the_code_resolves():
    broken, seen = [], 0
    for file in _tracked():
        if file.suffix not in CODE_SUFFIXES and file.name not in CODE_NAMES:
            continue
        if file.is_relative_to(REPO / "tests") and file.name == Path(__file__).name:
            continue
        for n, line in enumerate(file.read_text(errors="replace").splitlines(), 1):
            for ref in CODE_REF.findall(line):
                seen += 1
                problem = _check(ref, REPO)
                if problem:
                    broken.append(f"{file.relative_to(REPO)}:{n}: {ref}: {problem}")
    assert seen, "the scan found no references at all; is the pattern broken?"
    assert not broken, "\n".join(broken)


def test_the_slugs_follow_githubs_rules():
    assert github_slug(" Deploy with Docker Compose (PostgreSQL)") == "deploy-with-docker-compose-postgresql"
    assert github_slug(" `LossConfig`") == "lossconfig"
    assert github_slug(" Integrations: verl, TRL — x") == "integrations-verl-trl--x"
