#!/bin/bash
# Measures headmix generate and train --init-from (issue 32): wall seconds of whole commands, three interleaved
# repeats (docs/performance.md). Usage: benchmarks/generate_and_init_from.sh (OUT=folder, PY=python; needs [hf]).
cd "$(dirname "$0")/.."
export PYTHONPATH=src
PY=${PY:-.venv/bin/python}
H="$PY -m headmix.cli.main"
M=${OUT:-/tmp/meas}; mkdir -p $M
# the source run (once): 100 steps of llama-tiny-mha on the embedded English corpus
[ -f $M/lm/summary.json ] || $H train lm --preset llama-tiny-mha --out $M/lm --max-steps 100 --no-progress
echo "source run: $(cat $M/lm/summary.json | head -c 300)"
$PY - "$M/llama" <<'PY'
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)).save_pretrained(sys.argv[1])
PY
t() { local s=$(date +%s.%N); "$@" > /dev/null 2>>$M/err.log; echo "rc=$? $(echo "$(date +%s.%N) - $s" | bc)"; }
T="--max-steps 5 --max-tokens 1024 --max-len 128 --no-progress"
for r in 1 2 3; do
  echo "uptime r$r: $(uptime)"
  echo "generate greedy 64 r$r: $(t $H generate $M/lm --prompt 'In the beginning' --max-new-tokens 64)"
  echo "generate sample 64 r$r: $(t $H generate $M/lm --prompt 'In the beginning' --max-new-tokens 64 --temperature 0.8 --top-p 0.9)"
  echo "generate 8 prompts greedy 64 r$r: $(t $H generate $M/lm --prompt 'In the beginning' --prompt 'And God said' --prompt 'The' --prompt 'Let there be' --prompt 'And it came to pass' --prompt 'He' --prompt 'Blessed are' --prompt 'In' --max-new-tokens 64)"
  echo "train preset 5 steps r$r: $(t $H train lm --preset llama-tiny-mha --tokenizer $M/lm/tokenizer --out $M/base$r $T)"
  echo "train init-from run 5 steps r$r: $(t $H train lm --init-from $M/lm --out $M/cont$r $T)"
  echo "train init-from hf llama->moh 5 steps r$r: $(t $H train lm --init-from $M/llama --init-options '{"attention": "moh", "num_shared_heads": 1, "top_k": 2}' --tokenizer $M/lm/tokenizer --out $M/hf$r $T)"
done
echo done
