#!/usr/bin/env bash
# GPU runs for the serving engine, on the device machine (torch + Triton there; the rest travels in ignored folders that
# `python bench/device_bundle.py` builds: .whl/ and .gputok/, and .dg/ for DeepGEMM; carry all three).
#   bash bench/gpu_serving.sh setup probe tests graphs profile ab attention engine structured prefix defaults speed restarts serve  # any subset
# The serving acceptance (setup + serve fit one 10-minute device call: ~10 s wheels, ~25 s synth, serve <= 480 s):
#   bash bench/gpu_serving.sh setup serve        # SERVE_ARGS / SERVE_TIMEOUT override
# Issue 25's acceptance on the H200 only (`h200` stops the rest on any other card), in one call (without `h200`, a
# fresh H100 ran it in 297 s: setup ~30 s, profile 42 s, speed 66 s, three prefix pairs ~158 s; docs/benchmarks.md):
#   PROFILE_ARGS=--skip-gemms SPEED_LOADS="table long" PREFIX_RAMPS=0 PREFIX_PAIRS=3 PREFIX_TIMEOUT=60 \
#     bash bench/gpu_serving.sh setup h200 profile speed prefix
# The fp8 KV cache against the default (its GPU tests and the decode steps): bash bench/gpu_serving.sh setup kv-fp8
# Results go to a folder under /tmp/gpuout, packed at the end into $OUT/results.tgz (markdown copied beside it).
# The synthetic llama3-8b fp8-block checkpoint stays in /tmp/wg while the machine is warm.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
# .whl/opt: packages the image has in some version (xgrammar's, the tokenizer's), installed only where it lacks them or
# has a version warmgate's own requirements (pyproject.toml) refuse, e.g. tokenizers before 0.21 (no DecodeStream).
OPT=$(python3 - <<'PY'
import importlib.metadata as md, pathlib, tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
wanted = {canonicalize_name(r.name): r.specifier for r in map(Requirement, project["dependencies"])}
for wheel in sorted(pathlib.Path(".whl/opt").glob("*.whl")):
    name = canonicalize_name(wheel.name.split("-")[0])
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have is None or not wanted.get(name, SpecifierSet()).contains(have, prereleases=True):
        print(wheel)
PY
)
[ -z "$OPT" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $OPT \
  || exit 1
echo "installed from .whl/opt: $(echo $OPT | xargs -n1 basename 2>/dev/null | tr '\n' ' ')"
# DeepGEMM's Python JIT package (the image's nvcc compiles its kernels; the engine uses it where it imports).
[ ! -f .dg/pinned.tgz ] || { tar xzf .dg/pinned.tgz -C /tmp/site && echo "installed DeepGEMM from .dg/pinned.tgz"; } \
  || exit 1
MODEL=/tmp/wg/llama3-8b-fp8-block
RUN=/tmp/gpuout/run-$(date +%H%M%S)
mkdir -p $RUN
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    setup)  [ -d $MODEL ] || python3 -m app.cli model synth $MODEL --shape llama3-8b --scheme fp8-block --device cuda \
              --tokenizer .gputok
            nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
            # Without a working xgrammar the fork server serves but its engines have no structured outputs; until
            # 2026-12-04 it died at its preload, and every engine start in these runs fell back to spawning.
            python3 -c "import engine.grammar; engine.grammar.load_xgrammar()" \
              || echo "WARNING: xgrammar does not import: carry what it needs in .whl/opt" ;;
    h200)   # Acceptance figures come from the H200 alone: on any other card the steps after this one do not run.
            CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
            case $CARD in *H200*) echo "card: $CARD" ;; *) echo "not an H200 ($CARD): stopping before the rest"; exit 3 ;; esac ;;
    kv-fp8) # The fp8 KV cache (kv_cache_dtype = "fp8"): its GPU tests, then the decode steps with it and without, in
            # turn on one machine (fp8, auto, fp8, auto), the graphs' replay and the engine's step, ms.
            timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_gpu.py -k "fp8_cache or rotates" \
              -p no:cacheprovider 2>&1 | tee $RUN/pytest_kv_fp8.txt | tail -5
            for run in fp8 auto fp8-2 auto-2; do
              timeout ${PROFILE_TIMEOUT:-200} python3 bench/gpu_step_profile.py --model $MODEL --out $RUN/kv-$run \
                --skip-gemms --kv-cache-dtype ${run%-2} > $RUN/kv-$run.log 2>&1 || tail -5 $RUN/kv-$run.log
            done
            python3 - $RUN <<'PY' | tee $OUT/kv_fp8.md
