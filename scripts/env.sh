# Sourced by the other scripts: creates (once) and activates the project's
# virtual environment in .venv, installing psframe with the extras named in
# PSFRAME_EXTRAS (comma-separated; empty: psframe and its runtime dependencies
# only), at the exact versions of constraints.txt (setup.cfg only declares
# ranges). A second run reuses it: it installs again only when setup.cfg or
# constraints.txt changed, or an extra is asked for that is not there yet (what
# was installed stays: the demo after the tests installs nothing).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON_BIN="${PYTHON:-python3}"
EXTRAS="${PSFRAME_EXTRAS-}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[env] creating $VENV" >&2
    "$PYTHON_BIN" -m venv "$VENV"
fi

stamp="$VENV/.psframe-installed"  # "<hash of setup.cfg and constraints.txt> <extras installed>"
want="$(cd "$ROOT" && sha256sum setup.cfg constraints.txt | sha256sum | cut -c1-16)"
have="" have_extras=""
if [ -f "$stamp" ]; then
    read -r have have_extras < "$stamp" || true
fi
all_extras="$(printf '%s\n' ${have_extras//,/ } ${EXTRAS//,/ } | sort -u | paste -sd, -)"
if [ "$have" != "$want" ] || [ "$all_extras" != "$have_extras" ]; then
    target="$ROOT"
    [ -z "$all_extras" ] || target="$ROOT[$all_extras]"
    echo "[env] installing psframe${all_extras:+[$all_extras]} into $VENV" >&2
    # constraints.txt pins the tested set, torch to the CPU build's version;
    # refuse anything that would drag CUDA wheels in all the same.
    if ! "$VENV/bin/pip" install --quiet --disable-pip-version-check \
            -c "$ROOT/constraints.txt" -e "$target" \
            > "$VENV/pip-install.log" 2>&1; then
        cat "$VENV/pip-install.log" >&2
        echo "[env] pip install failed (log above)" >&2
        exit 1
    fi
    if "$VENV/bin/pip" list 2>/dev/null | grep -i -q '^nvidia-'; then
        echo "[env] refusing: an nvidia-* package was installed" >&2
        exit 1
    fi
    echo "$want $all_extras" > "$stamp"
fi

# shellcheck disable=SC1091
source "$VENV/bin/activate"
cd "$ROOT"
