# tests: run from .snap
source ./gpu_common.sh
export PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
t0=$(date +%s)
python3 dev/sm90_precompile.py --jobs 15 2>&1 | tail -3 | tee $OUT/precompile.log
timeout 100 python3 -m pytest -q -rfEs -p no:cacheprovider -m sm90_quick tests/test_gpu_sm90_gemm.py > $OUT/sm90_quick.log 2>&1; echo "sm90_quick rc=$? $(tail -1 $OUT/sm90_quick.log)"
left=$(( 560 - ($(date +%s) - t0) - 70 ))
timeout $left python3 -m pytest -q -rfEs -p no:cacheprovider --durations=15 tests/test_gpu_*.py tests/test_torch_adapter.py tests/test_jax_adapter.py tests/test_torch_parallel.py tests/test_examples.py tests/test_gpu_interop.py > $OUT/gpu_suite.log 2>&1; echo "gpu suite rc=$? $(tail -1 $OUT/gpu_suite.log)"
timeout 65 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/test_readme.py tests/test_docs.py > $OUT/docs.log 2>&1; echo "docs rc=$? $(tail -1 $OUT/docs.log)"
grep -E "^(FAILED|ERROR)" $OUT/*.log | head -30
echo "total $(( $(date +%s) - t0 )) s"
