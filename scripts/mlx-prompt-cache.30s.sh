#!/usr/bin/env bash
# <xbar.title>mlx-prompt-cache</xbar.title>
# <xbar.version>v0.1.0</xbar.version>
# <xbar.desc>Prompt cache hit ratio, tier sizes, sessions, the alerts on now, what costs the most recomputed tokens, the autotuned RAM budget and start/stop for the mlx-prompt-cache proxy.</xbar.desc>
# <xbar.dependencies>bash,curl</xbar.dependencies>
# <swiftbar.hideRunInTerminal>true</swiftbar.hideRunInTerminal>
#
# SwiftBar / xbar plugin, refreshed every 30 s (the ".30s." in the name). Install by
# symlinking it into the plugin folder:
#   ln -s "$PWD/scripts/mlx-prompt-cache.30s.sh" ~/Library/Application\ Support/SwiftBar/Plugins/
#
# Only bash, curl and awk: SwiftBar runs plugins with a minimal PATH, and /usr/bin/python3 on
# a Mac without the developer tools is a stub that pops up an install dialog.
#
#   MLX_PROMPT_CACHE_URL   proxy to watch (default http://127.0.0.1:1235)
#   MLX_PROMPT_CACHE_API_KEY  key to send, for a proxy with [tenants] api_keys (default none)
#   LAUNCHCTL              launchctl to use in actions (default /bin/launchctl)
set -u
export PATH="/usr/bin:/bin:/usr/sbin:/sbin:/opt/homebrew/bin:/usr/local/bin:$PATH"

URL="${MLX_PROMPT_CACHE_URL:-http://127.0.0.1:1235}"
URL="${URL%/}"
LABEL="com.mlx-prompt-cache"
LAUNCHCTL="${LAUNCHCTL:-/bin/launchctl}"
PLIST="${PLIST_DIR:-$HOME/Library/LaunchAgents}/$LABEL.plist"
LOG_DIR="$HOME/Library/Logs/mlx-prompt-cache"
SERVICE="gui/$(id -u)/$LABEL"
SESSIONS_SHOWN=5
# Only the first few sessions are parsed: the list is sorted newest first, and the awk
# reader below walks its input a character at a time.
SESSIONS_HEAD_BYTES=4000
# The lost-tokens and alert lines are cut to this many characters; hovering shows all.
LINE_LENGTH=72
# The alerts on now: the hit ratio's and one per cause of lost tokens (twelve causes).
ALERTS_SHOWN=13
# Expanded as ${AUTH[@]+...}: bash 3.2, the Mac's /bin/bash, calls an empty array unbound.
AUTH=()
if [ -n "${MLX_PROMPT_CACHE_API_KEY:-}" ]; then
    AUTH=(-H "Authorization: Bearer $MLX_PROMPT_CACHE_API_KEY")
fi

