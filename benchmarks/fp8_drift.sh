#!/usr/bin/env bash
# Float8 against bf16 over a long run: does training in float8 move the loss curve more than
# another reduction order does? On one GPU, the 106.7M model of
# benchmarks/results/bf16_accumulation (8 layers, hidden 1024, 16 heads / 4 KV groups, seq
# 4096, global batch 4) trains STEPS steps on the embedded corpus, same seed and data order:
#   bf16              the reference
#   bf16_chunkN       the reference with --fused-linear-cross-entropy over chunks of N tokens:
#                     the same arithmetic in another order, the noise pair (one per NOISE_CHUNKS)
#   fp8_FORMAT_RECIPE --fp8-format FORMAT --fp8-recipe RECIPE --fp8-linears FP8_LINEARS (one per
#                     RECIPES)
#   fp8_FORMAT_RECIPE_output  with FP8_OUTPUT_LAYER=1, the same and the output layer in float8
#                     too (--fp8-output-layer, inside the fused loss over the first
#                     NOISE_CHUNKS size: the noise pair's second run is its bf16 twin)
# side by side as separate processes on the one GPU (PARALLEL=1), then tools/compare_loss.py's
# drift test (docs/numerics.md) of each float8 run against the band of the pair(s):
# OUT_DIR/summary.json, compare.txt, drift.png, NAME.jsonl per run, logs/NAME.log, driver.log.
# Resumable: each run saves to CKPT_DIR and stops, saved, at the first iteration that ends
# TIME_LIMIT_MIN minutes after this script started (or at an iteration EXIT_INTERVAL
# divides); invoked again with the same settings, OUT_DIR and CKPT_DIR, it continues every
# unfinished run from its last checkpoint (each run's metrics file keeps one record per
# iteration), and once all are done it only compares. Only each run's latest checkpoint is
# kept (~1.5 GB each); CKPT_DIR must survive between invocations.
#   bash benchmarks/fp8_drift.sh
#   TIME_LIMIT_MIN=8 bash benchmarks/fp8_drift.sh   # in 10-minute slots: again while it exits 3
#   RECIPES="tensorwise rowwise" NOISE_CHUNKS="2048 8192" bash benchmarks/fp8_drift.sh
#   DEVICE=cpu STEPS=50 bash benchmarks/fp8_drift.sh --num-workers 0   # a CPU check: the tiny
#       # model at 64 tokens in float32 (the "bf16" runs too), torchao's emulated float8
# Environment: STEPS (1000) RECIPES (tensorwise: each tensorwise (hybrid), rowwise (e4m3, its
# only format) or FORMAT:RECIPE, e.g. e4m3:tensorwise) FP8_LINEARS (all; auto: the start-up
# timing decides) NOISE_CHUNKS (4096; 64 on the CPU) DRIFT_WINDOW (STEPS/10+1:STEPS/2, e.g.
# 101:500: after warm-up and the first fast fall, before the curve flattens into memorising
# the small corpus, where trajectories drift apart whatever changed) FP8_OUTPUT_LAYER (0; 1: the
# runs above with the output layer in float8 as well) PARALLEL (1; 0: one run
# after another, sharing TIME_LIMIT_MIN) TIME_LIMIT_MIN (none) EXIT_INTERVAL (none)
# SAVE_INTERVAL (250) DEVICE (cuda; cpu) OUT_DIR (benchmarks/out/fp8_drift) CKPT_DIR
# (OUT_DIR_ckpt). Extra arguments go to every pretrain_gpt.py run.
# Exit status: 0 all runs done and every float8 run inside the band, 1 a float8 run drifts
# (or a run failed: its log is named), 2 bad settings or curves the test cannot judge,
# 3 runs unfinished (run it again).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-1000}
RECIPES=${RECIPES:-tensorwise}
FP8_LINEARS=${FP8_LINEARS:-all}
FP8_OUTPUT_LAYER=${FP8_OUTPUT_LAYER:-0}
DEVICE=${DEVICE:-cuda}
PARALLEL=${PARALLEL:-1}
TIME_LIMIT_MIN=${TIME_LIMIT_MIN:-}
EXIT_INTERVAL=${EXIT_INTERVAL:-}
SAVE_INTERVAL=${SAVE_INTERVAL:-250}
OUT_DIR=${OUT_DIR:-benchmarks/out/fp8_drift}
CKPT_DIR=${CKPT_DIR:-${OUT_DIR%/}_ckpt}

