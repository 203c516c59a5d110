#!/usr/bin/env bash
# What a session with a lent GPU runs, in one command on that machine (its own
# python3 and torch; nothing can be installed there): build mha_ext against
# that torch, the CUDA test cases, how the library takes its C++ runtime and
# the C++ input checks (they crashed there while the library held a static
# libstdc++), bench/bench_cuda.py --quick, an ncu profile of one forward and
# backward (and of the forward at L = 512 beside flash's, with a timing of it),
# then the whole suite, each case named in suite.log as it ends. Each stage
# has its own time limit so that a slow one cannot eat the next; logs go to
# $OUT (or ./gpu_out): everything printed in session.log, and 6 other files
# (build, bench, three ncu reports, the suite: the device tool brings back 8 at
# most; a call's reply shows only the tail of what it prints). Test-only wheels the image lacks
# (expecttest, for opcheck) travel in .whl (see the device notes).
#   bash scripts/gpu_session.sh [tests-s] [bench-s] [suite-s]     (suite-s 0: no suite)
#   MHA_BENCH_ARGS="--only decode" bash scripts/gpu_session.sh ...  (arguments for bench_cuda.py)
#   MHA_SUITE="tests/test_x.py ..." bash scripts/gpu_session.sh ...  (what the last stage runs; default: tests)
#   MHA_NCU=0 bash scripts/gpu_session.sh ...                       (no ncu profiles: a short lease)
# On an H200 (2026-11-27, the fifth GPU session) the machine took about 30 s to start, the build
# 122 s, the 303 CUDA cases 89 s at -n 8 (64 s of it running them), the quick bench 23 s, and the suite reached 45% of its
# cases in 230 s (Intel Xeon, 14 workers; two crashed workers cost part of that): a 15-minute lease
# fits `MHA_NCU=0 bash scripts/gpu_session.sh 110 60 300` in one call of about 9.5 minutes, with no
# time left for a second start (one needs 4 minutes of lease left). On an H100 (2026-11-28) the same
# call took 588 s, the suite reaching 66%; on an H200 the same day 523 s (build 105 s), 71%. What is left of a lease after it, while the machine is
# still warm (it waits 30 s for the next call), fits bench/cuda_ab.py: versions of the plain forward
# kernel side by side without the extension's build (about 30 s a call).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
t_tests=${1:-150}; t_bench=${2:-180}; t_suite=${3:-120}
stamp() { echo "==> [$(date +%T)] $*"; }
exec > >(tee "$out/session.log") 2>&1
stamp machine
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
nvidia-smi -L; nproc; lscpu | grep -m1 "Model name"
echo "CPU: $(grep -o -w -E 'avx512f|avx512_bf16|amx_tile|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"
python3 -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
stamp build
rm -f mha_ext/_C*.so
MAX_JOBS=16 python3 setup.py -q build_ext --inplace > "$out/build.log" 2>&1
rc=$?; tail -3 "$out/build.log"; stamp "build rc=$rc"
[ $rc = 0 ] || { grep -m20 -i "error" "$out/build.log"; exit 1; }
stamp "CUDA test cases (those with a cuda parameter, and the GPU-only tests)"
# 8 workers: a case that crashes the process fails alone (xdist replaces the worker)
python3 -m pytest --collect-only -q -p no:cacheprovider tests 2>/dev/null | python3 -c '
import re, sys
for line in sys.stdin:
    i = line.strip()
    m = re.match(r"(tests/\S+?::[^\[]+)(\[(.*)\])?$", i)
    if m and ("cuda" in (m.group(3) or "").split("-") or re.search(r"on_cuda|test_cuda_build|cuda_graph", m.group(1))):
        print(i)' > /tmp/cuda_ids.txt
echo "$(wc -l < /tmp/cuda_ids.txt) cases"
timeout "$t_tests" python3 - <<'PY'
import sys, pytest
ids = [l for l in open("/tmp/cuda_ids.txt").read().splitlines() if l]
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-n", "8", "-rfE", *ids]))
PY
stamp "CUDA tests rc=$?"
stamp "the C++ runtime: the library must take libstdc++'s stream code from libstdc++.so (a static copy cut or crashed messages)"
g++ --version | head -1; echo "CC=${CC:-} CXX=${CXX:-} LDFLAGS=${LDFLAGS:-}"
readelf -p .comment mha_ext/_C*.so 2>/dev/null | grep -i -m3 "gcc\|clang"
nm -D mha_ext/_C*.so | grep " _ZNSo9_M_insertIlEERSoT_" || echo "std::ostream::_M_insert<long> defined inside the library"
ldd mha_ext/_C*.so | grep -E "stdc|gcc_s|gomp|c10.so"
timeout 60 python3 -X faulthandler -m pytest -q -p no:cacheprovider -p no:xdist -rfE tests/test_errors.py 2>&1 | tail -5
stamp "input checks rc=${PIPESTATUS[0]}"
stamp "bench/bench_cuda.py --quick ${MHA_BENCH_ARGS:-}"
timeout "$t_bench" python3 bench/bench_cuda.py --quick ${MHA_BENCH_ARGS:-} 2>&1 | grep -v Warning | tee "$out/bench_cuda.log"
stamp "bench done"
if [ "${MHA_NCU:-1}" != 0 ]; then
stamp "ncu: one float16 forward and backward at head dim 128 (where the time goes inside the kernels)"
# One profile, saved: its sections as text, then its per-SASS-instruction table (executed
# instructions, stalls, excessive sectors of each line: which lines the backward's 13 instructions
# per mma and the forward's uncoalesced global sectors are), compressed (the tool brings back 8 files at most)
timeout 120 ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
  --section InstructionStats --section SourceCounters -k regex:attention_ -c 3 -f -o /tmp/prof python3 -c "