# JSON -> "path=value" lines ("ram.bytes=123", "models.0=demo-llama"), one per scalar.
# A few lines of awk instead of a JSON tool the Mac may not have; the stats are flat
# machine-written JSON, and anything it cannot read simply shows as missing.
flatten_json() {
    # LC_ALL=C: bytes in, bytes out, so awks that count characters agree with those that don't.
    LC_ALL=C awk '
    function hex4(h,   i, v) {
        v = 0
        for (i = 1; i <= 4; i++) v = v * 16 + index("0123456789abcdef", tolower(substr(h, i, 1))) - 1
        return v
    }
    function utf8(c) {
        if (c < 128) return sprintf("%c", c)
        if (c < 2048) return sprintf("%c%c", 192 + int(c / 64), 128 + c % 64)
        if (c < 65536) return sprintf("%c%c%c", 224 + int(c / 4096), 128 + int(c / 64) % 64, 128 + c % 64)
        return sprintf("%c%c%c%c", 240 + int(c / 262144), 128 + int(c / 4096) % 64, 128 + int(c / 64) % 64, 128 + c % 64)
    }
    function emit(v,   p, k) {
        p = ""
        for (k = 1; k <= depth; k++) p = p (k > 1 ? "." : "") key[k]
        print p "=" v
    }
    { text = text $0 "\n" }
    END {
        s = text; n = length(s); i = 1; depth = 0
        while (i <= n) {
            c = substr(s, i, 1)
            if (c == "{") { depth++; kind[depth] = "o"; key[depth] = ""; want_key = 1; i++ }
            else if (c == "[") { depth++; kind[depth] = "a"; key[depth] = 0; i++ }
            else if (c == "}" || c == "]") { depth--; i++ }
            else if (c == ",") {
                if (kind[depth] == "o") want_key = 1; else key[depth]++
                i++
            }
            else if (c == ":" || c == " " || c == "\t" || c == "\n" || c == "\r") { i++ }
            else if (c == "\"") {
                j = i + 1; str = ""
                while (j <= n) {
                    d = substr(s, j, 1)
                    if (d == "\\") {
                        e = substr(s, j + 1, 1)
                        if (e == "u" && substr(s, j + 2, 4) ~ /^[0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F]$/) {
                            # \uXXXX (Python writes every non-ASCII character so), pairs joined.
                            c = hex4(substr(s, j + 2, 4)); j += 6
                            if (c >= 55296 && c < 56320 && substr(s, j, 2) == "\\u") {
                                c = 65536 + (c - 55296) * 1024 + hex4(substr(s, j + 2, 4)) - 56320; j += 6
                            }
                            if (c >= 55296 && c < 57344) str = str "?"  # a lone surrogate
                            else if (c > 0) str = str utf8(c)
                            continue
                        }
                        str = str (e == "n" || e == "t" || e == "r" ? " " : e); j += 2; continue
                    }
                    if (d == "\"") break
                    str = str d; j++
                }
                i = j + 1
                if (kind[depth] == "o" && want_key) { key[depth] = str; want_key = 0 }
                else emit(str)
            }
            else {
                j = i
                while (j <= n && index(",}] \t\r\n", substr(s, j, 1)) == 0) j++
                emit(substr(s, i, j - i)); i = j
            }
        }
    }'
}

# The first of the given paths that has a value ("" when none does).
field() {
    local flat="$1" path value
    shift
    for path in "$@"; do
        value="$(printf '%s\n' "$flat" | awk -v p="$path" 'index($0, p "=") == 1 { print substr($0, length(p) + 2); exit }')"
        if [ -n "$value" ] && [ "$value" != "null" ]; then
            printf '%s' "$value"
            return
        fi
    done
}

human_bytes() {
    awk -v b="$1" 'BEGIN {
        split("B KB MB GB TB", unit, " "); i = 1
        while (b >= 1000 && i < 5) { b /= 1000; i++ }
        printf(i == 1 ? "%d %s" : "%.1f %s", b, unit[i])
    }'
}

# SwiftBar reads "|" as the start of a line's parameters, and a leading "-" as a submenu.
menu_text() {
    local text="${1//|/¦}"
    [ "${#text}" -gt 48 ] && text="${text:0:47}…"
    printf '%s' "$text"
}

percent() {
    awk -v r="$1" 'BEGIN { printf("%.0f%%", r * 100) }'
}

is_loaded() {
    "$LAUNCHCTL" print "$SERVICE" >/dev/null 2>&1
}

self_path() {
    printf '%s/%s' "$(cd "$(dirname "$0")" && pwd)" "$(basename "$0")"
}

# The CLI the agent runs (first ProgramArguments entry), for "cache clear".
cli_path() {
    local cli=""
    if [ -f "$PLIST" ]; then
        cli="$(/usr/libexec/PlistBuddy -c "Print :ProgramArguments:0" "$PLIST" 2>/dev/null)" || cli=""
    fi
    [ -n "$cli" ] || cli="$(command -v mlx-prompt-cache 2>/dev/null)" || cli=""
    printf '%s' "$cli"
}

start_action() {
    # A loaded agent is started with kickstart; an unloaded one has to be bootstrapped.
    if is_loaded; then
        echo "Start | bash=$LAUNCHCTL param1=kickstart param2=$SERVICE terminal=false refresh=true"
    else
        echo "Start | bash=$LAUNCHCTL param1=bootstrap param2=gui/$(id -u) param3=\"$PLIST\" terminal=false refresh=true"
    fi
}

common_actions() {
    echo "Open logs | bash=/usr/bin/open param1=\"$LOG_DIR\" terminal=false"
    echo "Refresh | refresh=true"
}

render_down() {
    local why="$1"
    echo "⚡ stopped"
    echo "---"
    echo "mlx-prompt-cache is not running"
    echo "$why | color=gray"
    echo "---"
    start_action
    common_actions
}

