"""The install scripts/env.sh makes (test.sh, demo.sh and CI run it) cannot be shadowed by a
folder named funcshard beside a user's script, such as a clone of this repository; and
`import funcshard` there loads no torch._dynamo (see [Note: untraced without importing
dynamo] in funcshard/step/_gather.py)."""

import re
import site
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[2]

USER_SCRIPT = """
import site
import sys

sys.path.extend({site_packages!r})  # torch and the rest, without their own .pth files
site.addsitedir({installed!r})  # the editable wheel's files, as pip puts them in site-packages
import funcshard

print(funcshard.Mesh.__name__, funcshard.__file__, "torch._dynamo" in sys.modules)
"""


def _env_sh_mode() -> str:
    """The editable mode of env.sh's `pip install -e` (setuptools' default: lenient)."""
    install = [line for line in (ROOT / "scripts/env.sh").read_text().splitlines()
               if "pip install" in line and " -e " in line]  # fmt: skip
    assert len(install) == 1, install
    mode = re.search(r"--config-settings[ =]editable_mode=(\w+)", install[0])
    return mode.group(1) if mode else "lenient"


def test_a_folder_named_funcshard_beside_a_script_does_not_shadow_the_install(tmp_path):
    """With setuptools' default (lenient) editable install, whose finder runs after the path
    finder, `import funcshard` beside an empty funcshard/ folder gave that folder as a
    namespace package: "module 'funcshard' has no attribute 'Mesh'". The editable wheel is
    built as env.sh's pip builds it, from this checkout, and installed in a site directory of
    its own, in a process that sees no other funcshard install."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    build = (
        "import sys; from setuptools import build_meta; "
        "build_meta.build_editable(sys.argv[1], {'editable_mode': sys.argv[2]})"
    )
    out = subprocess.run(
        [sys.executable, "-c", build, str(wheels), _env_sh_mode()],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    installed = tmp_path / "site-packages"
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(installed)
    user = tmp_path / "user"
    (user / "funcshard").mkdir(parents=True)  # the clone's folder, seen as a namespace package
    site_packages = [*site.getsitepackages(), site.getusersitepackages()]
    (user / "train.py").write_text(
        USER_SCRIPT.format(site_packages=site_packages, installed=str(installed))
    )
    out = subprocess.run(
        [sys.executable, "-S", "train.py"],
        capture_output=True, text=True, timeout=120, cwd=user, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    name, file, dynamo = out.stdout.split()
    assert name == "Mesh" and Path(file).resolve().is_relative_to(ROOT.resolve())
    # every process that imports funcshard (scripts, torchrun ranks, pool workers) would pay
    # about 1 s for a compiler most of them never use
    assert dynamo == "False", "import funcshard loaded torch._dynamo"
