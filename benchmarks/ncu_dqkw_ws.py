import sys
sys.path.insert(0, "benchmarks")
import torch
from gdn_dqkw_ws_probe import inputs, run_ws
x = inputs(8, 4096, 16, 32)
for _ in range(4):
    run_ws(x, 128 ** -0.5, {})
torch.cuda.synchronize()