# "Sessions: N" and the newest few with their cached tokens, from GET /v1/cache/sessions.
render_sessions() {
    local body="$1" flat n i id tokens model whole=0
    n="$(printf '%s' "$body" | awk '{ n += gsub(/"last_used":/, "") } END { print n + 0 }')"
    echo "Sessions: $n"
    [ "$(printf '%s' "$body" | wc -c)" -le "$SESSIONS_HEAD_BYTES" ] && whole=1
    flat="$(printf '%s' "$body" | head -c "$SESSIONS_HEAD_BYTES" | flatten_json)"
    for ((i = 0; i < SESSIONS_SHOWN; i++)); do
        id="$(field "$flat" "sessions.$i.id")"
        tokens="$(field "$flat" "sessions.$i.tokens")"
        [ -n "$id" ] && [ -n "$tokens" ] || break
        # In a cut-off list, only a session followed by another one was read whole.
        [ "$whole" = 1 ] || [ -n "$(field "$flat" "sessions.$((i + 1)).id")" ] || break
        model="$(field "$flat" "sessions.$i.model")"
        echo "--$(menu_text "$id"): $tokens tokens${model:+ ($(menu_text "$model"))}"
    done
}

# The cause that cost the most prompt tokens computed again in the last hour, new content
# aside (nothing fixes that), and its fix, from GET /v1/cache/diagnosis (most first; one
# entry per cause, twelve at most).
render_lost() {
    local flat="$1" i cause tokens share fix
    for ((i = 0; i < 12; i++)); do
        cause="$(field "$flat" "causes.$i.cause")"
        [ -n "$cause" ] || return 0
        [ "$cause" = new_content ] && continue
        tokens="$(field "$flat" "causes.$i.tokens")"
        share="$(field "$flat" "causes.$i.share")"
        fix="$(field "$flat" "causes.$i.fix.text")"
        [ -n "$fix" ] && fix=": ${fix//|/¦}"
        echo "Lost: $cause, ${tokens:-0} tokens ($(percent "${share:-0}"))$fix | length=$LINE_LENGTH href=$URL/dashboard"
        return 0
    done
}

# One line per alert on now (GET /v1/cache/stats `alerts`, from the diagnosis), each
# naming its cause and fix; click: the dashboard, which shows the setting to paste.
render_alerts() {
    local flat="$1" i message
    for ((i = 0; i < ALERTS_SHOWN; i++)); do
        message="$(field "$flat" "alerts.$i.message")"
        [ -n "$message" ] || return 0
        echo "⚠ ${message//|/¦} | length=$LINE_LENGTH color=red href=$URL/dashboard"
    done
}

# The RAM budget the autotuner set now, between its bounds, and protect_frequent; nothing
# while it is off (the fixed settings hold).
render_autotune() {
    local flat="$1" budget low high protect
    [ "$(field "$flat" autotune.enabled)" = true ] || return 0
    budget="$(field "$flat" autotune.ram_budget_bytes)"
    low="$(field "$flat" autotune.bounds.ram_min_bytes)"
    high="$(field "$flat" autotune.bounds.ram_max_bytes)"
    protect="$(field "$flat" autotune.protect_frequent)"
    [ -n "$budget" ] && [ -n "$low" ] && [ -n "$high" ] || return 0
    echo "Autotune: RAM budget $(human_bytes "$budget") (bounds $(human_bytes "$low")–$(human_bytes "$high")), protect_frequent ${protect:-?}"
}

