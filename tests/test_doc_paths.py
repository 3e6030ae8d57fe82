"""Every path the docs cite resolves: relative links of README.md and docs/**/*.md, and every cited
``veloxquant_mlx/``, ``docs/``, ``tests/`` or ``examples/`` file path and ``veloxquant_mlx.x.y`` module path."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target "title")
FILE_PATH = re.compile(r"(?<![\w/.])(?:veloxquant_mlx|docs|tests|examples)/[\w/.\-]*")
MODULE_PATH = re.compile(r"(?<![\w/.])veloxquant_mlx(?:\.\w+)+")


def _links(text):
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):  # URLs, mail, in-page anchors
            continue
        yield target.split("#", 1)[0]


def _module_resolves(dotted: str) -> bool:
    """A package / module chain, then at most attribute names that its last module defines."""
    parts = dotted.split(".")
    here = REPO / parts[0]
    rest = parts[1:]
    while rest and ((here / rest[0]).is_dir() or (here / f"{rest[0]}.py").is_file()):
        here = here / rest[0] if (here / rest[0]).is_dir() else here / f"{rest[0]}.py"
        rest = rest[1:]
    if not rest:
        return True
    source = here / "__init__.py" if here.is_dir() else here
    name = re.escape(rest[0])
    defined = rf"^\s*(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]|^\s*(?:from|import)\s.*\b{name}\b|^\s+{name},"  # the last: in an import's parentheses
    return source.is_file() and re.search(defined, source.read_text(), re.M) is not None


def unresolved(page: Path) -> list:
    # A results page's "Setting:" line quotes a run's recorded settings (its command lines as they
    # were then), not a path to follow.
    text = "\n".join(line for line in page.read_text().splitlines() if not line.startswith("Setting: `{"))
    bad = []
    for target in _links(text):
        if target and not (page.parent / target).exists():
            bad.append(f"link {target}")
    for path in FILE_PATH.findall(text):
        path = path.rstrip(".")
        if not (REPO / path).exists():
            bad.append(f"path {path}")
    for dotted in MODULE_PATH.findall(text):
        if not _module_resolves(dotted):
            bad.append(f"module {dotted}")
    return bad


def test_every_cited_path_resolves():
    bad = {str(p.relative_to(REPO)): b for p in PAGES if (b := unresolved(p))}
    assert bad == {}, "\n".join(f"{page}: {', '.join(items)}" for page, items in bad.items())


def test_the_checker_catches_what_it_should(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See [here](missing.md#x), `veloxquant_mlx/evaluation/tasks.py`, `veloxquant_mlx.cli.nothing`, "
                    "[ok](page.md), `veloxquant_mlx/cli/args.py`, `veloxquant_mlx.cli.args.kv_summary`, "
                    "[web](https://example.com), [top](#top).")
    assert unresolved(page) == ["link missing.md", "path veloxquant_mlx/evaluation/tasks.py",
                                "module veloxquant_mlx.cli.nothing"]