refuse() { echo "error: $1" >&2; exit 2; }
positive_int() { [[ $2 =~ ^[0-9]+$ && $2 -gt 0 ]] || refuse "$1=$2: give a whole number > 0, e.g. $1=$3"; }
positive_int STEPS "$STEPS" 1000
positive_int SAVE_INTERVAL "$SAVE_INTERVAL" 250
[ -z "$EXIT_INTERVAL" ] || positive_int EXIT_INTERVAL "$EXIT_INTERVAL" 200
[[ -z $TIME_LIMIT_MIN || ($TIME_LIMIT_MIN =~ ^[0-9]*\.?[0-9]+$ && ! $TIME_LIMIT_MIN =~ ^[0.]+$) ]] ||
    refuse "TIME_LIMIT_MIN=$TIME_LIMIT_MIN: give minutes > 0, e.g. TIME_LIMIT_MIN=8, or leave it unset"
case $DEVICE in cuda) NOISE_CHUNKS=${NOISE_CHUNKS:-4096};; cpu) NOISE_CHUNKS=${NOISE_CHUNKS:-64};;
    *) refuse "DEVICE=$DEVICE: cuda or cpu, e.g. DEVICE=cuda";; esac
case $PARALLEL in 0|1) ;; *) refuse "PARALLEL=$PARALLEL: 1 (side by side) or 0, e.g. PARALLEL=1";; esac
case $FP8_LINEARS in auto|all) ;; *) refuse "FP8_LINEARS=$FP8_LINEARS: all or auto, e.g. FP8_LINEARS=all";; esac
case $FP8_OUTPUT_LAYER in 0|1) ;; *) refuse "FP8_OUTPUT_LAYER=$FP8_OUTPUT_LAYER: 0 or 1, e.g. FP8_OUTPUT_LAYER=1";; esac
[ -n "${NOISE_CHUNKS// /}" ] || refuse "NOISE_CHUNKS is empty: name one chunk size at least, e.g. NOISE_CHUNKS=4096"
for n in $NOISE_CHUNKS; do positive_int NOISE_CHUNKS "$n" 4096; done
[ -n "${RECIPES// /}" ] || refuse "RECIPES is empty: name one float8 recipe at least, e.g. RECIPES=tensorwise"
FP8_RUNS=()
for r in $RECIPES; do
    case $r in tensorwise) r=hybrid:tensorwise;; rowwise) r=e4m3:rowwise;; esac
    case $r in hybrid:tensorwise|e4m3:tensorwise|e4m3:rowwise) FP8_RUNS+=("$r");;
        *) refuse "RECIPES=\"$RECIPES\": $r is not one of tensorwise, rowwise, hybrid:tensorwise, e4m3:tensorwise, e4m3:rowwise (rowwise scales need e4m3), e.g. RECIPES=\"tensorwise rowwise\"";; esac
done
DRIFT_WINDOW=${DRIFT_WINDOW:-$((STEPS / 10 + 1)):$((STEPS / 2))}
[[ $DRIFT_WINDOW =~ ^[0-9]+:[0-9]+$ ]] || refuse "DRIFT_WINDOW=$DRIFT_WINDOW: give START:END iterations, e.g. DRIFT_WINDOW=101:500"

if [ "$DEVICE" = cpu ]; then
    # shellcheck disable=SC2207  # the preset's flags, one per line
    MODEL=($(python tools/model_flags.py tiny) --seq-length 64 --max-position-embeddings 64)
    PRECISION=() EMULATE=(--fp8-emulate)
