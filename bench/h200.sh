#!/usr/bin/env bash
# Runs on the GPU machine (the `device` tool), from the repository root:
#   bash bench/h200.sh STEP...     steps: equal tile kit-quick kit-full negative model prefill bench sweep profile digest
#                                  host family fp8 fp8sm90 prefill-launch fp8moe fp8kv fp8kv-f16 gemm-split decode-launch decode-chain decode-tune tune moe vllm-part
#                                  vllm vllm-moe grpo
#                                  (default: equal tile kit-quick negative model bench)
# Installs this checkout (and the carried stevedore wheel in .whl/) into /tmp/site, then runs
# from outside the checkout so that the installed package (with hal.backends.cuda) is imported.
# The GPU image has no stevedore and no registry access; fetch its wheel here first:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl stevedore==5.10.0
# The GPU machine gets the working tree without .git; the old kernels that `equal` (and bench, sweep)
# compare against come from git history, written here first:
#   bash bench/old_kernels.sh [REF] [DIR]      (default: b7c66ae, the first measured kernels, into .old_kernels)
# and pass carry=[".whl", ".old_kernels"] to the device tool.
# Results go to $OUT (JSON + logs); commit them under bench/results/ with the command used.
#   KIT_EXAMPLES   hypothesis examples per kit test for kit-quick and negative (default 8)
#   KIT_OPS        kit-quick: only these ops, comma-separated (e.g. attention; default all)
#   KIT_SHARDS, KIT_SLICE_TIMEOUT   kit-full: slices run side by side (16, one per core) and each one's limit (480 s)
#   KIT_CONTRACT, KIT_DEPTH   kit-full: the contract (default: the backend's first) and the depth (default --full;
#                  e.g. "--quick --max-examples 4"); the merged report is conformance_cuda_<contract>.json
#   SKIP_INSTALL   set: do not reinstall into /tmp/site (for a second h200.sh run beside a first one)
#   BENCH_ARGS     extra arguments of bench_cuda.py (e.g. --quick)
#   SWEEP_ONLY     speed_sweep.py's steps for `sweep` (default attention), timed by CUDA-graph replay
#   PROFILE_CASES  profile_kernels.py's cases for `profile` (default: all; needs ncu)
#   HOST_ARGS      host_overhead.py's extra arguments for `host` (e.g. "--profile linear_m64")
#   FAMILY_ARGS    family_sweep.py's arguments for `family` (default "--budget-s 300"); with the vLLM bundle
#                  unpacked (a `vllm` or `grpo` step before it, or the parts carried) decode is also timed
#                  against vLLM's FlashAttention-3
#   MOE_ARGS       moe_gpu.py's arguments for `moe` (default "--no-checks --sweep --kernels 1,64,2048,8192");
#                  vLLM's fused MoE is timed beside ours when the bundle (built with KEEP_MOE=1) is unpacked
#   FP8SM90_ARGS   fp8_sm90_gpu.py's arguments for `fp8sm90` (default: bits and speed)
#   FP8MOE_ARGS    fp8_moe_gpu.py's arguments for `fp8moe` (default "--model"); FP8MOE_KIT=0 skips its kit cells
#   PREFILL_LAUNCH_ARGS prefill_launch_gpu.py's arguments for `prefill-launch` (e.g. "--budget-s 120")
#   FP8KV_F16_ARGS fp8_kv_f16_gpu.py's arguments for `fp8kv-f16` (e.g. "--only bits --budget-s 120")
#   GEMM_SPLIT_ARGS gemm_split_gpu.py's arguments for `gemm-split` (e.g. "--ms 1,16 --budget-s 120")
#   DECODE_LAUNCH_ARGS  decode_launch_gpu.py's arguments for `decode-launch` (e.g. --variants default,spp2)
#   DECODE_CHAIN_ARGS   decode_chain_gpu.py's arguments for `decode-chain` (e.g. "--batches 1 --contexts 64,512")
#   TUNE_MODEL, TUNE_ARGS   `tune`: the config.json (repository path) and hal tune's other arguments
#   DECODE_TUNE_ARGS    decode_tune_gpu.py's arguments for `decode-tune` (e.g. "--heads 32/8/128 --budget-s 300");
#                  with the vLLM bundle unpacked, vLLM's FlashAttention-3 is timed beside SDPA
#   FP8_ARGS       fp8_gpu.py's arguments for `fp8` (default "--quick"); FP8_TAG names its files; with the vLLM
#                  bundle unpacked its block-FP8 GEMMs are timed beside ours; HAL_TUNE_CACHE (tune section's
#                  --tune-cache) is where its tuning cache goes / is read
set -uo pipefail
steps=${*:-equal tile kit-quick negative model bench}
repo=$(pwd)
out=${OUT:-/tmp/out}
mkdir -p "$out"
if [ -z "${SKIP_INSTALL:-}" ]; then  # SKIP_INSTALL=1: a second h200.sh beside a running one reuses its install
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd /tmp
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv | tee "$out/gpu.txt"
python3 -m hal.cli doctor > "$out/doctor.txt"
status=0
vllm_env() {  # the GPU vLLM bundle unpacked into /tmp/site (once per machine) and the variables it needs
  if [ ! -d /tmp/site/vllm ]; then
    (cd /tmp/vllm-parts && sha256sum -c SHA256SUMS) && cat /tmp/vllm-parts/part.* | xz -d | tar -x -C /tmp/site || return 1
  fi
  export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kit/triton}
}
for step in $steps; do
  echo "== $step"
  case $step in
    equal) # the current kernels against the old ones in .old_kernels (bench/old_kernels.sh): bitwise equal
           python3 "$repo/bench/equal_v0.py" --base "$repo/.old_kernels" ${EQUAL_ARGS:-} --json "$out/equal_v0.json" > "$out/equal_v0.log" 2>&1 || status=1
           tail -n 5 "$out/equal_v0.log" ;;
    tile) python3 "$repo/bench/tile_freedom.py" --json "$out/tile_freedom.json" > "$out/tile_freedom.log" 2>&1 || status=1
          tail -n 20 "$out/tile_freedom.log" ;;
    kit-quick) python3 -m hal.cli conformance --backend cuda --quick --max-examples "${KIT_EXAMPLES:-8}" ${KIT_OPS:+--op "$KIT_OPS"} \
                 --json "$out/conformance_cuda_quick.json" > "$out/conformance_cuda_quick.log" 2>&1 || status=1
               grep -E '^\||CONFORM|passed|failed' "$out/conformance_cuda_quick.log" | tail -n 30 ;;
    kit-full) # full depth in KIT_SHARDS slices run side by side (the kit's time is mostly host-side: compiles
              # and checks), sharing one Triton cache; each slice stops at KIT_SLICE_TIMEOUT seconds and keeps
              # what it finished (reports are written after every test): run the step again on the same warm
              # machine to resume the unfinished slices, then the merged report is complete.
              n=${KIT_SHARDS:-16}; kit=/tmp/kit/${KIT_CONTRACT:-default}; mkdir -p "$kit"
              report="$out/conformance_cuda_${KIT_CONTRACT:-full}"
              export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$kit/triton}
              for i in $(seq 1 "$n"); do
                # one OpenMP thread per slice: 12 slices with 16 threads each on 16 cores spin against each other
                OMP_NUM_THREADS=1 timeout "${KIT_SLICE_TIMEOUT:-480}" python3 -m hal.cli conformance --backend cuda \
                  ${KIT_CONTRACT:+--contract "$KIT_CONTRACT"} ${KIT_DEPTH:---full} --shard "$i/$n" --resume "$kit/shard_$i.json" > "$kit/shard_$i.log" 2>&1 &
              done
              wait
              python3 -m hal.cli conformance merge "$kit"/shard_*.json -o "$report.json" > "$report.log" 2>&1 || status=1
              tar czf "$out/kit_shards_${KIT_CONTRACT:-full}.tgz" -C "$kit" $(cd "$kit" && ls shard_*)
              grep -E '^\||CONFORM|INCOMPLETE|tests run' "$report.md" | tail -n 30 ;;
    negative) # stock kernels on the GPU: which levels they fail (a fact about cuBLAS / SDPA, not a test of ours)
              python3 -m hal.cli conformance --backend torch --max-examples "${KIT_EXAMPLES:-8}" \
                --json "$out/conformance_torch.json" > "$out/conformance_torch.log" 2>&1
              grep -E '^\||CONFORM' "$out/conformance_torch.log" ;;
    model) timeout ${MODEL_TIMEOUT:-300} python3 "$repo/bench/model_equality.py" --json "$out/model_equality.json" \
             > "$out/model_equality.log" 2>&1 || status=1
           tail -n 5 "$out/model_equality.log" ;;
    prefill) # one prefill step's ops against the stock ones (bench/prefill_step.py; PREFILL_ARGS)
             (cd "$repo/bench" && python3 prefill_step.py ${PREFILL_ARGS:-} --json "$out/prefill_step.json") \
               > "$out/prefill_step.log" 2>&1 || status=1
             tail -n 40 "$out/prefill_step.log" ;;
    bench) python3 "$repo/bench/bench_cuda.py" ${BENCH_ARGS:-} --json "$out/bench_cuda.json" > "$out/bench_cuda.log" 2>&1 || status=1
           tail -n 45 "$out/bench_cuda.log" ;;
    sweep) (cd "$repo/bench" && python3 speed_sweep.py --graph --only "${SWEEP_ONLY:-attention}" \
              --json "$out/sweep.json") > "$out/sweep.log" 2>&1 || status=1
           grep -vE '^(out of resources|graph capture)' "$out/sweep.log" | tail -n 40 ;;
    profile) # reports stay on the machine (the device tool returns few files): JSON, log and the CSVs in one archive
             python3 "$repo/bench/profile_kernels.py" --out /tmp/profile ${PROFILE_CASES:+--cases $PROFILE_CASES} \
               > "$out/profile.log" 2>&1 || status=1
             cp /tmp/profile/profile.json "$out/" 2>/dev/null
             tar czf "$out/profile_csv.tgz" -C /tmp/profile $(cd /tmp/profile && ls *.csv *.log 2>/dev/null)
             tail -n 40 "$out/profile.log" ;;
    vllm-part) # the GPU vLLM bundle comes in two parts of <= 48 MiB, one per call (carry .vllm-part0, then
               # .vllm-part1 within the warm window); each call keeps its part in /tmp/vllm-parts
               mkdir -p /tmp/vllm-parts; cp "$repo"/.vllm-part*/part.* "$repo"/.vllm-part*/SHA256SUMS /tmp/vllm-parts/ 2>/dev/null
               ls -l /tmp/vllm-parts ;;
    vllm) # unpack the bundle (../shared/tools/vllm-gpu/README.md), then bench/vllm_gpu.py with VLLM_BENCH_ARGS;
          # VLLM_TAG names this run's files (several runs in one call)
          vllm_env || { status=1; continue; }
          tag=${VLLM_TAG:-run}; work=/tmp/vllm-gpu-bench
          python3 "$repo/bench/vllm_gpu.py" ${VLLM_BENCH_ARGS:-} --workdir "$work" --json "$out/vllm_gpu_$tag.json" \
            > "$out/vllm_gpu_$tag.log" 2>&1 || status=1
          (cd "$work" && tar czf "$out/vllm_engine_logs_$tag.tgz" *.log $(ls *.profile.txt 2>/dev/null))
          tail -n 40 "$out/vllm_gpu_$tag.log" ;;
    vllm-moe) # vLLM's fused-MoE op library, which the two-part bundle leaves out: .vllm-moe/moe_C.so.xz (+ SHA256SUMS),
              # carried in a third call after the two parts (extracted from a KEEP_MOE=1 bundle, xz -9e)
              vllm_env || { status=1; continue; }
              (cd "$repo/.vllm-moe" && sha256sum -c SHA256SUMS) \
                && xz -d -c "$repo/.vllm-moe/moe_C.so.xz" > /tmp/site/vllm/_moe_C_stable_libtorch.abi3.so || status=1 ;;
    host) python3 "$repo/bench/host_overhead.py" ${HOST_ARGS:-} --json "$out/host_overhead.json" > "$out/host_overhead.log" 2>&1 || status=1
          grep -vE '^ +[0-9]' "$out/host_overhead.log" | tail -n 30 ;;
    family) [ -d /tmp/vllm-parts ] && { vllm_env || true; }
            (cd "$repo/bench" && python3 family_sweep.py ${FAMILY_ARGS:---budget-s 300} --json "$out/family_sweep.json") \
              > "$out/family_sweep.log" 2>&1 || status=1
            tail -n 25 "$out/family_sweep.log" ;;
    fp8) [ -d /tmp/vllm-parts ] && { vllm_env || true; }
         tag=${FP8_TAG:-run}
         python3 "$repo/bench/fp8_gpu.py" ${FP8_ARGS:---quick} --tune-cache "${HAL_TUNE_CACHE:-/tmp/fp8_tune.json}" \
           --json "$out/fp8_gpu_$tag.json" > "$out/fp8_gpu_$tag.log" 2>&1 || status=1
         cp "${HAL_TUNE_CACHE:-/tmp/fp8_tune.json}" "$out/" 2>/dev/null
         grep -vE '^\[' "$out/fp8_gpu_$tag.log" | tail -n 60 ;;
    attention-ab) # the current attention kernel against .old_kernels (bench/old_kernels.sh REF): bits, and time (AB_ARGS)
                  (cd "$repo/bench" && python3 attention_ab_gpu.py --base "$repo/.old_kernels" ${AB_ARGS:-} \
                     --json "$out/attention_ab.json") > "$out/attention_ab.log" 2>&1 || status=1
                  tail -n 25 "$out/attention_ab.log" ;;
    prefill-launch) # prefill attention launch shapes (bench/prefill_launch_gpu.py): bits against the default, speed vs SDPA flash
                    (cd "$repo/bench" && python3 prefill_launch_gpu.py ${PREFILL_LAUNCH_ARGS:-} --json "$out/prefill_launch.json") \
                      > "$out/prefill_launch.log" 2>&1 || status=1
                    tail -n 12 "$out/prefill_launch.log" ;;
    fp8sm90) # the Gluon block-FP8 GEMM (hal/kernels/fp8_gemm_sm90.py): bits against the Triton kernel, speed (FP8SM90_ARGS)
             python3 "$repo/bench/fp8_sm90_gpu.py" ${FP8SM90_ARGS:-} --json "$out/fp8_sm90_gpu.json" > "$out/fp8_sm90_gpu.log" 2>&1 || status=1
             grep -vE '^(bits|speed) M=' "$out/fp8_sm90_gpu.log" | tail -n 40 ;;
    fp8moe) # block-FP8 experts (hal/kernels/fp8_moe.py): bit checks, timing against our bf16 experts and (bundle
            # unpacked) vLLM's fused FP8 MoE, then the kit's FP8 cells under bf16-moe-fp8-v1 (FP8MOE_ARGS)
            [ -d /tmp/vllm-parts ] && { vllm_env || true; }
            timeout "${FP8MOE_TIMEOUT:-330}" python3 "$repo/bench/fp8_moe_gpu.py" ${FP8MOE_ARGS:---model} --json "$out/fp8_moe_gpu.json" \
              > "$out/fp8_moe_gpu.log" 2>&1 || status=1
            grep -vE '^\{' "$out/fp8_moe_gpu.log" | tail -n 30
            [ "${FP8MOE_KIT:-1}" = 0 ] && continue    # FP8MOE_KIT=0: the bench only (e.g. --sweep)
            timeout "${KIT_TIMEOUT:-200}" python3 -m hal.cli conformance --backend cuda --contract bf16-moe-fp8-v1 --op fp8_moe_experts,fp8_linear \
              --quick --max-examples "${KIT_EXAMPLES:-8}" --json "$out/conformance_cuda_moe_fp8.json" \
              > "$out/conformance_cuda_moe_fp8.log" 2>&1 || status=1
            grep -E '^\||CONFORM|passed|failed' "$out/conformance_cuda_moe_fp8.log" | tail -n 8 ;;
    fp8kv) # the FP8 KV cache: write / read bit checks and decode speed against the bf16 cache (FP8KV_ARGS)
           python3 "$repo/bench/fp8_kv_gpu.py" ${FP8KV_ARGS:-} --json "$out/fp8_kv_gpu.json" > "$out/fp8_kv_gpu.log" 2>&1 || status=1
           tail -n 30 "$out/fp8_kv_gpu.log" ;;
    fp8kv-f16) # bf16-fp8-v2's f16-operand FP8 KV read: launch / phase bit checks, decode speed vs the bf16 cache (FP8KV_F16_ARGS)
           python3 "$repo/bench/fp8_kv_f16_gpu.py" ${FP8KV_F16_ARGS:-} --json "$out/fp8_kv_f16_gpu.json" > "$out/fp8_kv_f16_gpu.log" 2>&1 || status=1
           tail -n 40 "$out/fp8_kv_f16_gpu.log" ;;
    gemm-split) # split-K for narrow weight-read-bound GEMMs (bench/gemm_split_gpu.py): bits vs the direct launch, speed vs cuBLAS
           python3 "$repo/bench/gemm_split_gpu.py" ${GEMM_SPLIT_ARGS:-} --json "$out/gemm_split.json" > "$out/gemm_split.log" 2>&1 || status=1
           tail -n 12 "$out/gemm_split.log" ;;
    decode-launch) # decode attention's launch choices (register caps, stages, splits) over bf16 and FP8 caches
           python3 "$repo/bench/decode_launch_gpu.py" ${DECODE_LAUNCH_ARGS:-} --json "$out/decode_launch.json" > "$out/decode_launch.log" 2>&1 || status=1
           tail -n 60 "$out/decode_launch.log" ;;
    decode-chain) # small-batch decode's time against the chunks one program walks (bench/decode_chain_gpu.py; DECODE_CHAIN_ARGS)
                  [ -d /tmp/vllm-parts ] && { vllm_env || true; }
                  (cd "$repo/bench" && python3 decode_chain_gpu.py ${DECODE_CHAIN_ARGS:-} --json "$out/decode_chain.json") \
                    > "$out/decode_chain.log" 2>&1 || status=1
                  grep -vE '^\[' "$out/decode_chain.log" | tail -n 60 ;;
    tune) # `hal tune` on a model config (TUNE_MODEL, default bench/configs/qwen3-1.7b.json; TUNE_ARGS): the launch
          # search with every candidate bit-checked, its cache and report kept
          python3 -m hal.cli tune --model "$repo/${TUNE_MODEL:-bench/configs/qwen3-1.7b.json}" ${TUNE_ARGS:-} \
            --cache "$out/tune_cache.json" --report "$out/tune_report.json" > "$out/tune.log" 2>&1 || status=1
          tail -n 30 "$out/tune.log" ;;
    decode-tune) # decode attention's launch search (hal tune's decode cells): every candidate bit-checked, timed,
           # vs SDPA and, with the vLLM bundle's parts carried (vllm-part), vLLM's FlashAttention-3
           [ -d /tmp/vllm-parts ] && { vllm_env || true; }
           python3 "$repo/bench/decode_tune_gpu.py" ${DECODE_TUNE_ARGS:-} --json "$out/decode_tune.json" \
             --cache "$out/decode_tune_cache.json" > "$out/decode_tune.log" 2>&1 || status=1
           tail -n 40 "$out/decode_tune.log" ;;
    moe) [ -d /tmp/vllm-parts ] && { vllm_env || true; }
         python3 "$repo/bench/moe_gpu.py" ${MOE_ARGS:---no-checks --sweep --kernels 1,64,2048,8192} \
           --json "$out/moe_gpu.json" > "$out/moe_gpu.log" 2>&1 || status=1
         cp "$out/moe_gpu.json" /tmp/moe_gpu_last.json 2>/dev/null   # for a later call's --best-from
         grep -vE '^\{' "$out/moe_gpu.log" | tail -n 60 ;;
    digest) python3 "$repo/bench/digest_gpu.py" --json "$out/digest_gpu.json" > "$out/digest_gpu.log" 2>&1 || status=1
            tail -n 20 "$out/digest_gpu.log" ;;
    grpo) # the GPU recipe (recipes/grpo-h200.yaml) with GPU vLLM rollouts; GRPO_ARGS: recipe overrides
          # (e.g. "resume=true" to continue a run this machine checkpointed); GRPO_TIMEOUT: seconds (540)
          vllm_env || { status=1; continue; }
          timeout "${GRPO_TIMEOUT:-540}" python3 -m hal.cli run "$repo/recipes/grpo-h200.yaml" output_dir=/tmp/runs/grpo-h200 \
            ${GRPO_ARGS:-} > "$out/grpo_h200.log" 2>&1 || status=1
          cp /tmp/runs/grpo-h200/metrics.jsonl /tmp/runs/grpo-h200/report.md "$out/" 2>/dev/null
          tail -n 30 "$out/grpo_h200.log" ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
