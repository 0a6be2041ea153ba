# Shared by scripts/serve and scripts/test: make .venv and install the project into it.
# Reinstalls only when pyproject.toml changed since the last install.
ensure_venv() {
    local extras="$1"
    local python="${PYTHON:-python3}"
    if [ ! -x .venv/bin/python ]; then
        echo "creating .venv with $($python --version)" >&2
        "$python" -m venv .venv
        .venv/bin/python -m pip install --quiet --upgrade pip
    fi
    local spec="."
    [ -n "$extras" ] && spec=".[$extras]"
    local stamp=".venv/.installed-$(echo "$extras" | tr ',' '-')"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        echo "installing mlx-prompt-cache${extras:+ with $extras} into .venv" >&2
        .venv/bin/python -m pip install --quiet -e "$spec"
        touch "$stamp"
    fi
}
