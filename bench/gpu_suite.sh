#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels, run the GPU tests, build the scaled
# DeepSeek-V4-Flash bench model, run the standard decode benchmark and the prefill benchmark;
# everything lands in $OUT.
# Usage (device tool): MOETIER_GIT_SHA=<sha> bash bench/gpu_suite.sh   (carry: .whl)
# Stages can be skipped: SKIP_TESTS=1, SKIP_BENCH=1 (all benchmarks), SKIP_DECODE=1, SKIP_PREFILL=1, SKIP_SERVE=1.
# BENCH_SHAPE picks the bench model's widths (deepseek-v4-flash, the default; deepseek-v3; qwen3-235b);
# BENCH_LAYERS (default 3) sets the model depth; ROUTING_SKEW=alpha draws each layer's expert popularity
# from Dirichlet(alpha) (make-bench-model --routing-skew: small alpha, few hot experts; unset: uniform); GPU_TEST_ARGS adds pytest arguments (e.g. "-k deepseek_v4"); GPU_TEST_TIMEOUT (default 420 s) bounds them;
# BENCH_ARGS replaces the decode bench's "--profile"; PREFILL_ARGS replaces the prefill bench's
# "--prompt-lens 8k,32k,128k --profile"; the prefill bench runs once per chunk size in PREFILL_CHUNKS
# (default "4096 16384"), and once per setting in PREFILL_ENV ("VAR=A VAR=B", e.g. an A/B of a switch);
# SHORT_TURNS=1 adds the short-turn prefill (512/2048 tokens, pure CPU and copy paths against the split). HF_BASELINE=1 adds transformers + accelerate to the decode bench (HF_ARGS:
# its extra flags). The serve stage starts `moetier serve` on the bench model with SERVE_GPU_MEMORY
# (default 8GiB: backbone, KV, an auto 4096-token chunk and a few % of the experts) and drives it at 1/2/4 streams
# (SKIP_SERVE_LEVELS=1: not); SERVE_TURNS=N adds agent sessions of N turns at 1/2 streams (SERVE_TURN_PROMPT words to
# start, default 2048), once per value of SERVE_SPARE_SECONDS (default "30 0": finished caches reused, then not).
# FP8_EXPERTS=1 writes the bench model's routed experts as fp8 + tile scales (DeepSeek's fp8 release format)
# and runs decode/prefill with --expert-format fp8 (half the miss bytes); FP4_EXPERTS=1 the same with packed
# FP4 e2m1 + ue8m0 scales (DeepSeek-V4's release format, --expert-format fp4: 0.27x the miss bytes of bf16 with
# the default e8m0 scale bytes, 0.31x with MOETIER_FP4_SCALES=float32).
# DECODE_INPUTS=forced feeds every decode run's steps tokens drawn from the seed, not their own outputs (bench decode
# --inputs forced): each run, mode and process then times the same inputs after the same context, so that an A/B's
# runs route alike (with greedy inputs the hit rate moved 0.30-0.40 between processes, more than small effects).
# FP8_BACKBONE=1 writes the bench model's attention and shared-expert linears as fp8 + 128x128 tile scales, as
# DeepSeek's releases do (moetier keeps them fp8 in VRAM by default); BACKBONE_AB="dense fp8 dense" adds a decode run
# of BACKBONE_AB_MODES (default resident,tiered) at BACKBONE_AB_STREAMS (default 1,4) per --backbone-format named, in
# order; BACKBONE_AB_PREFILL=1 also a prefill run (8k tokens, 8192-token chunks, tiered) per format named.
# KV_LAYOUT_CHECK=1 adds two decode runs with fp8 KV, contiguous then paged (KV_LAYOUT_PROMPT: their prompt
# length, default 64, e.g. 32768 for long-context decode; KV_LAYOUT_MODES, default resident,tiered; KV_LAYOUT_DTYPE;
# KV_LAYOUT_LAYOUTS, default "contiguous paged"; KV_LAYOUT_ENV="VAR=A VAR=B": those runs once per setting, e.g.
# "MOETIER_V4_ATTENTION=no-split MOETIER_V4_ATTENTION=auto" for the long-context A/B of the split attention;
# KV_LAYOUT_STREAMS, default 1,4; KV_LAYOUT_TIMEOUT, seconds a run, default 300: a 131072-token prompt's prefills).
# CPU_TIER=1 adds the C kernel's tests on this host's ISAs and `moetier bench cpu-tier` (torch vs the C kernel at CPU_TIER_THREADS, default 8,14,16, for the
# expert formats in CPU_TIER_FORMATS, default bf16,fp8,fp4; CPU_TIER_ARGS: its extra flags, e.g. "--paths c --tokens 1,4").
# GPU_EXPERTS=1 adds `moetier bench gpu-experts` (the device's routed-expert kernels alone, bf16/fp8/fp4,
# grouped Triton against per-expert; GPU_EXPERTS_ARGS: its extra flags).
# LINKS=1 adds `moetier bench links` (the home copy's links alone and at once: the CPU tier's kernel, the mapped
# route's reads over PCIe, DMA copies, the DRAM read; LINKS_ARGS: its extra flags, e.g. "--cpu-experts 6"), and
# with ALT_TREE the same again from that tree (its receipt's git sha ends in -alt); LINKS_FORMATS="fp4 fp4_e8m0" runs
# it once per expert format named.
# V4_KERNELS=1 adds `moetier bench v4-kernels` (V4's decode kernels alone against their torch ops, us a call in CUDA
# graphs: attention at several entry counts, compressors, router, SwiGLU, greedy tokens; V4_KERNELS_ARGS: its flags).
# DISPATCH_HOST=1 adds `moetier bench dispatch-host` (the host's us and aten calls per MoE dispatch call, per
# dispatcher, small experts; DISPATCH_HOST_ARGS: its extra flags).
# FP4_SCALES_AB=1 (with FP4_EXPERTS=1) adds a decode run of FP4_SCALES_AB_MODES (default cpu,copy,tiered,mapped-cpu)
# with MOETIER_FP4_SCALES=float32 (the home copy's fp4 scales as float32, not the default exponent bytes), to compare
# with the main decode run;
# FP4_SCALES_AB=aba runs float32, e8m0, then float32 again.
# CPU_PIN_AB=1 adds three decode runs of CPU_PIN_AB_MODES (default cpu,tiered,mapped-cpu) with the CPU tier's threads
# pinned to the last cores (MOETIER_CPU_PIN=1), unpinned, pinned again: with the unpinned main run, an ABAB.
# FED_SPLIT_AB=1 adds three decode runs of FED_SPLIT_AB_MODES (default tiered,mapped-cpu) with the fed CPU tier's
# static split (MOETIER_FED_SPLIT=static: a fixed share of each layer's expert ids), the default balanced split (a
# share of each call's uncached experts, to a part of an expert), static again: with the main run, balanced / static /
# balanced / static. FED_SPLIT_AB="whole balanced whole" runs those MOETIER_FED_SPLIT values in that order instead.
# ENV_AB="MOETIER_FED_STAMPS=0 MOETIER_FED_STAMPS=1" adds a decode run of ENV_AB_MODES (default tiered,mapped-cpu) per
# VAR=VALUE named (that variable set for the run), in order (name one twice for an ABA); ENV_AB_TRACE=modes also
# traces those modes' 1-stream steps in each run, whose receipt and traces then go to env-trace-N/ (N from 1).
# CPU_THREADS_AB="10 12" adds a decode run of CPU_THREADS_AB_MODES (default tiered,mapped-cpu) per CPU-tier thread
# count named (--cpu-threads), then one at the default count again.
# TIERED_AB="mapped_bookkeeping_every=1 mapped_bookkeeping_every=4" adds a decode run of TIERED_AB_MODES (default
# tiered,mapped-cpu) per TieredConfig setting named (--tiered KEY=JSON), in order (name a setting twice for an ABA);
# one run's several fields are joined by "+", e.g. TIERED_AB="mapped=false+decode_halves_min_tokens=2 mapped=false".
# HOST_CONTENTION=1 adds bench/host_contention.py (the launching thread's costs while the CPU tier's jobs run).
# CPU_WORKER_AB=1 adds a decode run of CPU_WORKER_AB_MODES (default cpu,tiered) with MOETIER_CPU_WORKER=python (the
# CPU tier's Python worker thread instead of its native one), to compare with the main decode run.
# TRACE=modes (e.g. "tiered") saves those modes' profiled 1-stream decode steps as gzipped Chrome traces.
# ALT_TREE=dir adds a decode run of ALT_MODES (default resident,tiered) from the moetier source tree in dir (another
# version of the code, e.g. a git archive of a branch), on the same bench model: an A/B of two versions in one call;
# with ALT_TRACE=1 (and TRACE) its traces too, under alt-trace/. Every trace's kernels per step go to the log
# (moetier.bench.trace_kernels).
# GRAPHS_CHECK=1 adds two decode runs (resident and tiered, 1 and 4 streams) with MOETIER_CUDA_GRAPHS=0, then =1.
# The bench model is deleted at the end (KEEP_MODEL=1 keeps it): a second suite in the same call may need the disk.
# One command runs at most 10 minutes on the device:
# split the stages over several calls (e.g. SKIP_TESTS=1 SKIP_DECODE=1 for the prefill receipt).
# The device returns at most 8 files: every log goes to one suite.log, next to the decode receipt
# (JSON, Markdown, profile), the prefill receipt (JSON, Markdown) and the tests' two fidelity records.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export MOETIER_RESULTS=$OUT PYTHONUNBUFFERED=1
LOG="$OUT/suite.log"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
{
    echo "=== environment"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
    echo "git ${MOETIER_GIT_SHA:-unknown}"
    df -h /tmp | tail -1
} > "$LOG" 2>&1
status=0
if [ -z "${SKIP_TESTS:-}" ]; then
    echo "=== gpu tests" >> "$LOG"
    gpu_files=$(grep -l "mark.gpu" tests/test_*.py)
    eval "test_args=(${GPU_TEST_ARGS:-})"  # shell words, so -k "a or b" stays one expression
    # -v names each test as it runs and --durations lists the slow ones: a timeout still says where it stopped.
    timeout "${GPU_TEST_TIMEOUT:-420}" python3 -m pytest -v --durations=15 -m gpu $gpu_files "${test_args[@]}" \
        -p no:cacheprovider 2>&1 | tee -a "$LOG"
    status=${PIPESTATUS[0]}
    echo "gpu tests exit status: $status" | tee -a "$LOG"