import torch, mha_ext
q, k, v = (torch.randn(4, 16, 4096, 128, device='cuda', dtype=torch.float16, requires_grad=True) for _ in range(3))
mha_ext.scaled_dot_product_attention(q, k, v).sum().backward()
torch.cuda.synchronize()" > /tmp/prof.log 2>&1
rc=$?; tail -3 /tmp/prof.log
timeout 60 ncu -i /tmp/prof.ncu-rep --page details > "$out/ncu.txt" 2>&1; tail -5 "$out/ncu.txt"; stamp "ncu rc=$rc"
timeout 60 ncu -i /tmp/prof.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > "$out/ncu_source.csv.gz"
stamp "ncu source table ($(stat -c %s "$out/ncu_source.csv.gz" 2>/dev/null) bytes compressed)"
# Short sequences are where the forward is furthest from flash (H100: 0.30 of it at L = 512 and
# 0.56-0.59 at 8192 for the same FLOPs): the same call timed with and without inputs that need
# grad (the bench's inputs do), then both kernels under ncu
stamp "the forward at L = 512 (B 186, H 8, head dim 128, float16): timing, then ncu of ours and flash's"
timeout 60 python3 -c "
import torch, mha_ext, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
q, k, v = (torch.randn(186, 8, 512, 128, device='cuda', dtype=torch.float16) for _ in range(3))
qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
def flash(a, b, c):
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(a, b, c)
def ms(f, *a):
    for _ in range(3): f(*a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20): f(*a)
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e) / 20
for name, f, a in [('mha_ext', mha_ext.scaled_dot_product_attention, (q, k, v)),
                   ('mha_ext, inputs need grad', mha_ext.scaled_dot_product_attention, (qg, kg, vg)),
                   ('flash', flash, (q, k, v)), ('flash, inputs need grad', flash, (qg, kg, vg))]:
    print(f'{name}: {ms(f, *a):.3f} ms')" 2>&1
timeout 90 ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
  --section LaunchStats --section SchedulerStats -k regex:"attention_fwd|flash_fwd" -c 2 python3 -c "
import torch, mha_ext, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
q, k, v = (torch.randn(186, 8, 512, 128, device='cuda', dtype=torch.float16) for _ in range(3))
mha_ext.scaled_dot_product_attention(q, k, v)
with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
    F.scaled_dot_product_attention(q, k, v)
torch.cuda.synchronize()" > "$out/ncu_l512.txt" 2>&1
rc=$?; tail -5 "$out/ncu_l512.txt"; stamp "ncu L = 512 rc=$rc"
fi
[ "$t_suite" = 0 ] && exit 0
stamp "whole suite (-n 14, less the CUDA cases of the stage above; the transformers models and the wheel test need what the machine lacks)"
deselect=()
[ -z "${MHA_SUITE:-}" ] && while read -r id; do deselect+=(--deselect "$id"); done < /tmp/cuda_ids.txt
# -v: each case's name and outcome as it ends, in suite.log, so a run cut by its limit still
# names its failures (printed here from that log once pytest ends or is stopped, with the crashes)
# the instruction-set paths first: the GPU machines' Intel hosts may have the AMX this project's
# CPU machines mostly lack (pytest drops the second mention of a file)
timeout "$t_suite" python3 -m pytest -v -p no:cacheprovider -n 14 -rfE ${MHA_SUITE:-tests/test_isa_paths.py tests} \
  "${deselect[@]}" \
  --ignore tests/test_packaging.py --ignore tests/test_transformers.py \
  --deselect tests/test_plot.py::test_minilm_heatmap_example_writes_every_head > "$out/suite.log" 2>&1
rc=$?
grep -E "(FAILED|ERROR)( |$)|node down|Fatal Python error|^  File \"$PWD/tests" "$out/suite.log" | head -60
grep -c "PASSED" "$out/suite.log" | sed 's/$/ passed so far/'; tail -3 "$out/suite.log" | cut -c1-300
stamp "suite rc=$rc"
