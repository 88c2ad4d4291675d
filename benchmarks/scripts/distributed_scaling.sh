#!/usr/bin/env bash
# CPU scaling of llmkit train: 1 process vs 2 torchrun processes (gloo), specs/tiny.toml,
# 40 steps each, the tokenizer and token cache shared. Prints median tokens/s (all ranks)
# and the final val loss of each run.   bash benchmarks/scripts/distributed_scaling.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
export LLMKIT_PLUGINS=""
L=.venv/bin/llmkit
TR=".venv/bin/torchrun --standalone --nproc-per-node 2 -m llmkit.cli"
base=${1:-/tmp/llmkit-scaling}
common="--no-progress --no-sample --set train.max_steps=40 --set train.eval_interval=40 --set train.log_interval=5 --set data.cache_dir=$base/cache"
if [ ! -f $base/prep/tokenizer.json ]; then
  $L train specs/tiny.toml --out $base/prep $common --set train.max_steps=31 --set train.eval_interval=31 > /dev/null
fi
tok="--set tokenizer.path=$base/prep/tokenizer.json"
rm -rf $base/one $base/two $base/twoweak $base/fsdp
$L train specs/tiny.toml --out $base/one $common $tok --set train.batch_size=8 > $base/one.log 2>&1
$TR train specs/tiny.toml --out $base/two $common $tok --set train.batch_size=4 > $base/two.log 2>&1
$TR train specs/tiny.toml --out $base/twoweak $common $tok --set train.batch_size=8 > $base/twoweak.log 2>&1
$TR train specs/tiny.toml --out $base/fsdp $common $tok --set train.batch_size=8 --set train.parallel=fsdp > $base/fsdp.log 2>&1
for r in one two twoweak fsdp; do
  .venv/bin/python - "$base/$r" <<'PY'
import json, statistics, sys
m = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
tps = [x["tokens_per_s"] for x in m if "tokens_per_s" in x][1:]
val = [x["val_loss"] for x in m if "val_loss" in x]
print(sys.argv[1].rsplit("/", 1)[1], "median tok/s", round(statistics.median(tps)), "range", round(min(tps)), round(max(tps)), "val", val[-1])
PY
done
