#!/usr/bin/env bash
# The CPU tier's thread count and pinning against tiered decode, one bench decode per setting, on a model
# already built (bench/gpu_suite.sh with KEEP_MODEL=1 leaves it in /tmp/moetier-bench).
# Usage: MODEL=/tmp/moetier-bench/<name> SETTINGS="0:14 1:14 1:12" [EXTRA="--expert-format fp4"] bash bench/tier_threads.sh
# Each setting is PIN:THREADS (MOETIER_CPU_TIER_PIN: 0, 1 or launcher; --cpu-threads); receipts land in $OUT/tier-threads/<run>-<pin>-<threads>/,
# the Markdown tables one after another in $OUT/tier-threads.md, the receipts' JSON in $OUT/tier-threads.tar.gz.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
dir=$OUT/tier-threads
mkdir -p "$dir"
status=0 run=0
for setting in ${SETTINGS:-0:14 1:14}; do  # a setting may repeat (interleaved A/B runs): each run has its number
    pin=${setting%%:*} threads=${setting##*:} run=$((run + 1))
    echo "## run $run: MOETIER_CPU_TIER_PIN=$pin, --cpu-threads $threads" >> "$OUT/tier-threads.md"
    MOETIER_CPU_TIER_PIN=$pin timeout 200 python3 -m moetier.cli bench decode --model "$MODEL" --modes "${MODES:-tiered}" \
        --streams "${STREAMS:-1,4}" --cache-fraction 0.05 --policy lfu --cpu-threads "$threads" ${EXTRA:-} \
        --out "$dir/$run-$pin-$threads" > "$dir/$run-$pin-$threads.log" 2>&1 || status=1
    cat "$dir/$run-$pin-$threads"/*.md >> "$OUT/tier-threads.md" 2>/dev/null || tail -5 "$dir/$run-$pin-$threads.log" >> "$OUT/tier-threads.md"
done
tar -czf "$OUT/tier-threads.tar.gz" -C "$OUT" tier-threads && rm -rf "$dir"
exit $status
