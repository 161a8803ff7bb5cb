# Sourced by the other scripts: creates (once) and activates the project's
# virtual environment in .venv, installing psframe and the extras named in
# PSFRAME_EXTRAS, at the exact versions of constraints.txt (setup.cfg only
# declares ranges). A second run reuses it; it reinstalls only when
# setup.cfg, constraints.txt or the extras change.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON_BIN="${PYTHON:-python3}"
EXTRAS="${PSFRAME_EXTRAS:-test}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[env] creating $VENV" >&2
    "$PYTHON_BIN" -m venv "$VENV"
fi

stamp="$VENV/.psframe-installed"
want="$(cd "$ROOT" && sha256sum setup.cfg constraints.txt | sha256sum | cut -c1-16)-$EXTRAS"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    echo "[env] installing psframe[$EXTRAS] into $VENV" >&2
    # constraints.txt pins the tested set, torch to the CPU build's version;
    # refuse anything that would drag CUDA wheels in all the same.
    if ! "$VENV/bin/pip" install --quiet --disable-pip-version-check \
            -c "$ROOT/constraints.txt" -e "$ROOT[$EXTRAS]" \
            > "$VENV/pip-install.log" 2>&1; then
        cat "$VENV/pip-install.log" >&2
        echo "[env] pip install failed (log above)" >&2
        exit 1
    fi
    if "$VENV/bin/pip" list 2>/dev/null | grep -i -q '^nvidia-'; then
        echo "[env] refusing: an nvidia-* package was installed" >&2
        exit 1
    fi
    echo "$want" > "$stamp"
fi

# shellcheck disable=SC1091
source "$VENV/bin/activate"
cd "$ROOT"
