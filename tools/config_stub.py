"""Write ``ndif_celery/config.pyi``, the type stub of ``ndif_celery/config.py``.

Why: ``Settings`` takes its fields from the ``VARIABLES`` table at import, so
an editor or mypy reading the source sees none of them. The stub spells out
each field with its parser's type and its variable's line of doc; the rest of
the module (the table, the parsers, ``load``) is stubbed as it is. A ``.pyi``
is read by type checkers only: Python never imports it.

The stub is made from the module as it runs, in the order of its source, so
it cannot say more than the code. tests/unit/tools/test_config_stub.py fails
when the checked-in stub differs from what this script writes now.

Usage: ``python tools/config_stub.py [--check]``; with ``--check`` it writes
nothing and exits 1 when the stub is out of date.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "ndif_celery" / "config.py"
STUB = ROOT / "ndif_celery" / "config.pyi"

HEADER = "# The stub of config.py, written by tools/config_stub.py: edit config.py and run it, never this file.\n"


def _annotation(value) -> str:
    """An annotation as the source wrote it (config.py's are strings, from ``__future__``)."""
    return value if isinstance(value, str) else inspect.formatannotation(value)


def _signature(function) -> str:
    """``(params) -> return`` with every default written as ``...``, as stubs do."""
    params, seen_keyword_only = [], False
    for param in inspect.signature(function).parameters.values():
        if param.kind is param.KEYWORD_ONLY and not seen_keyword_only:
            params.append("*")
        seen_keyword_only = seen_keyword_only or param.kind in (param.KEYWORD_ONLY, param.VAR_POSITIONAL)
        text = {param.VAR_POSITIONAL: "*", param.VAR_KEYWORD: "**"}.get(param.kind, "") + param.name
        if param.annotation is not param.empty:
            text += f": {_annotation(param.annotation)}"
        if param.default is not param.empty:
            text += " = ..." if param.annotation is not param.empty else "=..."
        params.append(text)
        if param.kind is param.POSITIONAL_ONLY:
            params.append("/")
    returns = function.__annotations__.get("return")
    return f"({', '.join(params)})" + (f" -> {_annotation(returns)}" if returns is not None else "")


def _type_of(value) -> str:
    """The type of a module constant, its items' too when they share one."""
    if isinstance(value, re.Pattern):
        return f"re.Pattern[{type(value.pattern).__name__}]"
    if isinstance(value, tuple) and value and len({type(item) for item in value}) == 1:
        return f"tuple[{type(value[0]).__name__}, ...]"
    if isinstance(value, dict) and value and len({type(k) for k in value}) == 1 and len({type(v) for v in value.values()}) == 1:
        key, item = next(iter(value.items()))
        return f"dict[{type(key).__name__}, {type(item).__name__}]"
    return type(value).__name__


def _docstring(text: str) -> str:
    """An attribute's docstring, which editors show on hover."""
    if '"""' in text or "\\" in text or text.endswith('"'):
        return repr(text)
    return f'"""{text}"""'


def _class(cls, docs: dict) -> list[str]:
    """A class of the module: its dataclass fields (each with its doc when ``docs`` has one), methods, properties."""
    lines = []
    if dataclasses.is_dataclass(cls):
        frozen = cls.__dataclass_params__.frozen
        lines.append("@dataclass(frozen=True)" if frozen else "@dataclass")
    lines.append(f"class {cls.__name__}:")
    body = []
    for field in dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ():
        has_default = field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING
        body.append(f"    {field.name}: {_annotation(field.type)}" + (" = ..." if has_default else ""))
        if field.name in docs:
            body.append(f"    {_docstring(docs[field.name])}")
    fields = {field.name for field in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    for name, member in vars(cls).items():
        if name.startswith("__") or name in fields:
            continue  # the dataclass's own (__init__, __eq__...), its fields' defaults, the class's bookkeeping
        if isinstance(member, property):
            body += ["    @property", f"    def {name}{_signature(member.fget)}: ..."]
        elif inspect.isfunction(member):
            body.append(f"    def {name}{_signature(member)}: ...")
        elif isinstance(member, (staticmethod, classmethod)):
            body += [f"    @{type(member).__name__}", f"    def {name}{_signature(member.__func__)}: ..."]
        else:
            body.append(f"    {name}: {_type_of(member)}")
    return lines + (body or ["    ..."])


def stub() -> str:
    """The stub of config.py as it runs now, in the order of its source."""
    sys.path.insert(0, str(ROOT))
    try:
        from ndif_celery import config
    finally:
        sys.path.remove(str(ROOT))
    docs = {var.attr: f"{var.name}: {var.doc}" for var in config.VARIABLES}
    source = SOURCE.read_text()
    blocks = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            blocks.append([ast.get_source_segment(source, node)])
        elif isinstance(node, ast.FunctionDef):
            blocks.append([f"def {node.name}{_signature(getattr(config, node.name))}: ..."])
        elif isinstance(node, ast.ClassDef):
            blocks.append(_class(getattr(config, node.name), docs if node.name == "Settings" else {}))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [target.id for target in targets if isinstance(target, ast.Name)]
            if len(names) != len(targets):
                raise SystemExit(f"config.py:{node.lineno}: only plain names are stubbed; extend tools/config_stub.py")
            blocks.append([f"{name}: {_type_of(getattr(config, name))}" for name in names])
        else:
            raise SystemExit(f"config.py:{node.lineno}: a {type(node).__name__} at the top; extend tools/config_stub.py")
    imports = [block[0] for block in blocks if block[0].startswith(("import ", "from "))]
    rest = [block for block in blocks if not block[0].startswith(("import ", "from "))]
    out = [HEADER, *[line + "\n" for line in imports]]
    for block in rest:
        out.append("\n" + "".join(line + "\n" for line in block))
    return "".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when the stub is out of date")
    args = parser.parse_args(argv)
    text = stub()
    if args.check:
        if not STUB.exists() or STUB.read_text() != text:
            print(f"{STUB.relative_to(ROOT)} is out of date: run python tools/config_stub.py", file=sys.stderr)
            return 1
        return 0
    STUB.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
