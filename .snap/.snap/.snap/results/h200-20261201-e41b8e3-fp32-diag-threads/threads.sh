#!/usr/bin/env bash
# A/B of the CPU tier's thread count and OpenMP wait policy on tiered fp4 decode (interleaved runs), after
# `KEEP_MODEL=1 FP4_EXPERTS=1 ROUTING_SKEW=0.3 ... bash bench/gpu_suite.sh` built the bench model.
model=/tmp/moetier-bench/deepseek-v4-flash-3l-skew0.3-fp4
log=$OUT/ab.log
start=$SECONDS
run() {  # run NAME THREADS WAIT_POLICY
    [ $((SECONDS - start)) -gt ${AB_BUDGET:-400} ] && { echo "skip $1 (budget)" >> "$log"; return; }
    echo "=== $1 threads=$2 wait=$3" >> "$log"
    local envs=()
    [ "$3" != default ] && envs=(OMP_WAIT_POLICY=$3)
    env "${envs[@]}" timeout 150 python3 -m moetier.cli bench decode --model "$model" --expert-format fp4 \
        --streams 1,4 --repeats 3 --cache-fraction 0.05 --policy lfu --modes tiered --cpu-threads "$2" \
        --out /tmp/ab-$1 2>&1 | tr '\r' '\n' | grep '^| tiered\|^Decode' >> "$log"
}
run base 14 default; run passive 14 PASSIVE; run t8 8 default; run t11 11 default
run t11b 11 default; run t8b 8 default; run passiveb 14 PASSIVE; run baseb 14 default
