"""README.md and docs/*.md: every relative link reaches a file of the repository (and, with an
anchor, a heading of that page, as GitHub spells heading anchors); the README stays a front page
(under 150 lines and 1,500 words, no table cell over 300 characters). No network: links to other
sites are not followed."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LINES, README_WORDS, CELL_CHARS = 150, 1500, 300

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?!`).+?(?<!`)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (links there are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text, lower case, without punctuation but `-` and `_`,
    spaces turned to `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading counts as its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set:
    """Every anchor of `page`: each heading's (a repeated one gets -1, -2, ... as on GitHub) and
    explicit <a name/id> anchors."""
    text = FENCE.sub("", page.read_text())
    out, seen = set(), {}
    for _, heading in HEADING.findall(text):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out | set(HTML_ANCHOR.findall(text))


def links(page: Path) -> list:
    text = prose(page.read_text())
    return LINK.findall(text) + REFERENCE.findall(text)


TASK_PAGES = ("getting-started.md", "megatron-lm.md", "bridge.md", "recipes-and-launch.md", "gpus-and-te.md",
              "models.md", "moe.md", "analyze-and-export.md", "watching-a-run.md", "method.md", "results.md",
              "status.md", "troubleshooting.md", "contributing.md")
"""The pages by task; docs/support.md (generated) is the one more the README's map links."""


def test_the_pages_exist():
    names = {p.name for p in PAGES}
    for page in (*TASK_PAGES, "support.md"):
        assert page in names, f"docs/{page} is missing"


@pytest.mark.parametrize("name", TASK_PAGES)
def test_each_page_opens_with_what_it_answers(name):
    lines = (ROOT / "docs" / name).read_text().splitlines()
    assert lines[0].startswith("# ") and lines[1] == "", f"docs/{name}: a title, then a blank line"
    assert lines[2].startswith("Answers: "), f"docs/{name}: the first line after the title says what it answers"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    lines, words = text.count("\n"), len(text.split())
    assert lines < README_LINES, f"README.md has {lines} lines (keep it under {README_LINES}; detail goes to docs/)"
    assert words < README_WORDS, f"README.md has {words} words (keep it under {README_WORDS})"
    wide = []
    for line in FENCE.sub("", text).splitlines():
        if line.lstrip().startswith("|"):
            wide += [c.strip()[:60] + "..." for c in re.split(r"(?<!\\)\|", line) if len(c.strip()) > CELL_CHARS]
    assert not wide, f"README.md table cells over {CELL_CHARS} characters: {wide}"


def test_the_checks_read_markdown_as_github_does():
    assert slug("9. End to end (bench/quality.py)") == "9-end-to-end-benchqualitypy"
    assert slug("`snip-pretrain-gpt`") == "snip-pretrain-gpt"
    assert slug("Where FP4 hurts (written by `bench/quality_regimes.py`)") == \
        "where-fp4-hurts-written-by-benchquality_regimespy"
    assert links_of("see [a](x.md#b) and `[c](d.md)`\n```\n[e](f.md)\n```\n![g](h.png)") == ["x.md#b", "h.png"]


def links_of(text: str) -> list:
    return LINK.findall(prose(text))
