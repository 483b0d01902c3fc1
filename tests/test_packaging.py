"""The wheel carries what a non-editable install needs: grammar, templates, tuning table.

``grammar/`` and ``templates/`` live at the top of the repository and are mapped into the
package by pyproject.toml; a mapping mistake only shows in a real (non-editable) install,
which the editable test environment never exercises.
"""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (path,) = out.glob("purlinc-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_has_package_data(wheel):
    names = set(wheel.namelist())
    required = {
        "purlinc/grammar/purlin.lark",
        "purlinc/templates/kernel.cu.j2",
        "purlinc/templates/prelude.cuh",
        "purlinc/templates/atom_ldst.cuh.j2",
        "purlinc/templates/atom_tma.cuh.j2",
        "purlinc/templates/ll.cuh.j2",
        "purlinc/runtime/tuning.json",
        "purlin/__init__.py",
        "purlin/torch.py",
        "purlinc/torch/__init__.py",
    }
    assert required <= names, sorted(required - names)
    # every template in the repository ships
    for template in (REPO / "templates").iterdir():
        if template.suffix in (".j2", ".cuh"):
            assert f"purlinc/templates/{template.name}" in names, template.name


def test_wheel_declares_the_console_script(wheel):
    entry_points = next(n for n in wheel.namelist() if n.endswith("entry_points.txt"))
    assert "purlinc = purlinc.__main__:run" in wheel.read(entry_points).decode()


def test_every_module_of_the_tree_ships(wheel):
    """The wheel's packages are a hand-written list (pyproject.toml): a new subpackage left off
    it would ship missing, and only an installed run would notice."""
    names = set(wheel.namelist())
    for package in ("purlin", "purlinc"):
        for module in (REPO / package).rglob("*.py"):
            assert module.relative_to(REPO).as_posix() in names, module.relative_to(REPO)


def test_the_version_is_written_once_in_effect():
    """pyproject.toml and purlinc.version both hold it; --version prints the second."""
    from purlinc.version import __version__

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["version"] == __version__


def test_the_package_data_is_this_copys_own(monkeypatch):
    """Where another purlinc is installed (a wheel, or an editable install of another
    checkout), importlib finds its ``purlinc.templates`` and ``purlinc.grammar`` even when this
    tree's ``purlinc`` comes first on sys.path: a tree run with PYTHONPATH rendered its kernels
    from the other copy's templates (and hashed those into its cache keys)."""
    import importlib.resources

    from purlinc import resources
    from purlinc.atom.codegen.render import load_template

    elsewhere = REPO / "no-such-checkout"
    real = importlib.resources.files
    monkeypatch.setattr(importlib.resources, "files",
                        lambda package: elsewhere / package.rpartition(".")[2] if package.startswith("purlinc.") else real(package))
    forget = getattr(resources._folder, "cache_clear", lambda: None)  # what was found before the stand-in
    forget()
    try:
        assert Path(str(resources.templates_dir())) == REPO / "templates"
        assert Path(str(resources.grammar_dir())) == REPO / "grammar"
        assert load_template("prelude.cuh") == (REPO / "templates" / "prelude.cuh").read_text(encoding="utf-8")
    finally:
        forget()
