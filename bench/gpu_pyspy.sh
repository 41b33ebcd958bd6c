#!/usr/bin/env bash
# py-spy on the active engine during one gateway level per variant (bench/serve_load.py --variants), on the device
# machine after `bash bench/gpu_serving.sh setup`; .whl/opt carries the py-spy wheel. Raw flame data (one line per
# stack, `py-spy record --format raw --threads`) and two dumps per variant go to $OUT.
#   bash bench/gpu_pyspy.sh json_schema logprobs=5
export PYTHONPATH=/tmp/site:$PWD
SPY=$(find /tmp/site -name "py-spy" -type f | head -1); [ -n "$SPY" ] || { python3 -m pip install -q --no-deps --target /tmp/spy .whl/opt/py_spy*.whl; SPY=$(find /tmp/spy -name "py-spy" -type f | head -1); }; chmod +x $SPY; echo "py-spy: $SPY"
mkdir -p $OUT
for V in "$@"; do N=${V/=/}
python3 bench/serve_load.py --model /tmp/wg/llama3-8b-fp8-block --device cuda --max-num-seqs 128 \
  --kv-cache-bytes 20000000000 --out /tmp/gpuout/jp --concurrency 64 --requests-per-client ${PYSPY_REQUESTS:-30} --direct-concurrency 0 \
  --restart-probe 0 --variants $V --restart-set standby=0 > $OUT/jp-$N.log 2>&1 &
BL=$!
for i in $(seq 240); do grep -q "$V: 64 warm-up" $OUT/jp-$N.log && break; sleep 1; done
sleep 5  # the level lasts ~30 s at 8,000-9,000 tok/s: record 10 s of it
ps -eo pid,args | grep -E "engine .* active" | grep -v grep | tee $OUT/ps-$N.txt
PID=$(ps -eo pid,args | grep -E "engine .* active" | grep -v grep | awk '{print $1}' | head -1)
"$SPY" dump --pid $PID > $OUT/dump1-$N.txt 2>&1
"$SPY" record --pid $PID --duration 10 --rate 200 --format raw --threads --output $OUT/jp-$N.raw > $OUT/record-$N.log 2>&1
"$SPY" dump --pid $PID > $OUT/dump2-$N.txt 2>&1
wait $BL
grep "failed," $OUT/jp-$N.log
done