fi
bench() {  # bench KIND SECONDS ARGS...: one benchmark, its log appended, its status folded into $status
    local kind=$1 seconds=$2
    shift 2
    # FP8_EXPERTS=1: the decode and prefill benches keep the experts fp8 in the home copy.
    if [ -n "${FP8_EXPERTS:-}" ] && { [ "$kind" = decode ] || [ "$kind" = prefill ]; }; then
        set -- "$@" --expert-format fp8
    fi
    if [ -n "${FP4_EXPERTS:-}" ] && { [ "$kind" = decode ] || [ "$kind" = prefill ]; }; then
        set -- "$@" --expert-format fp4
    fi
    if [ -n "${DECODE_INPUTS:-}" ] && [ "$kind" = decode ]; then  # e.g. forced: every run times the same tokens
        set -- "$@" --inputs "$DECODE_INPUTS"
    fi
    echo "=== bench $kind" >> "$LOG"
    timeout "$seconds" python3 -m moetier.cli bench "$kind" --model "$model" "$@" --out "$OUT" 2>&1 \
        | tr '\r' '\n' | grep -v '^\(pinning\|loading\)' | tee -a "$LOG"
    local code=${PIPESTATUS[0]}
    echo "bench $kind exit status: $code" | tee -a "$LOG"
    [ "$code" -eq 0 ] || status=$code
}
if [ -n "${CPU_TIER:-}" ]; then  # the CPU tier's kernels alone (torch and C), no model needed
    # First the C kernel's own tests: this host's AVX-512 builds are paths the dev machines cannot run.
    echo "=== cpu kernel tests (host ISAs)" >> "$LOG"
    timeout 180 python3 -m pytest -q tests/test_cpu_kernel.py tests/test_fp8_experts.py tests/test_fp4_experts.py \
        -m "not gpu" -p no:cacheprovider 2>&1 | tail -15 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    echo "=== bench cpu-tier" >> "$LOG"
    timeout 240 python3 -m moetier.cli bench cpu-tier --threads "${CPU_TIER_THREADS:-8,14,16}" \
        --formats "${CPU_TIER_FORMATS:-bf16,fp8,fp4}" ${CPU_TIER_ARGS:-} --out "$OUT" 2>&1 \
        | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ -n "${HOST_CONTENTION:-}" ]; then  # the launching thread beside the CPU tier's jobs, no model needed
    echo "=== host contention" >> "$LOG"
    timeout 300 python3 bench/host_contention.py --out "$OUT/host-contention.json" 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ -n "${GPU_EXPERTS:-}" ]; then  # the device's expert kernels alone, per format, no model needed
    echo "=== bench gpu-experts" >> "$LOG"
    eval "gpu_experts_args=(${GPU_EXPERTS_ARGS:-})"
    timeout 240 python3 -m moetier.cli bench gpu-experts "${gpu_experts_args[@]}" --out "$OUT" 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ -n "${LINKS:-}" ]; then  # the home copy's links alone and at once, no model needed
    echo "=== bench links" >> "$LOG"
    eval "links_args=(${LINKS_ARGS:-})"
    for links_format in ${LINKS_FORMATS:-}; do  # once per expert format named, else once with LINKS_ARGS alone
        echo "=== bench links --expert-format $links_format" >> "$LOG"
        timeout 240 python3 -m moetier.cli bench links "${links_args[@]}" --expert-format "$links_format" \
            --out "$OUT" 2>&1 | tee -a "$LOG"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
    if [ -z "${LINKS_FORMATS:-}" ]; then
        timeout 240 python3 -m moetier.cli bench links "${links_args[@]}" --out "$OUT" 2>&1 | tee -a "$LOG"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    fi
    if [ -n "${ALT_TREE:-}" ]; then  # the same from ALT_TREE (run from inside it: python -m imports from the cwd)
        echo "=== bench links from the tree $ALT_TREE" >> "$LOG"
        (cd "$ALT_TREE" && export PYTHONPATH=/tmp/site:$PWD MOETIER_GIT_SHA="${MOETIER_GIT_SHA:-unknown}-alt" \
            && timeout 240 python3 -m moetier.cli bench links "${links_args[@]}" --out "$OUT") 2>&1 | tee -a "$LOG"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    fi
