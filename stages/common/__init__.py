"""What several stages share: CUDA headers by idea (attention.cuh: element types; mma.cuh: mma.sync,
ldmatrix and the online softmax on their fragments; cp_async.cuh; tma.cuh: TMA and mbarriers;
wgmma.cuh, whose wrappers gen_wgmma.py writes; moe.cuh), and launch code (attention.py,
fused_attention.py, hopper.py, moe.py)."""
