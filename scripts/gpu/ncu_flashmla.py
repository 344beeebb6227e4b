"""FlashMLA's dense bf16 decode on one case, for Nsight Compute (ncu_pair.sh): a few calls of
the very function anchors.py times, so that `ncu --launch-skip` can pick a warm one.
  python3 scripts/gpu/ncu_flashmla.py --ref .anchors B H CTX [--vary]
"""
import argparse

import torch

from anchors_lib import load_anchors

ap = argparse.ArgumentParser()
ap.add_argument("--ref", required=True)
ap.add_argument("batch", type=int)
ap.add_argument("heads", type=int)
ap.add_argument("ctx", type=int)
ap.add_argument("--vary", action="store_true")
ap.add_argument("--calls", type=int, default=4)
a = ap.parse_args()
A = load_anchors(a.ref)
A.shim_vllm(a.ref)
fm, err = A.load_flashmla(a.ref)
if err:
    raise SystemExit(f"FlashMLA not loaded: {err}")
c = A.make_case(a.batch, a.heads, a.ctx, 64, False, 0, a.vary)
fn = A.run_flashmla(fm, c)[0]
for _ in range(a.calls):
    fn()
torch.cuda.synchronize()
print("flashmla calls done")
