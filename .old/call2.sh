# benches: run from the repository root (which holds .snap and .base)
cd .snap && source ./gpu_common.sh && cd ..
t0=$(date +%s)
B="--rounds 10 --no-write"
(cd .base && PYTHONPATH=$PWD:$PYTHONPATH timeout 150 python3 bench.py --impls 'cupyffn-*' $B --json $OUT/base1.json > $OUT/base1.log 2>&1); echo "base1 rc=$? $(( $(date +%s) - t0 ))s"
(cd .snap && PYTHONPATH=$PWD:$PYTHONPATH CUPYFFN_GIT_COMMIT=$NEWC timeout 220 python3 bench.py --compile --rounds 10 --json $OUT/nvidia-h200.json > $OUT/bench.log 2>&1); echo "new rc=$? $(( $(date +%s) - t0 ))s"
(cd .base && PYTHONPATH=$PWD:$PYTHONPATH timeout 120 python3 bench.py --impls 'cupyffn-*' $B --json $OUT/base2.json > $OUT/base2.log 2>&1); echo "base2 rc=$? $(( $(date +%s) - t0 ))s"
(cd .snap && PYTHONPATH=$PWD:$PYTHONPATH CUPYFFN_GIT_COMMIT=$NEWC timeout $(( 575 - ($(date +%s) - t0) )) python3 bench.py --host-only --no-write --json $OUT/host.json > $OUT/host.log 2>&1); echo "host rc=$? $(( $(date +%s) - t0 ))s"
tail -22 $OUT/bench.log; tail -25 $OUT/host.log
