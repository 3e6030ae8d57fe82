"""The README's "Add a method" excerpt is the example file the tests register, line for line."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_add_a_method_excerpt_is_the_tested_example():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Add a method")
    block = readme[readme.index("```python\n", start) + len("```python\n"):]
    excerpt = block[:block.index("```")]
    assert excerpt.count("\n") >= 10  # a real excerpt, not an empty block
    assert excerpt in (ROOT / "examples" / "add_a_method.py").read_text()


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
