#!/usr/bin/env bash
# One call on the lent GPU machine (Python 3.12 + its own torch, no internet): install the package
# with the CUDA extension, then run the chosen steps, results under $OUT.
#   scripts/device_run.sh tests kernels bench engine serve spec spec_engine grammar chunk prefix pdl ncu sass profile verify_profile ab replays issue15 patch
#   NO_BUILD=1 VARIANTS="main a.patch b.patch" scripts/device_run.sh builds pack
# `pack` last: everything under $OUT in one results.tgz (the device tool brings back a few files only).
# Wheels for packages missing there travel in .whl/ (scripts/device_wheels.sh fetches them);
# `scripts/make_bench_model.py` writes the weight-less exact-shape model directories (.bench/)
# that `serve` uses.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ninfer-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
build() {  # the package with its CUDA extension, for CUDAARCHS (default sm_90)
  local start=$SECONDS
  CUDAARCHS=${CUDAARCHS:-90} python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -5
  echo "== install + CUDA build: $((SECONDS - start)) s"
}
cuda_tests() {  # the CUDA tests in TESTS into $1, 4 processes on the one GPU where pytest-xdist is (its wheel and execnet's in .whl/)
  local workers=""
  python3 -c "import xdist" 2>/dev/null && workers="-n ${TEST_WORKERS:-4}"
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -m cuda -q -rs -p no:cacheprovider --continue-on-collection-errors \
    $workers ${TESTS:-tests/} 2>&1 | tee "$1" | grep -vE "^(SKIPPED|PASSED)" | tail -60
}
replays() {  # decode graph replays of this build into $1 (preset $2, batch:context runs $3), two rounds
  timeout 200 python3 scripts/ab_replays.py "$1" X=0 --preset "$2" --runs "$3" --rounds 2 2>&1 \
    | tee -a "$OUT/replays.log" | grep "^{" || { echo "== replays $2 $3 failed:"; tail -n 8 "$OUT/replays.log"; }
}
bench_model() {  # the weight-less exact-shape 35B model directory `serve` and the engine benches load
  [ -d .bench/qwen3.6-35b-a3b ] || python3 scripts/make_bench_model.py qwen3.6-35b-a3b .bench/qwen3.6-35b-a3b
}
start_server() {  # `ninfer serve` of the model directory $1 on port 8123, its log in $2; $server: its pid, once ready
  # python itself in the background (not the `ninfer` function's subshell), so `kill` stops the server
  python3 -m ninfer_app serve "$1" --random-weights --device cuda --max-concurrency 8 --port 8123 > "$2" 2>&1 &
  server=$!
  for _ in $(seq 1 180); do curl -sf http://127.0.0.1:8123/health >/dev/null && grep -q ready "$2" && break; sleep 1; done
}
if [ -n "${NO_BUILD:-}" ]; then
  echo "== NO_BUILD: no install of this tree (the builds step builds its own copies)"
elif [ -z "${REBUILD:-}" ] && python3 -c "import ninfer_core._C" 2>/dev/null; then
  echo "== extension already built on this (warm) machine; REBUILD=1 forces a build"
else
  build
fi
ninfer() { python3 -m ninfer_app "$@"; }
. scripts/device_lib.sh  # variant, queue_test_args

for step in "$@"; do
  echo "== step $step"
  case $step in
  tests)
    cuda_tests "$OUT/pytest_cuda.log" ;;
  kernels)
    for k in quant moe gdn attention sampling; do
      timeout 300 python3 scripts/bench_$k.py "$OUT/kernel_$k.json" > "$OUT/kernel_$k.log" 2>&1
      echo "== kernel bench $k: rc $?"; tail -30 "$OUT/kernel_$k.log"
    done ;;
  bench)
    # name | preset | flags: the default recipe (int4 + graphs), other recipes, the eager bf16
    # baseline; BENCHES="name ..." picks some (default: all)
    while IFS='|' read -r name preset flags; do
      case " ${BENCHES:-$name} " in *" $name "*) ;; *) continue ;; esac
      timeout 300 python3 -m ninfer_app bench --synthetic "$preset" --device cuda --json $flags \
        > "$OUT/bench_$name.json" 2> "$OUT/bench_$name.err"
      echo "== bench $name: rc $? $(tail -c 300 "$OUT/bench_$name.json") $(tail -2 "$OUT/bench_$name.err")"
    done <<'LIST'