else
    MODEL=(--num-layers 8 --hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 16
           --group-query-attention --num-query-groups 4 --seq-length 4096
           --max-position-embeddings 4096 --position-embedding-type rope --rotary-base 500000
           --swiglu --normalization RMSNorm --disable-bias-linear
           --untie-embeddings-and-output-weights)
    PRECISION=(--bf16) EMULATE=()
fi
TRAIN=(--device "$DEVICE" --micro-batch-size 4 --global-batch-size 4 --train-iters "$STEPS"
       --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1
       --clip-grad 1.0 --seed 1234 --use-distributed-optimizer --eval-iters 0
       --log-interval 50 --save-interval "$SAVE_INTERVAL" "${PRECISION[@]}")

# Runs resume only under the settings they started with.
STAMP="DEVICE=$DEVICE STEPS=$STEPS extra arguments: $*"
OUTPUT_CHUNK=${NOISE_CHUNKS%% *}
mkdir -p "$OUT_DIR/logs" "$CKPT_DIR"
for d in "$OUT_DIR" "$CKPT_DIR"; do
    if [ -f "$d/settings.txt" ] && [ "$(cat "$d/settings.txt")" != "$STAMP" ]; then
        refuse "$d holds runs of '$(cat "$d/settings.txt")', not '$STAMP'; use those settings or a new OUT_DIR and CKPT_DIR"
    fi
done
echo "$STAMP" | tee "$OUT_DIR/settings.txt" > "$CKPT_DIR/settings.txt"

done_iters() {  # the iteration of NAME's latest checkpoint, 0 for none
    local tracker="$CKPT_DIR/checkpoints/$1/latest_checkpointed_iteration.txt"
    if [ -f "$tracker" ]; then cat "$tracker"; else echo 0; fi
}
minutes_left() {  # of TIME_LIMIT_MIN, counted from this script's start
    awk -v limit="$TIME_LIMIT_MIN" -v used="$SECONDS" 'BEGIN { printf "%.3f", limit - used / 60 }'
}
{ echo "--- $(date -u +%Y-%m-%dT%H:%M:%SZ) $(git rev-parse --short HEAD 2>/dev/null || echo no-git) $STAMP"
  [ "$DEVICE" = cpu ] || nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1 || true
  python -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
} >> "$OUT_DIR/driver.log"

NAMES=() PIDS=() FAILED=()
launch() {  # launch NAME [run flags]: train NAME to STEPS from its last checkpoint
    local name=$1; shift
    NAMES+=("$name")
    local from; from=$(done_iters "$name")
    [ "$from" -lt "$STEPS" ] || return 0
    local stop=()
    [ -z "$EXIT_INTERVAL" ] || stop+=(--exit-interval "$EXIT_INTERVAL")
    if [ -n "$TIME_LIMIT_MIN" ]; then
        local left; left=$(minutes_left)
        if awk -v m="$left" 'BEGIN { exit !(m <= 0) }'; then
            echo "$name: no time left this time (at iteration $from)" | tee -a "$OUT_DIR/driver.log"
            return 0
        fi
        stop+=(--exit-duration-in-mins "$left")
    fi
    echo "$name: iteration $from -> $STEPS" | tee -a "$OUT_DIR/driver.log"
    echo "--- $(date -u +%Y-%m-%dT%H:%M:%SZ) from iteration $from" >> "$OUT_DIR/logs/$name.log"
    local ckpt="$CKPT_DIR/checkpoints/$name"
    # One process per run, each its own one-process group (no rendezvous variables).
    env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u MASTER_ADDR -u MASTER_PORT \
        python pretrain_gpt.py "${MODEL[@]}" "${TRAIN[@]}" --save "$ckpt" --load "$ckpt" \
        --data-cache-path "$CKPT_DIR/data_cache/$name" --metrics-file "$OUT_DIR/$name.jsonl" \
        "${stop[@]}" "$@" "${EXTRA[@]}" >> "$OUT_DIR/logs/$name.log" 2>&1 &
    PIDS+=("$!:$name")
    if [ "$PARALLEL" = 0 ]; then collect; fi
}
collect() {  # wait for the launched runs; note the ones that failed
    local entry
    for entry in "${PIDS[@]}"; do
        wait "${entry%%:*}" && continue
        FAILED+=("${entry#*:}")
    done
    PIDS=()
}

