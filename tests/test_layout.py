"""The package's layout is its architecture (README, "Layout"): each role one package, the API
installed as ``stream_persia.api``, every package listed for packaging and documented, and no
module grows past ~500 lines without saying why."""

import ast
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500


def _packages() -> dict[str, Path]:
    """Every package of the distribution: dotted name -> folder."""
    found = {"stream_persia.api": ROOT / "api"}
    for init in sorted((ROOT / "stream_persia").rglob("__init__.py")):
        if "__pycache__" in init.parts or init.parent.is_symlink():
            continue
        rel = init.parent.relative_to(ROOT)
        found[".".join(rel.parts)] = init.parent
    for init in sorted((ROOT / "api").rglob("__init__.py")):
        rel = init.parent.relative_to(ROOT / "api")
        if rel.parts:
            found["stream_persia.api." + ".".join(rel.parts)] = init.parent
    return found


def _modules() -> list[Path]:
    files = [p for p in (ROOT / "stream_persia").rglob("*.py")
             if not any(part == "api" for part in p.relative_to(ROOT).parts[1:])]
    return sorted(files + list((ROOT / "api").rglob("*.py")))


def test_every_package_folder_is_packaged_and_the_api_maps_to_stream_persia_api():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert sorted(cfg["packages"]) == sorted(_packages()), \
        "pyproject.toml [tool.setuptools] packages must list every package folder"
    assert cfg["package-dir"] == {"stream_persia.api": "api"}


def test_the_installed_api_is_stream_persia_api():
    import stream_persia.api.app as app
    assert Path(app.__file__).resolve().parent == (ROOT / "api").resolve()


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_top_level_api(path):
    """Inside the package the API is ``stream_persia.api``; a top-level ``api`` import works
    only from a checkout's root and would import a second copy of every API module."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0
                 else [])
        for name in names:
            assert name != "api" and not name.startswith("api."), \
                f"{path.relative_to(ROOT)}:{node.lineno} imports {name!r}"


def test_every_package_says_what_it_holds_and_the_readme_table_names_it():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Layout"):]
    for name, folder in _packages().items():
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc, f"{name} has no docstring saying what it holds"
        if name.count(".") == 1 and name != "stream_persia.api":
            assert f"`stream_persia/{name.split('.')[1]}/`" in table \
                or f"stream_persia/{name.split('.')[1]}/" in table, \
                f"README's layout table does not name {name}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_long_module_says_why_it_is_one_module(path):
    lines = len(path.read_text().splitlines())
    if lines <= MAX_LINES:
        return
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert re.search(r"^Size:", doc, re.M), \
        (f"{path.relative_to(ROOT)} has {lines} lines: split it along a seam, or say in its "
         f"docstring, on a line starting 'Size:', why it stays one module")


def _layer_order() -> list[str]:
    """The packages in the README's layout table, bottom layer first."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Layout"):readme.index("## License")]
    order = []
    for m in re.finditer(r"^\| `(stream_persia/(\w+)/|api/)`", table, re.M):
        order.append(m.group(2) or "api")
    return order


def _package_of(path: Path) -> str | None:
    rel = path.relative_to(ROOT).parts
    if rel[0] == "api":
        return "api"
    if len(rel) == 2 or rel[1] == "embedding":
        return None   # a top-level module (errors) or one of PERSIA's paths (re-exports)
    return rel[1]


def test_a_package_imports_only_the_layers_below_it():
    order = _layer_order()
    assert order[0] == "core" and order[-1] == "testing" and "launch" in order, order
    wrong = []
    for path in _modules():
        src = _package_of(path)
        if src is None:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):   # imports for type checking only are no dependency
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                node.body = []
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     and node.level == 0 else [])
            for name in names:
                if not name.startswith("stream_persia."):
                    continue
                dst = "api" if name.startswith("stream_persia.api") else name.split(".")[1]
                if dst == src or dst not in order:   # errors, PERSIA re-exports, same package
                    continue
                assert src in order, f"{src} is not in the README's layout table"
                if order.index(dst) > order.index(src):
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {src} imports "
                                 f"{name} (a layer above it)")
    assert not wrong, "\n".join(wrong)
