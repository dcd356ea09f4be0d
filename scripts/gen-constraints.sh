#!/usr/bin/env bash
# systemd/constraints.txt: the runtime dependencies exactly as `pip install .` resolves them, for the
# service install (README "Install as a service": pip install -c systemd/constraints.txt .), and
# exactly what CI tests (.ci/run runs the two checks below).
#
#   scripts/gen-constraints.sh                      resolve `pip install .` in a throwaway virtual
#                                                   environment and write systemd/constraints.txt
#   scripts/gen-constraints.sh --check              resolve again; fail with the difference when the
#                                                   file no longer pins what that resolves: exit 3 when
#                                                   only versions moved (a release upstream), exit 1
#                                                   when a package was added or dropped
#   scripts/gen-constraints.sh --installed PYTHON   fail when an environment's installed versions are
#                                                   not the file's pins (the test environment, after
#                                                   the tests ran in it)
#
# To move the pins (a new release upstream, or a changed pyproject.toml): run it without arguments,
# then `bash .ci/run` (which tests those pins), and commit the file. It resolves with the `python3`
# on PATH ($PYTHON to choose another): the file records that Python's version; packages a different
# Python needs (tomli below 3.11) are then not pinned.
set -euo pipefail

cd "$(dirname "$0")/.."
FILE=systemd/constraints.txt
PY=${PYTHON:-python3}

# "name==version" lines of FILE (or stdin), comments and blank lines dropped, names normalised
pins() {
  sed -e 's/#.*//' -e 's/[[:space:]]//g' "$@" | sed '/^$/d' \
    | awk -F'==' '{n=tolower($1); gsub(/[-_.]+/, "-", n); print n "==" $2}' | sort
}

# what `pip install .` resolves now, as name==version lines
resolve() {
  local venv
  venv=$(mktemp -d "${TMPDIR:-/tmp}/gen-constraints.XXXXXX")
  # shellcheck disable=SC2064
  trap "rm -rf '$venv'" RETURN
  "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check . >&2
  "$venv/bin/python" -m pip freeze --disable-pip-version-check | grep -iv '^accelstats[ =@]'
}

case "${1:-}" in
  "")
    [ $# -eq 0 ] || { echo "usage: $0 [--check | --installed PYTHON]" >&2; exit 2; }
    resolved=$(resolve)
    {
      echo "# The runtime dependencies of accelstats as \`pip install .\` resolved them ($(date -u +%Y-%m-%d)," \
           "$("$PY" --version 2>&1), $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME" || uname -s))."
      echo "# The service install uses them: pip install -c systemd/constraints.txt . (README.md)."
      echo "# .ci/run runs the tests on exactly these, and fails when \`pip install .\` resolves anything else."
      echo "# Regenerate with scripts/gen-constraints.sh, then run bash .ci/run; do not edit by hand."
      printf '%s\n' "$resolved"
    } > "$FILE"
    echo "gen-constraints: wrote $FILE ($(pins "$FILE" | wc -l) pins)" >&2
    ;;
  --check)
    [ $# -eq 1 ] || { echo "usage: $0 --check" >&2; exit 2; }
    resolved=$(resolve)
    if ! difference=$(diff <(pins "$FILE") <(printf '%s\n' "$resolved" | pins)); then
      echo "gen-constraints: $FILE does not pin what \`pip install .\` resolves now (< pinned, > resolved):" >&2
      printf '%s\n' "$difference" >&2
      echo "gen-constraints: run scripts/gen-constraints.sh, then bash .ci/run, and commit $FILE" >&2
      # the same packages at other versions: upstream released (exit 3); a package added or dropped:
      # pyproject.toml changed without the file (exit 1)
      if diff <(pins "$FILE" | cut -d= -f1) <(printf '%s\n' "$resolved" | pins | cut -d= -f1) >/dev/null; then
        exit 3
      fi
      exit 1
    fi
    echo "gen-constraints: $FILE pins what \`pip install .\` resolves ($(pins "$FILE" | wc -l) packages)" >&2
    ;;
  --installed)
    [ $# -eq 2 ] || { echo "usage: $0 --installed PYTHON" >&2; exit 2; }
    "$2" - "$FILE" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

wrong = []
pins = [line.split("#")[0].strip() for line in open(sys.argv[1], encoding="utf-8")]
for pin in filter(None, pins):
    name, _, want = pin.partition("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        have = "not installed"
    if have != want:
        wrong.append(f"  {name}: pinned {want}, installed {have}")
if wrong:
    sys.exit(f"gen-constraints: {sys.executable} does not have {sys.argv[1]}'s versions:\n" + "\n".join(wrong))
print(f"gen-constraints: {sys.executable} has {sys.argv[1]}'s {len(list(filter(None, pins)))} versions", file=sys.stderr)
EOF
    ;;
  *)
    echo "usage: $0 [--check | --installed PYTHON]" >&2
    exit 2
    ;;
esac
