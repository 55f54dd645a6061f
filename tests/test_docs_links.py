"""Every relative link in README.md, docs/*.md and config/README.md points at a file that exists,
and every #anchor at a heading of its target."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def doc_files():
    return [ROOT / "README.md", ROOT / "config" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def links(text: str) -> list[str]:
    return LINK.findall(CODE_SPAN.sub("", FENCE.sub("", text)))


def anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"^#{1,6}\s+(.*?)\s*$", FENCE.sub("", path.read_text(encoding="utf-8")), re.M)
    return {re.sub(r"[^\w\- ]", "", h.replace("`", "").lower()).replace(" ", "-") for h in headings}


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in links(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):          # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor})")
    return broken


def test_every_relative_link_in_the_docs_resolves():
    problems = {str(p.relative_to(ROOT)): broken_links(p) for p in doc_files()}
    assert {name: found for name, found in problems.items() if found} == {}


def test_the_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    doc = tmp_path / "doc.md"
    (tmp_path / "there.md").write_text("# A heading\n")
    doc.write_text("# Top\n[ok](there.md) [ok](there.md#a-heading) [ok](#top) [web](https://example.com)\n"
                   "`[not a link](nowhere.md)`\n```\n[not a link](nowhere.md)\n```\n"
                   "[gone](missing.md) [bad anchor](there.md#nope)\n")
    assert broken_links(doc) == ["missing.md (no such file)", "there.md#nope (no heading #nope)"]
