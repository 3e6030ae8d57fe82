"""How many of the method protocol's names each registered method reads (docs/add_a_method.md).

The protocol is the public names of ``Method``, ``Needs``, ``View`` and ``Step`` (``caches/method.py``,
``caches/view.py``). A method file "reads" a name when it defines it in its class body, defines it as a
method, passes it as a keyword (``Needs(window=...)``) or reads it as an attribute. A name the protocol
shares with another object (``keys`` of a dict, ``queries`` of a config) counts too, so the counts are
upper bounds.

    python -m lab.protocol_names
"""

from __future__ import annotations

import ast
from pathlib import Path

import veloxquant_mlx
from veloxquant_mlx.caches import method as method_module
from veloxquant_mlx.caches import view as view_module

METHODS = Path(veloxquant_mlx.__file__).resolve().parent / "methods"


def protocol() -> set:
    """The public names a method author can meet."""
    names = {"Options"}
    for cls in (method_module.Method, method_module.Needs, view_module.View, view_module.Step):
        for n in [*vars(cls), *getattr(cls, "__slots__", ()), *getattr(cls, "__dataclass_fields__", {})]:
            if not n.startswith("_"):
                names.add(n)
    return names


def names_read(files, proto: set) -> set:
    """The protocol names ``files`` (one method's modules) define or read."""
    used = set()
    for f in files:
        for node in ast.walk(ast.parse(Path(f).read_text())):
            if isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.FunctionDef):
                used.add(node.name)
            elif isinstance(node, ast.keyword) and node.arg:
                used.add(node.arg)
            elif isinstance(node, ast.ClassDef):
                for b in node.body:
                    targets = b.targets if isinstance(b, ast.Assign) else [b.target] if isinstance(b, ast.AnnAssign) \
                        else []
                    used.update(t.id for t in targets if isinstance(t, ast.Name))
    return used & proto


def per_method() -> dict:
    """{method (module or package under methods/): sorted protocol names it reads}."""
    proto, groups = protocol(), {}
    for f in sorted(METHODS.rglob("*.py")):
        if f.name != "__init__.py":
            groups.setdefault(f.parent.name if f.parent != METHODS else f.stem, []).append(f)
    return {name: sorted(names_read(files, proto)) for name, files in groups.items()}


def main() -> int:
    proto = protocol()
    print(f"the protocol: {len(proto)} names")
    for name, used in sorted(per_method().items(), key=lambda kv: len(kv[1])):
        print(f"{name:10s} {len(used):3d}  {' '.join(used)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
