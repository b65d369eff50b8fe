#!/usr/bin/env bash
# Build freezeframe's wheel, install it into a clean virtualenv and use it from outside the source
# tree, so packaging errors fail here instead of on a user's machine:
#   * every file under src/freezeframe (modules, subpackages, py.typed, data) is in the install;
#   * `import freezeframe` resolves to the installed copy, and so does each of its modules;
#   * the `freezeframe` console script runs the demo (exit 1 when an output differs from eager);
#   * the `torch_dynamo_backends` entry point registers `freezeframe` with torch.compile before
#     freezeframe is imported, and torch.compile(backend="freezeframe") gives eager's outputs.
#
# The venv is clean (no system site-packages, where an editable install of this checkout could
# hide a file the wheel lacks); torch goes into it through scripts/install_torch.sh (a local CPU
# wheel on this project's machines). PYTHON picks the interpreter (default python3).
# KEEP_WORK=1 keeps the temporary directory for a look afterwards.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
say() { echo "check_wheel [${SECONDS}s]: $*"; }
work=$(mktemp -d "${TMPDIR:-/tmp}/freezeframe-wheel.XXXXXX")
if [ "${KEEP_WORK:-0}" = 1 ]; then
    say "working in $work (kept)"
else
    trap 'rm -rf "$work"' EXIT
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Build from a copy of the files git would ship (tracked and untracked-but-not-ignored), so a stale
# build/ directory in the checkout cannot put into the wheel a file the sources no longer hold.
mkdir "$work/src"
if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$repo" && git ls-files -z --cached --others --exclude-standard \
        | tar --null --files-from=- --ignore-failed-read -cf - 2>/dev/null) \
        | tar -xf - -C "$work/src"
else
    cp -r "$repo/pyproject.toml" "$repo/README.md" "$repo/src" "$work/src/"
fi
say "building the wheel"
"$py" -m pip wheel --quiet --no-deps -w "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/freezeframe-*.whl)
say "built $(basename "$wheel")"

say "installing it into a clean venv"
"$py" -m venv "$work/venv"
vpy="$work/venv/bin/python"
bash "$repo/scripts/install_torch.sh" "$vpy"
"$vpy" -m pip install --quiet "$wheel"

# The expected files: everything under src/freezeframe in the copy built, bytecode aside.
(cd "$work/src/src" && find freezeframe -type f ! -name '*.pyc' ! -path '*/__pycache__/*' \
    | sort) > "$work/expected.txt"

cd "$work"  # outside the source tree: nothing can come from the checkout
say "freezeframe demo (the console script)"
"$work/venv/bin/freezeframe" demo

say "import, files, entry points"
"$vpy" - "$work/expected.txt" "$work/venv" <<'EOF'
import importlib
import importlib.metadata as md
import pkgutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

expected_list, venv = Path(sys.argv[1]), Path(sys.argv[2]).resolve()
failures = []

# torch.compile finds the backend through the entry point, before freezeframe is imported.
import torch._dynamo  # noqa: E402

if "freezeframe" in sys.modules:
    failures.append("importing torch._dynamo imported freezeframe already")
if "freezeframe" not in torch._dynamo.list_backends():
    failures.append(f"torch._dynamo.list_backends() lacks 'freezeframe': "
                    f"{torch._dynamo.list_backends()}")
eps = [ep for ep in md.entry_points(group="torch_dynamo_backends") if ep.name == "freezeframe"]
if [ep.value for ep in eps] != ["freezeframe.compilation.dynamo_backend:freezeframe_backend"]:
    failures.append(f"torch_dynamo_backends entry points named freezeframe: {eps}")
scripts = [ep.value for ep in md.entry_points(group="console_scripts") if ep.name == "freezeframe"]
if scripts != ["freezeframe.cli:main"]:
    failures.append(f"console_scripts entry points named freezeframe: {scripts}")

import freezeframe as ff  # noqa: E402

package = Path(ff.__file__).resolve().parent
if not package.is_relative_to(venv):
    failures.append(f"freezeframe imported from {package}, not from the venv {venv}")
installed = {str(p.relative_to(package.parent)) for p in package.rglob("*")
             if p.is_file() and p.suffix != ".pyc" and "__pycache__" not in p.parts}
missing = sorted(set(expected_list.read_text().split()) - installed)
if missing:
    failures.append(f"{len(missing)} files of src/ are not in the wheel: {missing}")
if not (package / "py.typed").is_file():
    failures.append("py.typed is missing (type checkers would ignore freezeframe's annotations)")

# Every module imports from the installed copy (a subpackage left out would fail here, or come
# from elsewhere); a module needing an optional dependency absent here is skipped.
optional: list[str] = []
names = [m.name for m in pkgutil.walk_packages(ff.__path__, "freezeframe.")
         if m.name.rsplit(".", 1)[-1] != "__main__"]
for name in names:
    try:
        imported = importlib.import_module(name)
    except ImportError as exc:
        # An optional dependency (triton, transformers, ...) not installed here, raised as it is
        # or wrapped in the module's own ImportError, is skipped; a freezeframe module is not.
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, ModuleNotFoundError):
            cause = cause.__cause__ or cause.__context__
        missing_name = cause.name if isinstance(cause, ModuleNotFoundError) else None
        if missing_name and missing_name.split(".")[0] != "freezeframe":
            optional.append(f"{name} (needs {missing_name})")
            continue
        failures.append(f"import {name}: {exc!r}")
        continue
    origin = Path(str(imported.__file__)).resolve()
    if not origin.is_relative_to(venv):
        failures.append(f"{name} imported from {origin}, outside the venv")

# The public front doors work from the wheel: ff.compile and torch.compile(backend="freezeframe").
import torch  # noqa: E402

from freezeframe.models.example import MIX_OP, ExampleMLP  # noqa: E402

module = ExampleMLP(hidden_size=32).eval()
options: dict[str, Any] = {"backend": "eager", "splitting_ops": [MIX_OP]}
x = torch.randn(5, 32)
with torch.no_grad():
    want = module(x)
    front_doors: dict[str, Callable[[], Callable[[torch.Tensor], torch.Tensor]]] = {
        "ff.compile": lambda: ff.compile(module, ff.CompilationConfig(**options)),
        "torch.compile(backend='freezeframe')":
            lambda: torch.compile(module, backend="freezeframe", options=options),
    }
    for label, build in front_doors.items():
        try:
            err = (build()(x) - want).abs().max().item()
        except Exception as exc:
            failures.append(f"{label}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        if err > 1e-6:
            failures.append(f"{label}: largest difference from eager {err:.3g} > 1e-6")

if failures:
    print("check_wheel: FAILED", *failures, sep="\n  ", file=sys.stderr)
    sys.exit(1)
skipped = f"; skipped for optional dependencies: {optional}" if optional else ""
print(f"check_wheel: ok: freezeframe {ff.__version__} from the wheel: {len(installed)} files, "
      f"{len(names) - len(optional)} modules import, both entry points, demo and both compile "
      f"paths match eager{skipped}")
EOF
