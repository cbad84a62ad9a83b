"""What several stages share: CUDA headers by idea (attention.cuh: element types; mma.cuh: mma.sync,
ldmatrix and the online softmax on their fragments; cp_async.cuh; swizzle.cuh: stage 3's swizzled
tiles and the cp.async copies into them; tma.cuh: TMA and mbarriers; wgmma.cuh, whose wrappers
gen_wgmma.py writes; moe.cuh), launch code (attention.py,
fused_attention.py, hopper.py, moe.py), and what builds and launches any kernel: compiler.py (NVRTC,
cached on disk) and launcher.py (KernelSet: kernels by name on PyTorch tensors)."""
