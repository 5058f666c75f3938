"""The README and docs/ cite only what the repository holds, and the README stays a front page.
Standard library only: no torch import, no job launched."""
from __future__ import annotations

import re
from pathlib import Path

from conftest import ROOT

README_MAX_LINES = 200
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
BACKTICKED = re.compile(r"`([^`\n]+)`")
PATH_ENDINGS = (".py", ".md", ".c", ".h", ".sh", ".json", ".toml")
PATH_STARTS = ("tests/", "docs/", "csrc/", "megatron_p2p/", "benchmarks/", "examples/")
# Not a repository path: placeholders, home or absolute paths, variables, URLs.
NOT_A_PATH = re.compile(r"[<>$~{}]|^/|://")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def missing_link_targets(text: str, base: Path) -> list[str]:
    """The relative link targets in markdown `text` that name no file or folder under `base`
    (the document's folder). Web and mail links and pure #anchors are skipped; a #fragment is
    stripped. Links inside fenced code blocks are not links."""
    missing = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"(https?|mailto):", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if path and not (base / path).exists():
            missing.append(target)
    return missing


def looks_like_a_repository_path(token: str) -> bool:
    if NOT_A_PATH.search(token):
        return False
    return token.startswith(PATH_STARTS) or ("/" in token and token.endswith(PATH_ENDINGS))


def backticked_paths(text: str) -> list[str]:
    """Backticked spans outside fenced code blocks that name repository paths: a span that is one
    token is a path when it looks like one (and any one-token `*.md` span is, as README.md or
    CHANGELOG.md); in a span of several words (a command line), each word that starts with one
    of the repository's top folders is."""
    paths = []
    for span in BACKTICKED.findall(FENCE.sub("", text)):
        words = span.split()
        if len(words) == 1:
            token = words[0]
            if looks_like_a_repository_path(token) or (token.endswith(".md") and not NOT_A_PATH.search(token)):
                paths.append(token)
        else:
            paths += [w.rstrip(",;:)") for w in words if w.startswith(PATH_STARTS) and not NOT_A_PATH.search(w)]
    return paths


def missing_repository_paths(text: str, base: Path) -> list[str]:
    """The backticked repository paths in `text` that exist neither under the repository root nor
    under `base` (a glob pattern needs at least one match)."""
    missing = []
    for token in backticked_paths(text):
        candidates = [ROOT, base]
        if "*" in token:
            found = any(any(root.glob(token)) for root in candidates)
        else:
            found = any((root / token).exists() for root in candidates)
        if not found:
            missing.append(token)
    return missing


def test_every_relative_link_in_the_readme_and_docs_resolves():
    missing = {str(doc.relative_to(ROOT)): m for doc in documents()
               if (m := missing_link_targets(doc.read_text(), doc.parent))}
    assert not missing, f"links to files the repository does not hold: {missing}"


def test_a_broken_link_is_reported(tmp_path):
    (tmp_path / "there.md").write_text("")
    text = ("[ok](there.md) [ok too](there.md#a-section) [web](https://example.org/x.md) [anchor](#terms)\n"
            "[broken](not-there.md) ![broken picture](figures/gone.png#x)\n"
            "```\n[in code](also-not-there.md)\n```\n")
    assert missing_link_targets(text, tmp_path) == ["not-there.md", "figures/gone.png#x"]


def test_every_backticked_repository_path_in_the_readme_and_docs_exists():
    missing = {str(doc.relative_to(ROOT)): m for doc in documents()
               if (m := missing_repository_paths(doc.read_text(), doc.parent))}
    assert not missing, f"backticked paths the repository does not hold: {missing}"


def test_a_missing_backticked_path_is_reported():
    text = ("`megatron_p2p/_env.py` `megatron_p2p/programs/*.json` `src/init.cc` `/dev/shm/x.json`\n"
            "`DESIGN.md` `tests/not_there.py` `torchrun -m x examples/gone.py` `megatron_p2p/nothing/*.json`\n")
    assert missing_repository_paths(text, ROOT / "docs") == [
        "DESIGN.md", "tests/not_there.py", "examples/gone.py", "megatron_p2p/nothing/*.json"]


def test_the_readme_is_a_front_page_of_200_lines_or_fewer():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference material into docs/"
