# Sourced by the other scripts: creates (once) and activates the project's
# virtual environment in .venv, installing psframe and the extras named in
# PSFRAME_EXTRAS. A second run reuses it; it reinstalls only when setup.cfg
# or the extras change.
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
want="$(cat "$ROOT/setup.cfg" | sha256sum | cut -c1-16)-$EXTRAS"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    echo "[env] installing psframe[$EXTRAS] into $VENV" >&2
    # torch is pinned in setup.cfg to the CPU build; refuse anything that
    # would drag CUDA wheels in.
    if ! "$VENV/bin/pip" install --quiet --disable-pip-version-check -e "$ROOT[$EXTRAS]" \
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