render_up() {
    local stats="$1" health="$2" sessions="$3" lost="$4"
    local ratio requests hits misses ram_bytes ram_blocks ssd_bytes ssd_blocks spills reloads
    local title="⚡ up" models="" i name alert
    ratio="$(field "$stats" hit_ratio requests.hit_ratio)"
    requests="$(field "$stats" requests.total requests)"
    hits="$(field "$stats" hits requests.hits)"
    misses="$(field "$stats" misses requests.misses)"
    ram_bytes="$(field "$stats" ram.bytes tiers.ram.bytes cache.ram.bytes)"
    ram_blocks="$(field "$stats" ram.blocks tiers.ram.blocks cache.ram.blocks)"
    ssd_bytes="$(field "$stats" ssd.bytes tiers.ssd.bytes cache.ssd.bytes)"
    ssd_blocks="$(field "$stats" ssd.blocks tiers.ssd.blocks cache.ssd.blocks)"
    spills="$(field "$stats" ssd.spills tiers.ssd.spills cache.ssd.spills)"
    reloads="$(field "$stats" ssd.reloads tiers.ssd.reloads cache.ssd.reloads)"
    alert="$(field "$stats" alert.message)"
    local source="$stats"
    [ -n "$(field "$stats" models.0)" ] || source="$health"
    for i in 0 1 2 3 4 5 6 7; do
        name="$(field "$source" "models.$i")"
        [ -n "$name" ] || break
        models="${models:+$models, }$name"
    done

    [ -n "$ratio" ] && title="⚡ $(percent "$ratio")"
    [ -n "$alert$(field "$stats" alerts.0.message)" ] && title="$title ⚠"
    echo "$title"
    echo "---"
    echo "mlx-prompt-cache at $URL | href=$URL/health"
    [ -n "$alert" ] && echo "⚠ ${alert//|/¦} | color=red href=$URL/dashboard"
    render_alerts "$stats"
    [ -n "$ratio" ] && echo "Token hit ratio: $(percent "$ratio")"
    [ -n "$requests" ] && echo "Requests: $requests${hits:+ ($hits hits, ${misses:-0} misses)}"
    [ -n "$lost" ] && render_lost "$lost"
    if [ -n "$ram_bytes" ]; then
        echo "RAM: $(human_bytes "$ram_bytes")${ram_blocks:+ in $ram_blocks blocks}"
    fi
    render_autotune "$stats"
    if [ -n "$ssd_bytes" ]; then
        echo "SSD: $(human_bytes "$ssd_bytes")${ssd_blocks:+ in $ssd_blocks blocks}"
    fi
    [ -n "$spills$reloads" ] && echo "SSD spills/reloads: ${spills:-0}/${reloads:-0}"
    # A "|" in a model name would start SwiftBar's parameter list.
    [ -n "$models" ] && echo "Models: ${models//|/¦}"
    [ -n "$sessions" ] && render_sessions "$sessions"
    echo "---"
    echo "Open dashboard | href=$URL/dashboard"
    echo "Restart | bash=$LAUNCHCTL param1=kickstart param2=-k param3=$SERVICE terminal=false refresh=true"
    echo "Stop | bash=$LAUNCHCTL param1=bootout param2=$SERVICE terminal=false refresh=true"
    local cli
    cli="$(cli_path)"
    if [ -n "$cli" ]; then
        echo "Clear cache | bash=\"$cli\" param1=cache param2=clear terminal=false refresh=true"
    fi
    common_actions
}

main() {
    local stats code rc
    # -w appends the HTTP status on its own line; curl's exit code tells refused from slow.
    stats="$(curl -s -m 3 ${AUTH[@]+"${AUTH[@]}"} -w '\n%{http_code}' "$URL/v1/cache/stats" 2>/dev/null)"
    rc=$?
    case "$rc" in
        0) ;;
        7) render_down "nothing listening at $URL"; return 0 ;;
        28) render_down "no answer from $URL within 3 s"; return 0 ;;
        *) render_down "cannot reach $URL (curl exit $rc)"; return 0 ;;
    esac
    code="${stats##*$'\n'}"
    stats="${stats%$'\n'*}"
    if [ "$code" != "200" ]; then
        echo "⚡ error"
        echo "---"
        echo "$URL/v1/cache/stats answered HTTP $code | color=red"
        echo "---"
        echo "Restart | bash=$LAUNCHCTL param1=kickstart param2=-k param3=$SERVICE terminal=false refresh=true"
        common_actions
        return 0
    fi
    local health sessions lost
    health="$(curl -s -m 2 "$URL/health" 2>/dev/null | flatten_json)"
    # -f: a server without the sessions route (or a refused key) shows no sessions line.
    sessions="$(curl -sf -m 3 ${AUTH[@]+"${AUTH[@]}"} "$URL/v1/cache/sessions" 2>/dev/null)" || sessions=""
    # Only what comes before the per-model, tenant and session lists is read: the causes.
    lost="$(curl -sf -m 3 ${AUTH[@]+"${AUTH[@]}"} "$URL/v1/cache/diagnosis?window=1h" 2>/dev/null)" || lost=""
    lost="$(printf '%s' "$lost" | awk '{ i = index($0, "\"by_model\""); if (i) { print substr($0, 1, i - 1); exit } print }' | flatten_json)"
    render_up "$(printf '%s' "$stats" | flatten_json)" "$health" "$sessions" "$lost"
}

main "$@"
