# Shared by scripts/serve and scripts/test: make the venv and install the project into it.
# The venv is .venv, or $VENV_DIR (scripts/check-base-install keeps a base-only one there).
# Reinstalls only when pyproject.toml changed since the last install.
VENV="${VENV_DIR:-.venv}"
ensure_venv() {
    local extras="$1"
    local python="${PYTHON:-python3}"
    if [ ! -x "$VENV/bin/python" ]; then
        echo "creating $VENV with $($python --version)" >&2
        "$python" -m venv "$VENV"
        "$VENV/bin/python" -m pip install --quiet --upgrade pip
    fi
    local spec="."
    [ -n "$extras" ] && spec=".[$extras]"
    local stamp="$VENV/.installed-$(echo "$extras" | tr ',' '-')"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        echo "installing mlx-prompt-cache${extras:+ with $extras} into $VENV" >&2
        "$VENV/bin/python" -m pip install --quiet -e "$spec"
        touch "$stamp"
    fi
}
