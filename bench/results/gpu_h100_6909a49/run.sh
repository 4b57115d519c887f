#!/bin/bash
# One call of the GPU machine: the GPU tests, then the Llama-3-8B virtual runs (issue 55),
# interleaved so that a cut leaves balanced data. Every step bounded; ends by DEADLINE.
DEADLINE=${DEADLINE:-540}
export PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$SITE:$PWD
python bench/gpu_check.py --probe --out $W 2>&1 | tail -3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
left() { echo $((DEADLINE - SECONDS)); }
bounded() {  # bounded SECS LOG CMD...: run when time is left, within SECS
  local secs=$1 log=$2; shift 2
  local l=$(left); [ $l -lt 30 ] && { echo "SKIP (no time) $*" | tee -a $log; return; }
  [ $secs -gt $l ] && secs=$l
  local t0=$SECONDS
  echo "===== $* (timeout $secs)" >> $log
  timeout -k 5 $secs "$@" >> $log 2>&1; local rc=$?
  echo "===== rc=$rc $((SECONDS - t0)) s at $SECONDS s" | tee -a $log
}
T=$OUT/tests.log
if [ -z "$SKIP_TESTS" ]; then
bounded 170 $T python -m pytest -q -rs -p no:cacheprovider -n 6 tests/gpu --ignore tests/gpu/test_gpu_shared.py --ignore tests/gpu/test_gpu_virtual.py
bounded 60 $T python -m pytest -q -rs -p no:cacheprovider tests/gpu/test_gpu_virtual.py
fi
V=$OUT/virtual.log
if [ -z "$SKIP_VIRTUAL" ]; then
v8b() { local tag=$1; shift; bounded 150 $V python bench/virtual.py --config llama3-8b --layout best "$@" --out $W/$tag; }
for rep in 1 2 3; do
  v8b isp_$rep --systems isp-comm --repeats 1 --steps 3
  v8b fsdp2_$rep --systems fsdp2 --repeats 1 --steps 3
  v8b ispc_$rep --systems "isp-comm compiled" --repeats 1 --steps 3
  v8b fsdp2c_$rep --systems "fsdp2 compiled" --repeats 1 --steps 3
  [ $rep = 1 ] && bounded 200 $V python bench/virtual.py --config llama3-8b --layout best --systems isp-comm,fsdp2 --repeats 1 --steps 2 --breakdown --out $W/breakdown
done
fi
grep -h "^| " $V 2>/dev/null | head -80; tail -5 $T 2>/dev/null
nvidia-smi --query-gpu=memory.used --format=csv,noheader
ls /dev/shm | head
tar -czf $OUT/results.tgz -C $W . && echo archived