import json, sys
from pathlib import Path
runs = {}
for run in ("fp8", "auto", "fp8-2", "auto-2"):
    path = Path(sys.argv[1]) / f"kv-{run}" / "gpu_step_profile.json"
    if path.exists():
        runs[run] = {d["batch"]: (d["step_ms"], d["graph_ms"]) for d in json.loads(path.read_text())["decode"]}
batches = sorted({b for cells in runs.values() for b in cells})
print("| KV cache | " + " | ".join(f"decode {b}: step (graph) ms" for b in batches) + " |")
print("|---|" + "---:|" * len(batches))
for run, cells in runs.items():
    print(f"| {run} | " + " | ".join(f"{cells[b][0]:.3f} ({cells[b][1]:.3f})" if b in cells else "-" for b in batches)
          + " |")
PY
            ;;
    probe)  timeout ${PROBE_TIMEOUT:-150} python3 bench/cublas_blockwise_rule.py --out $RUN | tail -30 ;;
    tests)  timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu ${TESTS_ARGS:-tests/test_gpu.py} -p no:cacheprovider 2>&1 \
              | tee $RUN/pytest_gpu.txt | tail -40 ;;
    deploy) # tests/test_deploy.py's gpu case (device auto picks CUDA) runs the image's command on the demo. The demo's
            # GGUF is too large to carry, so a synthetic checkpoint of its shape stands in for it, marked as built.
            export WARMGATE_CACHE_DIR=/tmp/wgcache
            python3 -c "from pathlib import Path; from cache.checkpoint import demo, synth; t = demo.demo_dir('fp8-block')
t.exists() or synth.synth_checkpoint(t, 'smollm2-135m', 'fp8-block', device='cuda', tokenizer=Path('.gputok'), progress=False)
demo._write_marker(t, 'fp8-block', seconds=0.0)"
            BIN=$(dirname "$(python3 -c 'import sys; print(sys.executable)')")  # the image's entry runs `warmgate`
            [ -x "$BIN/warmgate" ] || printf '#!/bin/sh\nexec python3 -m app.cli "$@"\n' > "$BIN/warmgate" && chmod +x "$BIN/warmgate"
            timeout ${DEPLOY_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_deploy.py -p no:cacheprovider 2>&1 \
              | tee $RUN/pytest_deploy.txt | tail -30 ;;
    graphs) timeout ${GRAPHS_TIMEOUT:-300} python3 bench/graph_capture.py --model $MODEL --out $RUN/graphs 2>&1 | tail -8 ;;
    profile) timeout ${PROFILE_TIMEOUT:-200} python3 bench/gpu_step_profile.py --model $MODEL --out $RUN \
              ${PROFILE_ARGS:-} 2>&1 | tail -60
            ;;
    engine) timeout ${ENGINE_TIMEOUT:-240} python3 bench/gpu_engine.py --out $RUN/engine --work /tmp/wg \
              --skip kernels synth graphs hf sweep profile variants host 2>&1 | tail -30 ;;
    ab)     # This tree against another checkout on the same machine: between fresh machines the same code's decode step
            # differs by up to ~2% (docs/benchmarks.md, 2026-12-04), more than most single kernel changes. AB_TREE: the
            # other checkout, an ignored folder carried with the call (`git worktree add --detach .ab main`, then delete its
            # bench/results and docs to fit the carry limit). The GPU suite on each with a cold Triton cache (what a
            # fresh machine's first start compiles inside its captures), then the step profile this, other, this.
            for tree in . ${AB_TREE:?AB_TREE names the other checkout}; do
              (cd $tree && TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=/tmp/site:$PWD timeout ${AB_TESTS_TIMEOUT:-150} \
                python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --tb=line 2>&1 | grep -E "^(FAILED|E )|passed|failed" \
                | head -8 | sed "s|^|$tree: |")
            done
            for run in a b a2; do
              tree=.; [ $run = b ] && tree=$AB_TREE
              (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout ${PROFILE_TIMEOUT:-200} python3 bench/gpu_step_profile.py \
                --model $MODEL --out $RUN/ab-$run --skip-gemms > $RUN/ab-$run.log 2>&1)
            done
            python3 - $RUN <<'PY' | tee $OUT/ab.md