35b_int4|qwen3.6-35b-a3b|
35b_int8|qwen3.6-35b-a3b|--weights int8 --prefill 8k --contexts 4k --batches 1
35b_bf16|qwen3.6-35b-a3b|--weights bf16 --prefill 8k --contexts 4k --batches 1
35b_bf16_eager|qwen3.6-35b-a3b|--weights bf16 --no-cuda-graphs --prefill 8k --contexts 4k --batches 1
35b_int4_fp8kv|qwen3.6-35b-a3b|--kv-dtype fp8 --prefill none --contexts 4k,32k --batches 1
27b_int4|qwen3.6-27b|--prefill 512,8k --batches 1,8
LIST
    ;;
  engine)
    # TTFT per prompt length (first / repeat) and decode through the engine loop vs the GPU step
    bench_model
    NINFER_REQUIRE_KERNELS=1 timeout 400 python3 -m ninfer_app bench engine .bench/qwen3.6-35b-a3b --random-weights \
      --json ${ENGINE_FLAGS:-} > "$OUT/engine_35b.json" 2> "$OUT/engine_35b.err"
    echo "== bench engine: rc $? $(cat "$OUT/engine_35b.json") $(tail -3 "$OUT/engine_35b.err")" ;;
  serve)
    # the served path: `ninfer serve` + `ninfer bench serve` (saturation at 1 and 8 clients, TTFT)
    bench_model
    start_server .bench/qwen3.6-35b-a3b "$OUT/serve.log"
    # the first request's host time, sampled (py-spy travels as a wheel in .whl/ from `device_wheels.sh --profile`)
    if [ -x /tmp/site/bin/py-spy ]; then
      /tmp/site/bin/py-spy record --subprocesses -p $server -r 1000 -d 4 -f raw -o "$OUT/serve_first_request.txt" --threads --nonblocking \
        > /dev/null 2>&1 &
      sleep 1
    fi
    # with this call's engine report (the engine or issue15 step before this one), each figure over the engine's too
    engine_ref=""
    for f in "$OUT/engine_35b.json" "$OUT/issue15_engine.json"; do [ -s "$f" ] && engine_ref="--engine $f" && break; done
    # TTFT per prompt length: first sight right after start (before the other runs), repeats, the same prompt again (prefix cached)
    timeout 200 python3 -m ninfer_app bench serve --url http://127.0.0.1:8123 --mode ttft --greedy $engine_ref \
      --lengths ${TTFT_LENGTHS:-37,128,512,2048,8192} --out "$OUT/serve_ttft_lengths.json" 2>&1 | tail -6
    for sampling in ${SERVE_SAMPLING:---greedy --no-greedy}; do
      name=${sampling#--}
      timeout 200 python3 -m ninfer_app bench serve --url http://127.0.0.1:8123 --mode saturation --concurrency 1,8 --interval 0.2 \
        --prompt-tokens 512 --max-tokens 256 $sampling $engine_ref --out "$OUT/serve_sat_$name.json" 2>&1 | tail -8
      timeout 120 python3 -m ninfer_app bench serve --url http://127.0.0.1:8123 --mode corpus --concurrency 1 \
        --synthetic 6 --prompt-tokens ${TTFT_PROMPT:-512} --max-tokens 8 $sampling --out "$OUT/serve_ttft_$name.json" 2>&1 | tail -4
    done
    kill $server; wait $server; tail -5 "$OUT/serve.log" ;;
  pdl)
    # programmatic dependent launch off / on, alternating (csrc/launch.cuh; NINFER_PDL=0 turns it off)
    for round in 1 2; do
      for pdl in 0 1; do
        NINFER_PDL=$pdl timeout 200 python3 -m ninfer_app bench --synthetic qwen3.6-35b-a3b --device cuda --json \
          --prefill 512 --contexts 4k --batches 1,8 > "$OUT/pdl${pdl}_round$round.json" 2> "$OUT/pdl${pdl}.err"
        echo "== pdl $pdl round $round: rc $? $(tail -c 400 "$OUT/pdl${pdl}_round$round.json")"
      done
    done
    NINFER_PDL=1 timeout 200 python3 scripts/profile_decode.py qwen3.6-35b-a3b > "$OUT/pdl_profile.txt" 2>&1
    head -12 "$OUT/pdl_profile.txt" ;;
  ncu)
    # Nsight Compute on the decode step's GEMVs, router and MoE kernels (stall reasons, occupancy,
    # speed of light) at NCU_TOKENS rows (default 1; NCU_FLAGS=--dense: the 27B's GEMVs; --grouped: the
    # grouped MoE GEMVs of an NCU_TOKENS-token prompt); Firecracker
    # machines read the counters, gVisor ones cannot (device KINDS.md); NCU_EXTRA: more ncu flags
    # (`--section SourceCounters`: the stall samples by instruction, where the machine samples them)
    timeout 400 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy \
      --section LaunchStats --section MemoryWorkloadAnalysis --section InstructionStats --section SchedulerStats ${NCU_EXTRA:-} \
      -k regex:"quant_gemv|gate_up|down_|router_kernel|align_kernel" \
      python3 scripts/ncu_decode_kernels.py --tokens ${NCU_TOKENS:-1} ${NCU_FLAGS:-} > "$OUT/ncu.txt" 2>&1
    echo "== ncu: rc $?"; grep -E "quant_gemv|gate_up|down_|router_kernel|Duration|DRAM Throughput|Issue Slots|Eligible Warps|Warp Cycles Per Issued" \
      "$OUT/ncu.txt" | head -${NCU_LINES:-60}
    [ -n "${NCU_NAME:-}" ] && mv "$OUT/ncu.txt" "$OUT/ncu_$NCU_NAME.txt" ;;
  sass)
    # the extension's SASS (cuobjdump from the toolkit there; none here), gzipped: a kernel's loops
    # and their instructions with `scripts/sass_loops.py sass.txt.gz KERNEL_REGEX`
    cuobjdump -sass "$(python3 -c 'import ninfer_core._C as c; print(c.__file__)')" | gzip > "$OUT/sass.txt.gz"
    echo "== sass: $(zcat "$OUT/sass.txt.gz" | grep -c 'Function :') kernels" ;;
  moe)
    timeout 400 python3 scripts/bench_moe_triton.py ${MOE_TOKENS:+--tokens $MOE_TOKENS} ${MOE_FLAGS:-} --json "$OUT/moe_triton.json" \
      2>&1 | tail -16 ;;
  chunk)
    timeout 120 python3 scripts/bench_chunk_attention.py --json "$OUT/chunk_attention.json" 2>&1 | tail -8 ;;
  prefix)
    # issue 14: TTFT with the prefix cache on / off (chat to 32K tokens, agent with a 20K prefix)
    bench_model
    NINFER_REQUIRE_KERNELS=1 timeout 400 python3 scripts/bench_prefix.py .bench/qwen3.6-35b-a3b --random-weights \
      --device cuda ${PREFIX_FLAGS:-} --json "$OUT/prefix_35b.json" 2>&1 | tail -40 ;;
  prefill)
    timeout 300 python3 scripts/profile_prefill.py qwen3.6-35b-a3b --lengths ${PREFILL_LENGTHS:-37,128,512} \
      --json "$OUT/prefill_35b.json" 2>&1 | tail -80 ;;
  profile)
    # each PROFILES entry preset:batch:context (default the 35B at batch 1, 4K): the eager step's kernels,
    # then one graph replay's timeline and its table by kernel kind (time, bytes, bandwidth)
    for run in ${PROFILES:-qwen3.6-35b-a3b:1:4096}; do
      IFS=: read -r preset batch context <<< "$run"
      timeout 300 python3 scripts/profile_decode.py "$preset" --batch "$batch" --context "$context" \
        --timeline "$OUT/timeline_${preset}_b${batch}_${context}.json" \
        --json "$OUT/profile_${preset}_b${batch}_${context}.json" > "$OUT/profile_${preset}_b${batch}_${context}.txt" 2>&1
      grep -E "^\||graph step|timeline:" "$OUT/profile_${preset}_b${batch}_${context}.txt"
    done ;;
  verify_profile)
    # where a K = 3 verify round's time goes (1.87x the decode step on the H100, against 1.59x for a
    # batch-4 step that reads the same weights): its kernels, then a batch-4 decode step's
    timeout 200 python3 scripts/bench_spec.py profile --weights int4 --max-k 3 --repeats 5 \
      --json "$OUT/verify_profile.json" 2>&1 | tail -60
    timeout 300 python3 scripts/profile_decode.py qwen3.6-35b-a3b --batch 4 --context 512 \
      --json "$OUT/profile_qwen3.6-35b-a3b_b4_512.json" 2>&1 | tail -30 ;;
  ab)
    # one environment switch off / on in the same call (AB_ENV=NAME, set to 0 / 1; default NINFER_PDL):
    # the GEMV shapes and the decode profile
    for v in 0 1; do
      env "${AB_ENV:-NINFER_PDL}=$v" timeout 200 python3 scripts/bench_quant.py "$OUT/ab_quant_$v.json" \
        --rows ${AB_ROWS:-1,4} --shapes ${AB_SHAPES:-o_proj,qkv,gdn_in_proj,lm_head} 2>&1 | tail -12
      env "${AB_ENV:-NINFER_PDL}=$v" timeout 200 python3 scripts/profile_decode.py qwen3.6-35b-a3b \
        --json "$OUT/ab_profile_$v.json" 2>&1 | head -8
    done ;;
  replays)
    # decode graph replays under AB_VARIANTS (space-separated, each NAME=VALUE[,...]) in one process
    timeout ${AB_TIMEOUT:-400} python3 scripts/ab_replays.py "$OUT/ab_replays.json" $AB_VARIANTS \
      --preset ${AB_PRESET:-qwen3.6-35b-a3b} --runs ${AB_RUNS:-1:4096,8:512} --rounds ${AB_ROUNDS:-2} 2>&1 | grep "^{" ;;
  patch)
    # A/B of a change against this tree in one call: replays of this build, then PATCH (a `git diff`
    # file that travels untracked) applied, rebuilt, TESTS run, and the replays again
    # (AB_PRESET / AB_RUNS as for `replays`; both builds' JSON under $OUT)
    replays "$OUT/patch_before.json" ${AB_PRESET:-qwen3.6-35b-a3b} ${AB_RUNS:-1:4096,8:512}
    { git apply "${PATCH:?PATCH=file.patch}" || patch -p1 < "$PATCH"; } > "$OUT/patch_apply.log" 2>&1 \
      || { echo "== patch: does not apply"; cat "$OUT/patch_apply.log"; continue; }
    build
    cuda_tests "$OUT/patch_pytest.log"
    replays "$OUT/patch_after.json" ${AB_PRESET:-qwen3.6-35b-a3b} ${AB_RUNS:-1:4096,8:512} ;;
  builds)
    # A/B of several changes in one call, without installing this tree (run with NO_BUILD=1): each
    # VARIANTS entry ("main" or a `git diff` file: untracked, or queued in scripts/device_queue/;
    # "a.patch+b.patch" applies both) is a copy of the tracked files, patched and built in
    # parallel; then the replays of each, the variants alternating in
    # every round (AB_ROUNDS; PRESETS: preset=batch:context,... entries); before them the GPU tests
    # that NAME.tests lists (one pytest argument a line: `-k` and its expression on two lines), run in
    # NAME's copy; after them, with ENGINE_ROUNDS=N, `bench engine` (the engine loop: TPOT at batch 1
    # and 8 or ENGINE_BATCHES=1,5,8, TTFT of 37 tokens or ENGINE_LENGTHS=37,128,...) of each build, alternating, N rounds. Make each patch against this tree's HEAD: a patch
    # that does not apply (or a copy that does not build) is left out with its log, never timed on
    # the torch references (NINFER_REQUIRE_KERNELS=1). "main" is this working tree, uncommitted
    # edits included. AB_VARIANTS: ab_replays.py's settings, each build timed under each (default X=0).
    # MOE_ROUNDS=N: then bench_moe_triton.py (MOE_TOKENS, MOE_PATHS, MOE_FLAGS) of each build, alternating, N rounds.
    # VERIFY_ROUNDS=N: then bench_spec.py verify (K = 1..3 verify rounds against the decode step) likewise;
    # SPEC_ENGINE_ROUNDS=N: bench_spec.py engine (the engine loop's MTP rounds, batch 1 and 8) likewise
    # (SPEC_PROFILE_TOKENS=N: then batch 1 under the profiler; SPEC_TRACE=1: its traces too).
    # MAIN_TESTS="tests/a.py tests/b.py": main's GPU tests in its copy, before the patches' ones (a
    # combined build runs its parts' lists together); NO_TESTS=1: none.
    # SAMPLING_ROUNDS=N: bench_sampling.py (the sampler kernel at 248k tokens) likewise.
    # STEP_ROUNDS=N: the decode step by kernel kind (STEP_RUNS) likewise, then the builds side by side;
    # VERIFY_PROFILE_ROUNDS=N: the K = 3 verify round and the decode step by kernel kind likewise.
    # SERVE_ROUNDS=N: `ninfer serve` from each copy and `bench serve` against it (TTFT per SERVE_LENGTHS, one client's decode).
    # REUSE_BUILDS=1 (a later call on the same warm machine): copies built before are not built again.
    # an editable install of this tree (an earlier step on a warm machine) would shadow the copies
    python3 -m pip uninstall -y -q ninfer > /dev/null 2>&1
    for v in ${VARIANTS:?VARIANTS="main a.patch ..."}; do
      dir=/tmp/ab/$(variant $v)
      [ "${REUSE_BUILDS:-0}" = 1 ] && [ -f "$dir/.built" ] && { echo "== $(variant $v): built earlier, reused"; continue; }
      rm -rf "$dir"; mkdir -p "$dir"
      # untracked files too: the tool copies new files of this tree, which the machine's index may not list
      # (and the index may still list files this tree deleted: those are skipped)
      git ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done | xargs -0 cp --parents -t "$dir"
      ( cd "$dir" && { [ "$v" = main ] || for p in ${v//+/ }; do git apply "$OLDPWD/$p" || exit 1; done; } \
        && CUDAARCHS=${CUDAARCHS:-90} python3 -m pip install -q --no-build-isolation --no-deps --target "$dir/site" . \
        && cp "$dir"/site/ninfer_core/_*.so "$dir/ninfer_core/" && touch "$dir/.built" ) > "$OUT/build_$(variant $v).log" 2>&1 &
    done
    wait; echo "== builds done: $SECONDS s"; find "$OUT" -name 'build_*.log' -empty -delete
    built=""
    for v in $VARIANTS; do
      if [ -f "/tmp/ab/$(variant $v)/.built" ]; then built="$built $v"; else echo "== $(variant $v): NOT BUILT, left out"; tail -n 5 "$OUT/build_$(variant $v).log"; fi
    done
    for v in $built; do  # a patch's GPU tests: the test files listed in NAME.tests beside NAME.patch (main: MAIN_TESTS)
      [ "${NO_TESTS:-0}" = 1 ] && break  # NO_TESTS=1: timings only (the tests ran in an earlier call)
      name=$(variant $v)
      if [ "$v" = main ]; then
        [ -n "${MAIN_TESTS:-}" ] || continue
        read -ra test_args <<< "$MAIN_TESTS"
      else  # its parts' lists (device_lib.sh)
        queue_test_args "$v" || continue
      fi
      echo "== $name: tests"
      # serial: under pytest-xdist the copies' runs collected nothing ("no tests ran") twice on the H200
      # the copy's site/ holds ninfer_app (app/ installed under its package name) for the CLI tests
      ( cd /tmp/ab/$name && PYTHONPATH=/tmp/ab/$name:/tmp/ab/$name/site:${PYTHONPATH:-} timeout ${TEST_TIMEOUT:-420} python3 -m pytest -m cuda -q \
          -rs -p no:cacheprovider -p no:xdist "${test_args[@]}" 2>&1 | tee "$OUT/tests_$name.log" \
          | grep -vE "^(SKIPPED|PASSED)" | tail -30 )
    done
    # even rounds take the builds in reverse: in the twenty-third session's call 3 the batch-1 step
    # grew with a build's place in the round (0.3% from first to fourth, in both rounds)
    in_order() { if [ $(($1 % 2)) -eq 0 ]; then echo $built | tr ' ' '\n' | tac | tr '\n' ' '; else echo $built; fi; }
    for round in $(seq 1 ${AB_ROUNDS:-2}); do
      for entry in ${PRESETS:-qwen3.6-35b-a3b=1:4096,8:512}; do
        for v in $(in_order $round); do
          name=$(variant $v)
          ( cd /tmp/ab/$name && NINFER_REQUIRE_KERNELS=1 timeout 200 python3 scripts/ab_replays.py /tmp/ab/replays.json ${AB_VARIANTS:-X=0} \
            --preset "${entry%%=*}" --runs "${entry#*=}" --rounds 1 2>&1 | tee -a "$OUT/replays_$name.log" | grep "^{" \
            | sed "s/^{/{\"build\": \"$name\", \"preset\": \"${entry%%=*}\", \"call_round\": $round, /" \
            | tee -a "$OUT/builds.jsonl" )
        done
      done
    done
    # ROUNDS rounds of one bench script in each built copy (its package on the path), the copies
    # alternating: its JSON into $OUT/PREFIX_NAME_roundN.json, its last LINES lines shown
    alternate() {
      local rounds=$1 prefix=$2 lines=$3 round v name
      shift 3
      for round in $(seq 1 $rounds); do
        for v in $(in_order $round); do
          name=$(variant $v)
          ( cd /tmp/ab/$name && PYTHONPATH=/tmp/ab/$name:/tmp/ab/$name/site:${PYTHONPATH:-} timeout 200 "$@" \
              --json "$OUT/${prefix}_${name}_round$round.json" 2>&1 | sed "s/^/$name round $round: /" | tail -n $lines )
        done
      done
    }
    # the MoE of short prompts (MOE_TOKENS, MOE_PATHS); the K = 3 verify round against the decode step
    alternate ${MOE_ROUNDS:-0} moe 8 env NINFER_REQUIRE_KERNELS=1 python3 scripts/bench_moe_triton.py \
      --tokens ${MOE_TOKENS:-16,37,64,128} --paths ${MOE_PATHS:-grouped_gemv_bm8} ${MOE_FLAGS:-}
    alternate ${VERIFY_ROUNDS:-0} verify 5 python3 scripts/bench_spec.py verify --weights int4 --max-k 3 --repeats 8
    # STEP_ROUNDS=N: each build's decode step by kernel kind (profile_decode.py --timeline: shares, bytes)
    # for each STEP_RUNS entry preset:batch:context, likewise; then the builds side by side, kind by kind
    for run in ${STEP_RUNS:-qwen3.6-35b-a3b:1:4096 qwen3.6-35b-a3b:8:512}; do
      IFS=: read -r preset batch context <<< "$run"
      alternate ${STEP_ROUNDS:-0} "step_${preset}_b$batch" 1 env NINFER_REQUIRE_KERNELS=1 python3 scripts/profile_decode.py \
        "$preset" --batch "$batch" --context "$context" --steps 2 --timeline /dev/null
    done
    # VERIFY_PROFILE_ROUNDS=N: each build's K = 3 verify round beside its decode step by kernel kind
    # (bench_spec.py profile: shares, bytes) likewise, into the same side-by-side tables
    alternate ${VERIFY_PROFILE_ROUNDS:-0} verify_b1 3 python3 scripts/bench_spec.py profile --weights int4 --max-k 3 \
      --repeats 5
    if [ "${STEP_ROUNDS:-0}" -gt 0 ] || [ "${VERIFY_PROFILE_ROUNDS:-0}" -gt 0 ]; then
      python3 scripts/compare_step_tables.py "$OUT"/step_*_round*.json "$OUT"/verify_b1_*_round*.json \
        | tee "$OUT/step_tables.md"
    fi
    if [ "${ENGINE_ROUNDS:-0}" -gt 0 ] || [ "${SPEC_ENGINE_ROUNDS:-0}" -gt 0 ] || [ "${SERVE_ROUNDS:-0}" -gt 0 ]; then  # the model directory, made with a built copy's package (none is installed)
      set -- $built
      PYTHONPATH=/tmp/ab/$(variant $1):${PYTHONPATH:-} bench_model
    fi
    # SAMPLING_ROUNDS=N: bench_sampling.py (the sampler at 248k tokens: sample, filtered_probs) likewise
    alternate ${SAMPLING_ROUNDS:-0} sampling 4 env NINFER_REQUIRE_KERNELS=1 python3 scripts/bench_sampling.py --ref-iters 2
    # SPEC_ENGINE_ROUNDS=N: bench_spec.py engine (the engine loop's MTP rounds at a set acceptance) likewise
    alternate ${SPEC_ENGINE_ROUNDS:-0} spec_engine 14 env NINFER_REQUIRE_KERNELS=1 python3 scripts/bench_spec.py engine \
      --weights int4 --model "$PWD/.bench/qwen3.6-35b-a3b" --profile ${SPEC_PROFILE_TOKENS:-0} ${SPEC_TRACE:+--trace} --batches ${SPEC_BATCHES:-1,8} --k ${SPEC_KS:-3}
    for round in $(seq 1 ${ENGINE_ROUNDS:-0}); do
      for v in $(in_order $round); do
        name=$(variant $v)
        ( cd /tmp/ab/$name && PYTHONPATH=/tmp/ab/$name:/tmp/ab/$name/site:${PYTHONPATH:-} NINFER_REQUIRE_KERNELS=1 timeout 200 \
            python3 -m ninfer_app bench engine "$OLDPWD/.bench/qwen3.6-35b-a3b" --random-weights --json --lengths ${ENGINE_LENGTHS:-37} \
            --repeats 2 --batches ${ENGINE_BATCHES:-1,8} --tokens 256 2> "$OUT/engine_${name}_round$round.err" \
            | sed "s/^{/{\"build\": \"$name\", \"call_round\": $round, /" | tee -a "$OUT/builds_engine.jsonl" | cut -c1-600 )
      done
    done
    # SERVE_ROUNDS=N: `ninfer serve` from each build's copy, then `bench serve` against it (TTFT per
    # length of SERVE_LENGTHS, and one client's decode), the builds alternating, N rounds
    for round in $(seq 1 ${SERVE_ROUNDS:-0}); do
      for v in $(in_order $round); do
        name=$(variant $v)
        ( cd /tmp/ab/$name && export PYTHONPATH=/tmp/ab/$name:/tmp/ab/$name/site:${PYTHONPATH:-}
          start_server "$OLDPWD/.bench/qwen3.6-35b-a3b" "$OUT/serve_${name}_round$round.log"
          timeout 120 python3 -m ninfer_app bench serve --url http://127.0.0.1:8123 --mode ttft --greedy --repeats 5 \
            --lengths ${SERVE_LENGTHS:-37,128,512} --out "$OUT/serve_ttft_${name}_round$round.json" 2>&1 | tail -3 | sed "s/^/$name round $round: /"
          timeout 120 python3 -m ninfer_app bench serve --url http://127.0.0.1:8123 --mode saturation --concurrency 1 \
            --interval 0.2 --prompt-tokens 512 --max-tokens 256 --greedy --out "$OUT/serve_sat_${name}_round$round.json" 2>&1 \
            | tail -1 | sed "s/^/$name round $round: /"
          kill $server; wait $server )
      done
    done ;;
  pack)
    # everything under $OUT in one results.tgz: the device tool brings back only a few files
    tar czf /tmp/results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/results.tgz "$OUT/"
    echo "== pack: $(tar tzf "$OUT/results.tgz" | wc -l) entries in results.tgz" ;;
  issue15)
    # issue 15's table in one go: graph replays (35B batch 1 at 4K, batch 8 at 512; 27B batch 1 at
    # 4K), the K = 3 verify round / step, the 64-token MoE prefill, the engine's decode and TTFT
    replays "$OUT/issue15_replays_35b.json" qwen3.6-35b-a3b 1:4096,8:512
    replays "$OUT/issue15_replays_27b.json" qwen3.6-27b 1:4096
    timeout 150 python3 scripts/bench_spec.py verify --weights int4 --max-k 3 --repeats 8 \
      --json "$OUT/issue15_verify.json" 2>&1 | tail -5
    timeout 200 python3 scripts/bench_moe_triton.py --tokens 64 --json "$OUT/issue15_moe_64.json" 2>&1 | tail -8
    bench_model
    NINFER_REQUIRE_KERNELS=1 timeout 300 python3 -m ninfer_app bench engine .bench/qwen3.6-35b-a3b --random-weights \
      --json --lengths 37,512,2k,8k --batches 1,8 --tokens 256 > "$OUT/issue15_engine.json" 2> "$OUT/issue15_engine.err"
    echo "== issue15 engine: rc $? $(cat "$OUT/issue15_engine.json")" ;;
  start)
    timeout 300 python3 scripts/bench_start.py qwen3.6-35b-a3b /tmp/ninfer-start --json "$OUT/start_35b.json" 2>&1 | tail -4 ;;
  spec)
    for w in bf16 int4; do
      timeout 200 python3 scripts/bench_spec.py verify --repeats 8 --weights $w --json "$OUT/spec_verify_$w.json" 2>&1 | tail -12
    done ;;
  spec_engine)
    # the engine loop with MTP K = 3 at a set acceptance against plain decode, batch 1 and 8
    bench_model
    NINFER_REQUIRE_KERNELS=1 timeout 300 python3 scripts/bench_spec.py engine --weights int4 --profile 128 \
      --json "$OUT/spec_engine.json" 2>&1 | tail -90 ;;
  grammar)
    # the grammar's host work, mask copy + kernel, and constrained vs free engine steps at batch 1
    # and 8 (issue 16); xgrammar is not in the image: its wheel and apache-tvm-ffi's go in .whl/
    if ! python3 -c "import xgrammar" 2>/dev/null; then
      echo "== grammar: xgrammar is missing (put xgrammar + apache_tvm_ffi cp312 wheels in .whl/)"; continue
    fi
    bench_model
    NINFER_REQUIRE_KERNELS=1 timeout 400 python3 scripts/bench_grammar.py .bench/qwen3.6-35b-a3b \
      --json "$OUT/grammar_35b.json" 2>&1 | tail -8 ;;
  esac
done
