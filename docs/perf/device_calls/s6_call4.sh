#!/usr/bin/env bash
# 2026-12-02, device call 4 (ONE H200, <= 120 s): the two GPU-only bugs call 3 found, fixed:
#   (1) a resumed bf16 run died in PyTorch's fused AdamW ("state_steps is on cpu": the restored
#       Adam step must sit on the parameter's device for fused param groups): the sequence of
#       tests/gpu/test_bf16_grad_buffer_gpu.py[fp32-buffer], its runs two at a time;
#   (2) --use-precision-aware-optimizer without TransformerEngine raised TypeError inside
#       megatron-core's OptimizerConfig: tools/gpu_long_sequence_check.py's optimizer-offload
#       cases (HybridDeviceOptimizer, save at step 3, resume to 6).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log; echo "start $(date -u +%FT%TZ)" > $LOG
( timeout 110 python3 tools/gpu_long_sequence_check.py --cases full optimizer_offload optimizer_offload_resumed \
    --out $OUT/long_seq_offload.json > /tmp/lsc.log 2>&1; echo "offload check rc=$? t=$SECONDS" >> $LOG ) &
A="--num-layers 2 --hidden-size 256 --num-attention-heads 4 --group-query-attention --num-query-groups 2
 --seq-length 512 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
 --untie-embeddings-and-output-weights --mock-data --vocab-size 1024 --micro-batch-size 1
 --global-batch-size 4 --train-iters 8 --lr 1e-3 --lr-warmup-iters 2 --seed 1234 --bf16
 --use-distributed-optimizer --eval-iters 0 --num-workers 0 --log-interval 4 --device cuda"
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT
D=/tmp/bf; mkdir -p $D/same $D/switched
run() { local name=$1; shift; timeout 50 python3 pretrain_gpt.py $A "$@" --metrics-file $OUT/$name.jsonl > $D/$name.log 2>&1
        echo "$name rc=$? t=$SECONDS" >> $LOG; grep -v -i warn $D/$name.log | tail -4 | cut -c1-400 >> $LOG; }
# (one-process runs use an in-memory store: no port)
run straight & S=$!
run first --save $D/ckpt --exit-interval 4
wait $S
cp -r $D/ckpt $D/same/ckpt; cp -r $D/ckpt $D/switched/ckpt
run same --load $D/same/ckpt --save $D/same/ckpt & S=$!
run switched --grad-reduce-in-bf16 --load $D/switched/ckpt --save $D/switched/ckpt
wait
grep -v -i warn /tmp/lsc.log | tail -5 >> $LOG
echo "end t=$SECONDS" >> $LOG