EXTRA=("$@")
launch bf16
for n in $NOISE_CHUNKS; do
    launch "bf16_chunk$n" --fused-linear-cross-entropy --linear-cross-entropy-chunk-tokens "$n"
done
FP8_NAMES=() FP8_LABELS=()
for r in "${FP8_RUNS[@]}"; do
    FP8_NAMES+=("fp8_${r%%:*}_${r##*:}") FP8_LABELS+=("fp8 ${r%%:*} ${r##*:}")
    launch "fp8_${r%%:*}_${r##*:}" --fp8-format "${r%%:*}" --fp8-recipe "${r##*:}" \
        --fp8-linears "$FP8_LINEARS" "${EMULATE[@]}"
    if [ "$FP8_OUTPUT_LAYER" = 1 ]; then
        FP8_NAMES+=("fp8_${r%%:*}_${r##*:}_output") FP8_LABELS+=("fp8 ${r%%:*} ${r##*:} output")
        launch "fp8_${r%%:*}_${r##*:}_output" --fp8-format "${r%%:*}" --fp8-recipe "${r##*:}" \
            --fp8-linears "$FP8_LINEARS" --fp8-output-layer --fused-linear-cross-entropy \
            --linear-cross-entropy-chunk-tokens "$OUTPUT_CHUNK" "${EMULATE[@]}"
    fi
done
collect

UNFINISHED=()
for name in "${NAMES[@]}"; do
    at=$(done_iters "$name")
    # keep each run's latest checkpoint only (a resume needs no other)
    for old in "$CKPT_DIR/checkpoints/$name"/iter_*; do
        [ -e "$old" ] && [ "$old" != "$CKPT_DIR/checkpoints/$name/$(printf 'iter_%07d' "$at")" ] &&
            rm -rf "$old"
    done
    echo "$name: at iteration $at of $STEPS" >> "$OUT_DIR/driver.log"
    [ "$at" -ge "$STEPS" ] || UNFINISHED+=("$name at $at")
done
if [ "${#FAILED[@]}" -gt 0 ]; then
    for name in "${FAILED[@]}"; do
        echo "error: run $name failed; its log: $OUT_DIR/logs/$name.log, which ends:" |
            tee -a "$OUT_DIR/driver.log" >&2
        tail -n 15 "$OUT_DIR/logs/$name.log" >&2
    done
    exit 1
fi
if [ "${#UNFINISHED[@]}" -gt 0 ]; then
    list=$(printf ', %s' "${UNFINISHED[@]}")
    echo "unfinished of $STEPS steps: ${list:2}; run the same command again to continue" |
        tee -a "$OUT_DIR/driver.log"
    exit 3
fi

FILES=("$OUT_DIR/bf16.jsonl") LABELS=(bf16 "${FP8_LABELS[@]}") PAIRS=()
for name in "${FP8_NAMES[@]}"; do FILES+=("$OUT_DIR/$name.jsonl"); done
for n in $NOISE_CHUNKS; do PAIRS+=(--noise-pair "$OUT_DIR/bf16.jsonl" "$OUT_DIR/bf16_chunk$n.jsonl"); done
status=0
python tools/compare_loss.py "${FILES[@]}" --labels "${LABELS[@]}" "${PAIRS[@]}" \
    --drift-window "$DRIFT_WINDOW" --summary-json "$OUT_DIR/summary.json" \
    --png "$OUT_DIR/drift.png" --print-every 50 > "$OUT_DIR/compare.txt" 2>&1 || status=$?
sed -n '/^drift from/,$p' "$OUT_DIR/compare.txt"
echo "comparison over iterations $DRIFT_WINDOW: exit status $status" | tee -a "$OUT_DIR/driver.log"
exit "$status"