import json, sys
from pathlib import Path
runs, graphs = {}, {}
for run in ("a", "b", "a2"):
    path = Path(sys.argv[1]) / f"ab-{run}" / "gpu_step_profile.json"
    profile = json.loads(path.read_text()) if path.exists() else {"decode": [], "mixed": [], "prefill": {}}
    cells = {f"decode {d['batch']}": (d["step_ms"], d["graph_ms"]) for d in profile["decode"]}
    cells.update({f"mixed {d['batch']}+{d['prompt']}": (d["step_ms"], d["graph_ms"]) for d in profile["mixed"]})
    if profile["prefill"]:
        cells["prefill (mixed graph: the budget)"] = (profile["prefill"]["step_ms"], profile["prefill"]["graph_ms"])
    runs[run] = cells
    graphs[run] = profile.get("mixed_graphs_ms", {})  # every mixed graph's replay (profiles from d455384 on)
columns = list(dict.fromkeys(c for cells in runs.values() for c in cells))
print("| step ms (graph ms) | " + " | ".join(columns) + " |")
print("|---|" + "---:|" * len(columns))
for run, label in (("a", "this tree"), ("b", "AB_TREE"), ("a2", "this tree again")):
    row = [f"{runs[run][c][0]:.3f} ({runs[run][c][1]:.3f})" if c in runs[run] else "-" for c in columns]
    print(f"| {label} | " + " | ".join(row) + " |")
