#!/usr/bin/env bash
# Every command works on a plain install (`pip install -e .`, no test extras): `--help`, and one error
# path each that must exit 2 with one line and no traceback. Run by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/plain
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet torch==2.13.0
"$venv/bin/pip" install --quiet -e .
specdoctor="$venv/bin/specdoctor"
for command in check repair serve probe inspect generate bench; do
  "$specdoctor" "$command" --help > /dev/null
done
failed=0
while read -r args; do
  set +e
  errors=$($specdoctor $args 2>&1 > /dev/null)
  code=$?
  set -e
  if [ "$code" != 2 ] || grep -q Traceback <<< "$errors" || [ "$(wc -l <<< "$errors")" != 1 ]; then
    echo "plain install: 'specdoctor $args' exited $code: $errors"
    failed=1
  fi
done << 'ARGS'
check --model /nonexistent/model
check --model demo --engine vllm
serve --model demo --engine vllm --max-model-len 256
repair --model /nonexistent/model
serve --model /nonexistent/model
probe --url http://127.0.0.1:9
inspect --model /nonexistent/model
generate --model /nonexistent/model --prompt x
generate --model demo-dspark --prompt x --speculative-model /nonexistent/drafter
bench --model /nonexistent/model
ARGS
rm -rf "$(dirname "$venv")"
exit "$failed"