fi
if [ -n "${V4_KERNELS:-}" ]; then  # V4's decode kernels alone against their torch ops, in CUDA graphs, no model needed
    echo "=== bench v4-kernels" >> "$LOG"
    eval "v4_kernels_args=(${V4_KERNELS_ARGS:-})"
    timeout 240 python3 -m moetier.cli bench v4-kernels "${v4_kernels_args[@]}" --out "$OUT" 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ -n "${DISPATCH_HOST:-}" ]; then  # the host's cost of one MoE dispatch call, per dispatcher, no model needed
    echo "=== bench dispatch-host" >> "$LOG"
    eval "dispatch_host_args=(${DISPATCH_HOST_ARGS:-})"
    timeout 240 python3 -m moetier.cli bench dispatch-host "${dispatch_host_args[@]}" --out "$OUT" 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ -z "${SKIP_BENCH:-}" ]; then
    shape=${BENCH_SHAPE:-deepseek-v4-flash}
    model=/tmp/moetier-bench/$shape-${BENCH_LAYERS:-3}l${ROUTING_SKEW:+-skew$ROUTING_SKEW}${FP8_EXPERTS:+-fp8}${FP4_EXPERTS:+-fp4}${FP8_BACKBONE:+-fp8bb}
    skew=()
    [ -n "${ROUTING_SKEW:-}" ] && skew=(--routing-skew "$ROUTING_SKEW")
    [ -n "${FP8_EXPERTS:-}" ] && skew+=(--fp8-experts)
    [ -n "${FP4_EXPERTS:-}" ] && skew+=(--fp4-experts)
    [ -n "${FP8_BACKBONE:-}" ] && skew+=(--fp8-backbone)
    echo "=== make-bench-model" >> "$LOG"
    # Progress bars are dropped from the log (carriage returns).
    make_model() {  # make_model DEVICE: the weights drawn on DEVICE
        timeout 240 python3 -m moetier.cli make-bench-model --shape "$shape" --layers "${BENCH_LAYERS:-3}" \
            "${skew[@]}" --out "$model" --device "$1" --force 2>&1 | tr '\r' '\n' | grep -v '^writing' | tee -a "$LOG"
    }
    make_model cuda || { echo "make-bench-model on cuda failed: drawing on the CPU" | tee -a "$LOG"; make_model cpu; }
    if [ -z "${SKIP_DECODE:-}" ]; then
        hf=()
        [ -n "${HF_BASELINE:-}" ] && hf=(--hf-baseline --hf-args "${HF_ARGS---fallback autocast --steps 3 --max-seconds 60}")
        trace=()
        [ -n "${TRACE:-}" ] && trace=(--trace "$TRACE")
        bench decode 480 --streams 1,2,4 --cache-fraction 0.05 --policy lfu ${BENCH_ARGS---profile} "${hf[@]}" \
            "${trace[@]}"
    fi
    if [ -n "${FP4_SCALES_AB:-}" ]; then  # fp4 blocks keeping float32 scales, against the main run's e8m0 bytes
        # FP4_SCALES_AB=aba: float32, e8m0, float32 again (no main decode run needed: SKIP_DECODE=1), so that a
        # drift over the call shows as the two float32 runs' difference instead of passing for the formats'.
        formats="float32"  # the main run's default, for the bench model's ue8m0 scales, is e8m0
        [ "${FP4_SCALES_AB}" = aba ] && formats="float32 e8m0 float32"
        for scales in $formats; do
            echo "=== decode with MOETIER_FP4_SCALES=$scales" >> "$LOG"
            MOETIER_FP4_SCALES=$scales bench decode 300 --streams 1,2,4 --cache-fraction 0.05 --policy lfu \
                --modes "${FP4_SCALES_AB_MODES:-cpu,copy,tiered,mapped-cpu}" --profile
        done
    fi
    if [ -n "${CPU_PIN_AB:-}" ]; then  # the CPU tier's threads pinned, unpinned, pinned, after the unpinned main run
        for pin in 1 0 1; do
            echo "=== decode with MOETIER_CPU_PIN=$pin" >> "$LOG"
            MOETIER_CPU_PIN=$pin bench decode 300 --streams 1,2,4 --cache-fraction 0.05 --policy lfu \
                --modes "${CPU_PIN_AB_MODES:-cpu,tiered,mapped-cpu}"
        done
    fi
    if [ -n "${FED_SPLIT_AB:-}" ]; then  # the static split of the fed CPU tier against the balanced default
        splits=$FED_SPLIT_AB
        [ "$splits" = 1 ] && splits="static balanced static"
        for split in $splits; do
            echo "=== decode with MOETIER_FED_SPLIT=$split" >> "$LOG"
            MOETIER_FED_SPLIT=$split bench decode 300 --streams 1,2,4 --cache-fraction 0.05 --policy lfu \
                --modes "${FED_SPLIT_AB_MODES:-tiered,mapped-cpu}" --profile
        done
    fi
    if [ -n "${ENV_AB:-}" ]; then  # one environment variable's values, run by run
        run=0
        for setting in $ENV_AB; do
            echo "=== decode with $setting" >> "$LOG"
            export "$setting"  # bench is a function of this shell: exported for its run, unset after it
            run=$((run + 1)) main_out=$OUT env_trace=()
            if [ -n "${ENV_AB_TRACE:-}" ]; then  # each run's receipt and traces in a folder of its own
                OUT=$main_out/env-trace-$run && mkdir -p "$OUT" && echo "$setting" > "$OUT/setting.txt"
                env_trace=(--trace "$ENV_AB_TRACE")
            fi
            bench decode 300 --streams "${ENV_AB_STREAMS:-1,2,4}" --cache-fraction 0.05 --policy lfu \
                --modes "${ENV_AB_MODES:-tiered,mapped-cpu}" --profile "${env_trace[@]}"
            OUT=$main_out
            unset "${setting%%=*}"
        done
    fi
    if [ -n "${CPU_THREADS_AB:-}" ]; then  # CPU-tier thread counts: fewer cores busy, the launching thread faster?
        for threads in $CPU_THREADS_AB default; do
            echo "=== decode with --cpu-threads $threads" >> "$LOG"
            extra=()
            [ "$threads" != default ] && extra=(--cpu-threads "$threads")
            bench decode 300 --streams 1,2,4 --cache-fraction 0.05 --policy lfu \
                --modes "${CPU_THREADS_AB_MODES:-tiered,mapped-cpu}" --profile "${extra[@]}"
        done
    fi
    if [ -n "${TIERED_AB:-}" ]; then  # TieredConfig fields, run by run (a run's fields joined by "+")
        for setting in $TIERED_AB; do
            echo "=== decode with --tiered $setting" >> "$LOG"
            tiered=()
            IFS='+' read -ra fields <<< "$setting"
            for field in "${fields[@]}"; do tiered+=(--tiered "$field"); done
            bench decode 300 --streams "${TIERED_AB_STREAMS:-1,2,4}" --cache-fraction 0.05 --policy lfu \
                --modes "${TIERED_AB_MODES:-tiered,mapped-cpu}" --profile "${tiered[@]}"
        done
    fi
    if [ -n "${BACKBONE_AB:-}" ]; then  # the backbone's linears fp8 (as stored) against dequantised at load
        for backbone in $BACKBONE_AB; do
            echo "=== decode with --backbone-format $backbone" >> "$LOG"
            bench decode 300 --streams "${BACKBONE_AB_STREAMS:-1,4}" --cache-fraction 0.05 --policy lfu \
                --modes "${BACKBONE_AB_MODES:-resident,tiered}" --backbone-format "$backbone"
            if [ -n "${BACKBONE_AB_PREFILL:-}" ]; then
                bench prefill 300 --cache-fraction 0.05 --policy lfu --chunk-tokens 8192 --prompt-lens 8k \
                    --modes tiered --backbone-format "$backbone"
            fi
        done
    fi
    if [ -n "${CPU_WORKER_AB:-}" ]; then  # the CPU tier's Python worker, against the main run's native one
        MOETIER_CPU_WORKER=python bench decode 300 --streams 1,2,4 --cache-fraction 0.05 --policy lfu \
            --modes "${CPU_WORKER_AB_MODES:-cpu,tiered}" --profile
    fi
    if [ -n "${ALT_TREE:-}" ]; then  # ALT_MODES (default resident,tiered) again from the source tree ALT_TREE
        echo "=== decode from the tree $ALT_TREE" >> "$LOG"
        # its receipt's git sha ends in -alt (the tree is another commit than this checkout); ALT_TRACE=1 saves its
        # TRACE modes' traces too, into $OUT/alt-trace (the main run's keep their names)
        alt_trace=()
        [ -n "${ALT_TRACE:-}" ] && [ -n "${TRACE:-}" ] && mkdir -p "$OUT/alt-trace" && alt_trace=(--trace "$TRACE")
        alt_out=$OUT
        [ ${#alt_trace[@]} -gt 0 ] && alt_out=$OUT/alt-trace
        (cd "$ALT_TREE" && export PYTHONPATH=/tmp/site:$PWD MOETIER_GIT_SHA="${MOETIER_GIT_SHA:-unknown}-alt" \
            && OUT=$alt_out bench decode 300 --streams 1,2,4 --cache-fraction 0.05 \
            --policy lfu --modes "${ALT_MODES:-resident,tiered}" "${alt_trace[@]}")
    fi
    for trace_file in "$OUT"/decode-trace-*.json.gz "$OUT"/{alt-trace,env-trace-*}/decode-trace-*.json.gz; do
        [ -f "$trace_file" ] || continue
        echo "=== kernels per decode step: $trace_file" >> "$LOG"
        python3 -m moetier.bench.trace_kernels "$trace_file" --top 30 --gaps 10 2>&1 | tail -42 | tee -a "$LOG"
    done
    if [ -n "${GRAPHS_CHECK:-}" ]; then  # decode CUDA graphs off, then on (Qwen3 / V3 graphs are opt-in)
        for graphs in 0 1; do
            MOETIER_CUDA_GRAPHS=$graphs bench decode 300 --streams 1,4 --repeats 2 --modes resident,tiered \
                --cache-fraction 0.05 --policy lfu
        done
    fi
    if [ -n "${KV_LAYOUT_CHECK:-}" ]; then  # fp8 KV, contiguous then paged: the paged read's cost in decode
        for setting in ${KV_LAYOUT_ENV:-none}; do  # KV_LAYOUT_ENV="VAR=A VAR=B": the runs once per setting
            for layout in ${KV_LAYOUT_LAYOUTS:-contiguous paged}; do
                [ "$setting" != none ] && export "${setting?}"  # not a subshell: bench folds its status in
                bench decode "${KV_LAYOUT_TIMEOUT:-300}" --streams "${KV_LAYOUT_STREAMS:-1,4}" --repeats 2 \
                    --modes "${KV_LAYOUT_MODES:-resident,tiered}" \
                    --kv-dtype "${KV_LAYOUT_DTYPE:-fp8}" --kv-layout "$layout" --prompt-len "${KV_LAYOUT_PROMPT:-64}"
                [ "$setting" != none ] && unset "${setting%%=*}"
            done
        done
    fi
    if [ -z "${SKIP_PREFILL:-}" ]; then
        for setting in ${PREFILL_ENV:-none}; do  # PREFILL_ENV="VAR=A VAR=B": the prefill runs once per setting
            [ "$setting" != none ] && export "${setting?}" && echo "=== prefill with $setting" >> "$LOG"
            for chunk in ${PREFILL_CHUNKS:-4096 16384}; do
                bench prefill 420 --cache-fraction 0.05 --policy lfu --chunk-tokens "$chunk" \
                    ${PREFILL_ARGS---prompt-lens 8k,32k,128k --profile}
            done
            [ "$setting" != none ] && unset "${setting%%=*}"
        done
        if [ -n "${SHORT_TURNS:-}" ]; then
            bench prefill 240 --cache-fraction 0.05 --policy lfu --chunk-tokens 2048 --prompt-lens 512,2048 \
                --modes sync,copy,cpu,tiered
        fi
    fi
    if [ -z "${SKIP_SERVE:-}" ]; then
        serve_args="--gpu-memory ${SERVE_GPU_MEMORY:-8GiB} --context 16384 --max-streams 4"
        # The experts' home copy in the format the decode bench uses (FP8_EXPERTS / FP4_EXPERTS), as a user serves it.
        [ -n "${FP8_EXPERTS:-}" ] && serve_args="$serve_args --expert-format fp8"
        [ -n "${FP4_EXPERTS:-}" ] && serve_args="$serve_args --expert-format fp4"
        echo "=== plan" >> "$LOG"
        python3 -m moetier.cli plan --model "$model" $serve_args 2>&1 | tee -a "$LOG"
        serve_bench() {  # serve_bench LABEL EXTRA_SERVE_ARGS BENCH_ARGS...
            local label=$1 extra=$2
            shift 2
            echo "=== bench serve $label" >> "$LOG"
            timeout 420 python3 -m moetier.cli bench serve --start-model "$model" --serve-args "$serve_args $extra" \
                "$@" --out "$OUT" 2>&1 | tr '\r' '\n' | grep -v '^\(pinning\|loading\)' | tee -a "$LOG"
            code=${PIPESTATUS[0]}
            echo "bench serve $label exit status: $code" | tee -a "$LOG"
            [ "$code" -eq 0 ] || status=$code
        }
        if [ -z "${SKIP_SERVE_LEVELS:-}" ]; then
            serve_bench levels "" --concurrency 1,2,4 --requests 4 --prompt-tokens 512 --max-tokens 32
        fi
        # Agent sessions: each follow-up turn extends the last prompt + completion (prefix-cache hits), with
        # finished requests' caches reused (their decode graphs replay) and, for comparison, not (0).
        if [ -n "${SERVE_TURNS:-}" ]; then
            for spare in ${SERVE_SPARE_SECONDS:-30 0}; do
                serve_bench "turns-spare$spare" "--spare-cache-seconds $spare" --concurrency 1,2 --requests 2 \
                    --turns "$SERVE_TURNS" --turn-tokens 64 --prompt-tokens "${SERVE_TURN_PROMPT:-2048}" --max-tokens 48
            done
        fi
    fi
    [ -n "${KEEP_MODEL:-}" ] || rm -rf "$model"
fi
exit "$status"