sizes = list(dict.fromkeys(n for g in graphs.values() for n in g))
if sizes:
    print("\n| mixed graph replay ms | " + " | ".join(sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for run, label in (("a", "this tree"), ("b", "AB_TREE"), ("a2", "this tree again")):
        print(f"| {label} | " + " | ".join(f"{graphs[run][n]:.3f}" if n in graphs[run] else "-" for n in sizes) + " |")
PY
            ;;
    attention) # The attention kernel's launch choices on a prefix wave's steps, decode and fresh prompts, each twice in
            # turn (bench/attention_ab.py; ATTENTION_LAUNCHES and ATTENTION_SPLITS: names from its LAUNCHES and SPLITS;
            # ATTENTION_CASES: only cases whose names start so, e.g. decode).
            # ~3-4 min, most of it compiling.
            timeout ${ATTENTION_TIMEOUT:-330} python3 bench/attention_ab.py --out $RUN/attention_ab.json \
              --launches ${ATTENTION_LAUNCHES:-n32,n32_r168,n32_s3_r168,s3,dg8,dg16,n32_r168_dg8} \
              --splits ${ATTENTION_SPLITS:-unsplit,split2,split4,split8,split16,split16_n256} \
              --cases "${ATTENTION_CASES:-}" 2>&1 | grep -v Warning
            cp $RUN/attention_ab.json $OUT/ 2>/dev/null ;;
    structured) # Issue 23's acceptance: 64 streams, every request plain, held to a JSON schema, or with logprobs 5
            # (plain first and last, for the run's own spread; levels of one run differ by 3-10%: STRUCTURED_VARIANTS
            # may repeat them, e.g. plain,json_schema,logprobs=5,plain,json_schema,logprobs=5,plain). ~70 s a run.
            ST=${STRUCTURED_TIMEOUT:-420}
            timeout -k 30 $ST python3 bench/serve_load.py --model $MODEL --device cuda --max-num-seqs 128 \
              --kv-cache-bytes 20000000000 --out $RUN/structured --deadline-s $((ST - 60)) --concurrency 64 \
              --requests-per-client 8 --direct-concurrency 0 --restart-probe 0 \
              --variants ${STRUCTURED_VARIANTS:-plain,json_schema,logprobs=5,plain} 2>&1 | tail -30
            cp $RUN/structured/serve_load.md $OUT/structured.md 2>/dev/null
            cp $RUN/structured/serve_load.json $OUT/structured.json 2>/dev/null ;;
    prefix) # Prefix caching (issue 25): 64 streams sharing a 2,000-token system prompt, each with its own ~50-token
            # question, with the cache on (the default) and off, the streams started together after the warm-up
            # (waves) and with their starts spread over 2 s (serve_load --ramp-s); PREFIX_RAMPS overrides the spreads
            # ("0 2"), PREFIX_CACHING the settings ("true false"), PREFIX_SET adds one engine setting to every run
            # (e.g. max_num_batched_tokens=512, also in the names); PREFIX_CHAT=1 sends chat requests as text (the
            # acceptance's wording; serve_load --chat) instead of token ids; PREFIX_PAIRS=N repeats it all N times
            # (-runK in the names). ~30 s per run on a warm machine.
            for pair in $(seq ${PREFIX_PAIRS:-1}); do
              for ramp in ${PREFIX_RAMPS:-0 2}; do
                for caching in ${PREFIX_CACHING:-true false}; do
                  NAME=prefix-$caching-ramp$ramp${PREFIX_SET:+-${PREFIX_SET//=/}}${PREFIX_CHAT:+-chat}
                  NAME=$NAME${PREFIX_PAIRS:+-run$pair}
                  timeout -k 30 ${PREFIX_TIMEOUT:-270} python3 bench/serve_load.py --model $MODEL --device cuda \
                    --max-num-seqs 128 --kv-cache-bytes 20000000000 --out $RUN/$NAME --deadline-s 200 \
                    --concurrency 64 --requests-per-client 4 --direct-concurrency 0 --restart-probe 0 \
                    --shared-prefix 2000 --prompt-len 50 --engine-set enable_prefix_caching=$caching \
                    ${PREFIX_SET:+--engine-set $PREFIX_SET} ${PREFIX_CHAT:+--chat} --ramp-s $ramp 2>&1 | tail -8
                  cp $RUN/$NAME/serve_load.md $OUT/$NAME.md 2>/dev/null
                  cp $RUN/$NAME/serve_load.json $OUT/$NAME.json 2>/dev/null
                done
              done
            done ;;
    defaults) # Issue 24: `warmgate serve --model M` with no engine settings (the memory plan sizes everything) at 64
            # and 256 streams, then the hand-tuned settings of the other runs at 64 streams. ~3 min each.
            for tuned in defaults tuned; do
              if [ $tuned = defaults ]; then SET="--max-num-seqs 0"; LEVELS="--concurrency 64,256 --requests-per-client 8,2"
              else SET="--max-num-seqs 128 --kv-cache-bytes 20000000000"; LEVELS="--concurrency 64 --requests-per-client 8"; fi
              timeout -k 30 ${DEFAULTS_TIMEOUT:-270} python3 bench/serve_load.py --model $MODEL --device cuda $SET \
                --out $RUN/$tuned --deadline-s 210 $LEVELS --direct-concurrency 0 --restart-probe 0 2>&1 | tail -8
              cp $RUN/$tuned/serve_load.md $OUT/$tuned.md 2>/dev/null
              cp $RUN/$tuned/serve_load.json $OUT/$tuned.json 2>/dev/null
            done ;;
    speed)  # Issue 25's serving points with its settings (max_num_seqs 128, 20 GB KV): 1 stream (TPOT p50), 64 and 128
            # streams (tok/s, TTFT, the engine's CPU per token by thread, device idle), then 32 streams of 1,150-token
            # prompts and 256 tokens (TTFT p99, TPOT p99), as a wave after the warm-up and with the 32 streams' starts
            # spread over 2 s (SPEED_LOADS picks some of "table long long-ramp"; SPEED_SET adds one engine setting, e.g.
            # late_scheduling=false, also in the names). ~5 min with the three starts; `profile` and `prefix` are the rest.
            for load in ${SPEED_LOADS:-table long long-ramp}; do
              LONG="--concurrency 32 --requests-per-client 4 --prompt-len 1150 --output-len 256"
              case $load in
                table) LEVELS="--concurrency 1,64,128 --requests-per-client 16,8,8" ;;
                long) LEVELS=$LONG ;;
                long-ramp) LEVELS="$LONG --ramp-s 2" ;;
              esac
              NAME=speed-$load${SPEED_SET:+-${SPEED_SET//=/}}
              timeout -k 30 ${SPEED_TIMEOUT:-200} python3 bench/serve_load.py --model $MODEL --device cuda \
                --max-num-seqs 128 --kv-cache-bytes 20000000000 --out $RUN/$NAME --deadline-s 170 $LEVELS \
                --direct-concurrency 0 --restart-probe 0 ${SPEED_SET:+--engine-set $SPEED_SET} 2>&1 | tail -8
              cp $RUN/$NAME/serve_load.md $OUT/$NAME.md 2>/dev/null
              cp $RUN/$NAME/serve_load.json $OUT/$NAME.json 2>/dev/null
            done ;;
    restarts) # Issue 24's run: the gateway's defaults (two standbys, KV cache planned from the device), 10 standby
            # restarts, 3 through the fork server, 5 kills 1.5 s apart, 10 admin restarts 1 s apart. RESTARTS_ARGS overrides.
            timeout ${RESTARTS_TIMEOUT:-420} python3 bench/restart_paths.py --model $MODEL --device cuda --clients 32 \
              --out $RUN/restarts ${RESTARTS_ARGS:---standby -1 --kv-cache-bytes 0 --restarts 10 --kills 0 --forks 3 \
              --kill-storm 5 --restart-storm 10} 2>&1 | tail -30
            cp $RUN/restarts/restart_paths.json $OUT/ 2>/dev/null
            cp $RUN/restarts/restart_paths.md $OUT/ 2>/dev/null ;;
    serve)  # The acceptance sweep: 64-1024 streams through the gateway (8 client processes), 64 straight to the
            # engine's socket, default [restart]. About 4-5 min on the H200 (ready ~1 min, the 1024 level ~1 min); no
            # request, level or restart probe starts after --deadline-s, and a TERM from timeout still writes results.
            ST=${SERVE_TIMEOUT:-480}
            SWEEP="--concurrency 64,128,256,512,1024 --requests-per-client 4,4,2,2,2 --direct-concurrency 64"
            timeout -k 30 $ST python3 bench/serve_load.py --model $MODEL --device cuda --max-num-seqs 128 \
              --kv-cache-bytes 20000000000 --out $RUN/serve --deadline-s $((ST - 60)) \
              ${SERVE_ARGS:-$SWEEP --restart-probe 10} 2>&1 | tail -60
            cp $RUN/serve/serve_load.json $OUT/ 2>/dev/null ;;
  esac
done
cp $RUN/serve/serve_load.md $OUT/ 2>/dev/null
tar czf $OUT/results.tgz -C $RUN .
# A call brings back at most 8 files from $OUT: past that, the markdown goes into one summary.md and the JSON copies
# go (results.tgz holds them all).
if [ $(ls $OUT | wc -l) -gt 8 ]; then
  for f in $OUT/*.md; do echo "## $(basename $f)"; echo; cat $f; echo; done > $RUN.summary.md
  rm -f $OUT/*.json $OUT/*.md && mv $RUN.summary.md $OUT/summary.md
fi
